"""The LightningModule of ``resnet_gn``: CIFAR ResNets trained as in the BNP paper's Appendix B.

Appendix B (ResNet-110 on CIFAR-10, after He et al. 2016a): momentum SGD (0.9), weight decay 1e-4
(1.5e-4 for BNP+GN), batch 128, learning rate 0.1 divided by 10 at epochs 80 and 120, a warm-up at
0.01 (400 iterations for BN, constant as in He et al.; a linear rise over 1 or 2 epochs for GN and
BNP+GN), GroupNorm with group size 4, and for BNP+GN He-normal weights scaled by 0.1. The
pre-activation ResNet-110 on CIFAR-100 (He et al. 2016b) decays at epochs 150 and 220; its BNP+GN
uses weight decay 2e-4 and He-normal ×0.4. The schedule is :class:`~example_projects.classifier.ScheduledClassifier`'s.
"""

from __future__ import annotations

from typing import Literal

from example_projects.classifier import ScheduledClassifier
from example_projects.models import cifar_resnet


class ResNetClassifier(ScheduledClassifier):
    """CIFAR ResNet-``depth`` (plain or pre-activation) with BN, GN or no normalization, momentum SGD,
    warm-up and step decay.

    BNP+GN is ``norm: gn`` plus the ``lightning_bnp.BatchNormPreconditioning`` callback in the config; BNP
    alone is ``norm: none`` plus the callback.

    Args:
        depth: 6n + 2 (20 for quick runs and CI, 110 as in the paper).
        norm: ``"bn"``, ``"gn"`` or ``"none"``.
        preact: the pre-activation ResNet of He et al. (2016b) (the paper's CIFAR-100 network).
        gn_groups: GroupNorm's number of groups. Appendix B says "group size 4"; we read it as 4
            groups, matching its ImageNet "group size 32", which is Wu & He's default of 32 groups.
        init_scale: factor on the He-normal weights (Appendix B: 0.1 for BNP+GN on CIFAR-10, 0.4 on CIFAR-100).
        lr: peak learning rate (paper: 0.1).
        momentum: SGD momentum (paper: 0.9).
        weight_decay: SGD's weight decay (paper: 1e-4; BNP+GN 1.5e-4 on CIFAR-10, 2e-4 on CIFAR-100).
            After BNP's transform SGD adds λ·p to M·∇L: that is weight decay in z (README's table).
        warmup: ``"constant"`` (He et al.'s BN warm-up) or ``"linear"`` (Appendix B's GN and BNP+GN).
        warmup_start_lr: the warm-up's learning rate (constant) or first learning rate (linear) (paper: 0.01).
        warmup_steps: optimizer steps of the warm-up (0: none). Paper: 400 for BN; 1–2 epochs for
            GN and BNP+GN (CIFAR at batch 128 with all 50k training images has 391 steps per epoch).
        milestones: epochs at which the learning rate is multiplied by ``lr_decay`` (paper: 80, 120 on
            CIFAR-10; 150, 220 on CIFAR-100).
        lr_decay: the factor applied at each milestone (paper: 0.1).
        input_shape: image shape (c, h, w); linked from ``data.input_shape`` by the CLI.
        num_classes: number of classes; linked from ``data.num_classes`` by the CLI.
        compile: ``torch.compile`` the network (the fast path with BNP; README "Cost").
    """

    def __init__(
        self,
        *,
        depth: int = 20,
        norm: Literal["bn", "gn", "none"] = "bn",
        preact: bool = False,
        gn_groups: int = 4,
        init_scale: float = 1.0,
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 1e-4,
        warmup: Literal["constant", "linear"] = "constant",
        warmup_start_lr: float = 0.01,
        warmup_steps: int = 400,
        milestones: tuple[int, ...] = (80, 120),
        lr_decay: float = 0.1,
        input_shape: tuple[int, int, int] = (3, 32, 32),
        num_classes: int = 10,
        compile: bool = False,
    ) -> None:
        network = cifar_resnet(
            depth, input_shape[0], num_classes, norm=norm, groups=gn_groups, init_scale=init_scale, preact=preact
        )
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
