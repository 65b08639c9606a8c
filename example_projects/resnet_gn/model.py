"""The LightningModule of ``resnet_gn``: CIFAR ResNets trained as in the BNP paper's Appendix B.

Appendix B (ResNet-110 on CIFAR-10, after He et al. 2016a): momentum SGD (0.9), weight decay 1e-4
(1.5e-4 for BNP+GN), batch 128, learning rate 0.1 divided by 10 at epochs 80 and 120, a linear
warm-up from 0.01 to 0.1 (400 iterations for BN; 1 or 2 epochs for GN and BNP+GN), GroupNorm with
group size 4, and for BNP+GN He-normal weights scaled by 0.1.

The warm-up is a per-step :class:`~torch.optim.lr_scheduler.LinearLR` and the decay a per-epoch
:class:`~torch.optim.lr_scheduler.MultiStepLR` on the same optimizer; both are chainable
schedulers, so the decay multiplies whatever the warm-up left.
"""

from __future__ import annotations

from typing import Any, Literal, cast

import torch
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from typing_extensions import override

from example_projects.classifier import Classifier
from example_projects.models import cifar_resnet


class ResNetClassifier(Classifier):
    """CIFAR ResNet-``depth`` with BN, GN or no normalization, momentum SGD, warm-up and step decay.

    BNP+GN is ``norm: gn`` plus the ``lightning_bnp.BatchNormPreconditioning`` callback in the config.

    Args:
        depth: 6n + 2 (20 for quick runs and CI, 110 as in the paper).
        norm: ``"bn"``, ``"gn"`` or ``"none"``.
        gn_groups: GroupNorm's number of groups. Appendix B says "group size 4"; we read it as 4
            groups, matching its ImageNet "group size 32", which is Wu & He's default of 32 groups.
        init_scale: factor on the He-normal weights (Appendix B: 0.1 for BNP+GN on CIFAR-10).
        lr: peak learning rate (paper: 0.1).
        momentum: SGD momentum (paper: 0.9).
        weight_decay: L2 weight decay (paper: 1e-4; 1.5e-4 for BNP+GN).
        warmup_start_lr: learning rate of the first step of the linear warm-up (paper: 0.01).
        warmup_steps: optimizer steps of the warm-up (0: none). Paper: 400 for BN; 1–2 epochs for
            GN and BNP+GN (CIFAR-10 at batch 128 has 391 steps per epoch).
        milestones: epochs at which the learning rate is multiplied by ``lr_decay`` (paper: 80, 120).
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
        gn_groups: int = 4,
        init_scale: float = 1.0,
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 1e-4,
        warmup_start_lr: float = 0.01,
        warmup_steps: int = 400,
        milestones: tuple[int, ...] = (80, 120),
        lr_decay: float = 0.1,
        input_shape: tuple[int, int, int] = (3, 32, 32),
        num_classes: int = 10,
        compile: bool = False,
    ) -> None:
        if not 0 < warmup_start_lr <= lr:
            raise ValueError(f"`warmup_start_lr` must be in (0, lr={lr}], got {warmup_start_lr}")
        if warmup_steps < 0:
            raise ValueError(f"`warmup_steps` must be >= 0, got {warmup_steps}")
        if not 0 < lr_decay <= 1:
            raise ValueError(f"`lr_decay` must be in (0, 1], got {lr_decay}")
        network = cifar_resnet(depth, input_shape[0], num_classes, norm=norm, groups=gn_groups, init_scale=init_scale)
        super().__init__(
            network, lr=lr, momentum=momentum, num_classes=num_classes, weight_decay=weight_decay, compile=compile
        )
        self.warmup_start_lr, self.warmup_steps = warmup_start_lr, warmup_steps
        self.milestones, self.lr_decay = list(milestones), lr_decay
        self.save_hyperparameters()

    @override
    def configure_optimizers(self) -> OptimizerLRScheduler:
        optimizer = torch.optim.SGD(
            self.parameters(), lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay
        )
        schedulers: list[dict[str, Any]] = []
        if self.warmup_steps:
            warmup = torch.optim.lr_scheduler.LinearLR(
                optimizer, start_factor=self.warmup_start_lr / self.lr, total_iters=self.warmup_steps
            )
            schedulers.append({"scheduler": warmup, "interval": "step", "name": "lr/warmup"})
        decay = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=self.milestones, gamma=self.lr_decay)
        schedulers.append({"scheduler": decay, "interval": "epoch", "name": "lr/decay"})
        # Lightning accepts scheduler dicts here; its type alias only names the LRSchedulerConfig dataclass
        return cast(OptimizerLRScheduler, ([optimizer], schedulers))
