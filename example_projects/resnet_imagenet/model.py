"""The LightningModule of ``resnet_imagenet``: ResNet-18 trained as in the BNP paper's Appendix B.

Appendix B (ResNet-18 on ImageNet, after Krizhevsky et al. 2012): 224×224 crops of each image or its
horizontal flip, momentum SGD (0.9), weight decay 1e-4 (BNP+GN: 8.5e-4), batch 256 on one GPU, learning
rate 0.1 divided by 10 at epochs 30, 60 and 90, GroupNorm with group size 32 for GN and BNP+GN. No
warm-up is given for ImageNet, so there is none.
"""

from __future__ import annotations

from typing import Literal

from example_projects.classifier import ScheduledClassifier
from example_projects.models import resnet18


class ResNet18Classifier(ScheduledClassifier):
    """torchvision's ResNet-18 with BN or GN, momentum SGD and step decay.

    BNP+GN is ``norm: gn`` plus the ``lightning_bnp.BatchNormPreconditioning`` callback in the config.

    Args:
        norm: ``"bn"`` or ``"gn"``.
        gn_groups: GroupNorm's number of groups (Appendix B: 32).
        lr: learning rate (paper: 0.1).
        momentum: SGD momentum (paper: 0.9).
        weight_decay: SGD's weight decay (paper: 1e-4; BNP+GN 8.5e-4). After BNP's transform SGD adds λ·p to
            M·∇L: that is weight decay in z (README's table).
        warmup: ``"constant"`` or ``"linear"`` (only with ``warmup_steps`` > 0).
        warmup_start_lr: the warm-up's learning rate.
        warmup_steps: optimizer steps of the warm-up (paper: none for ImageNet).
        milestones: epochs at which the learning rate is multiplied by ``lr_decay`` (paper: 30, 60, 90).
        lr_decay: the factor applied at each milestone (paper: 0.1).
        input_shape: image shape (c, h, w); linked from ``data.input_shape`` by the CLI.
        num_classes: number of classes; linked from ``data.num_classes`` by the CLI.
        compile: ``torch.compile`` the network (the fast path with BNP; README "Cost").
    """

    def __init__(
        self,
        *,
        norm: Literal["bn", "gn"] = "bn",
        gn_groups: int = 32,
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 1e-4,
        warmup: Literal["constant", "linear"] = "constant",
        warmup_start_lr: float = 0.01,
        warmup_steps: int = 0,
        milestones: tuple[int, ...] = (30, 60, 90),
        lr_decay: float = 0.1,
        input_shape: tuple[int, int, int] = (3, 224, 224),
        num_classes: int = 1000,
        compile: bool = False,
    ) -> None:
        network = resnet18(input_shape[0], num_classes, norm=norm, groups=gn_groups)
        super().__init__(
            network,
            lr=lr,
            momentum=momentum,
            num_classes=num_classes,
            weight_decay=weight_decay,
            warmup=warmup,
            warmup_start_lr=warmup_start_lr,
            warmup_steps=warmup_steps,
            milestones=milestones,
            lr_decay=lr_decay,
            compile=compile,
        )
        self.save_hyperparameters()
