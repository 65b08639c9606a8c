"""A small LightningModule that trains any classifier network with SGD (or Adam) and logs torchmetrics accuracy.

The example projects' LightningModules subclass it and build ``network`` from simple typed arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, cast

import lightning.pytorch as pl
import torch
import torchmetrics
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override


def check_optimizer(lr: float, optimizer: str) -> None:
    """The examples' optimizer arguments: ``lr`` > 0, ``optimizer`` ``"sgd"`` or ``"adam"``."""
    if lr <= 0:
        raise ValueError(f"`lr` must be > 0, got {lr}")
    if optimizer not in ("sgd", "adam"):
        raise ValueError(f"`optimizer` must be 'sgd' or 'adam', got {optimizer!r}")


def make_optimizer(module: nn.Module, name: str, lr: float, momentum: float, weight_decay: float) -> Optimizer:
    """Adam (momentum unused) or SGD with momentum over every parameter of ``module``."""
    if name == "adam":
        return torch.optim.Adam(module.parameters(), lr=lr, weight_decay=weight_decay)
    return torch.optim.SGD(module.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)


class Classifier(pl.LightningModule):
    """Cross-entropy classifier.

    Args:
        network: the model mapping images to logits.
        lr: learning rate.
        momentum: SGD momentum (ignored by Adam).
        num_classes: number of classes for the accuracy metrics.
        weight_decay: L2 weight decay of the optimizer, on every parameter.
        optimizer: ``"sgd"`` (the BNP paper's choice almost everywhere) or ``"adam"``.
        compile: run the network through ``torch.compile`` (the fast path with BNP: its statistics hooks
            are traced into the compiled forward; README "Cost"). Compiled on the first forward, after the
            callbacks registered their hooks; the parameters and checkpoints are the uncompiled network's.
    """

    def __init__(
        self,
        network: nn.Module,
        *,
        lr: float = 0.1,
        momentum: float = 0.0,
        num_classes: int = 10,
        weight_decay: float = 0.0,
        optimizer: Literal["sgd", "adam"] = "sgd",
        compile: bool = False,
    ) -> None:
        super().__init__()
        check_optimizer(lr, optimizer)
        self.network = network
        self.lr = lr
        self.momentum = momentum
        self.weight_decay = weight_decay
        self.optimizer_name = optimizer
        self.compile_network = compile  # not `self.compile`: nn.Module.compile is a method
        self._compiled: Callable[[Tensor], Tensor] | None = None
        self.loss_fn = nn.CrossEntropyLoss()
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = torchmetrics.classification.MulticlassAccuracy(num_classes, average="micro")

    @override
    def forward(self, x: Tensor) -> Tensor:
        if not self.compile_network:
            return self.network(x)
        if self._compiled is None:  # a plain attribute, not a submodule: names and state dict stay the network's
            self._compiled = torch.compile(self.network)
        return self._compiled(x)

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = self.loss_fn(self(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val/loss", self.loss_fn(logits, y))
        self.log("val/acc", self.val_acc, prog_bar=True)

    @override
    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.test_acc(self(x), y)
        self.log("test/acc", self.test_acc)

    @override
    def configure_optimizers(self) -> OptimizerLRScheduler:
        return make_optimizer(self, self.optimizer_name, self.lr, self.momentum, self.weight_decay)


class ScheduledClassifier(Classifier):
    """Momentum SGD with a learning-rate warm-up and step decay, as the BNP paper's ResNets (Appendix B).

    The warm-up is a per-step scheduler — :class:`~torch.optim.lr_scheduler.ConstantLR` (He et al. 2016a's
    "0.01 until training error is below 80%, about 400 iterations, then back to 0.1") or
    :class:`~torch.optim.lr_scheduler.LinearLR` (0.01 rising to 0.1, Appendix B for GN and BNP+GN) — and
    the decay a per-epoch :class:`~torch.optim.lr_scheduler.MultiStepLR` on the same optimizer; both are
    chainable, so the decay multiplies whatever the warm-up left.

    Args:
        network: the model mapping images to logits.
        lr: peak learning rate.
        momentum: SGD momentum.
        num_classes: number of classes for the accuracy metrics.
        weight_decay: SGD's L2 weight decay on every parameter (after BNP's transform: decay in z, README).
        warmup: ``"constant"`` or ``"linear"``.
        warmup_start_lr: learning rate during (constant) or at the start of (linear) the warm-up.
        warmup_steps: optimizer steps of the warm-up (0: none).
        milestones: epochs at which the learning rate is multiplied by ``lr_decay``.
        lr_decay: the factor applied at each milestone.
        compile: ``torch.compile`` the network.
    """

    def __init__(
        self,
        network: nn.Module,
        *,
        lr: float,
        momentum: float,
        num_classes: int,
        weight_decay: float,
        warmup: Literal["constant", "linear"],
        warmup_start_lr: float,
        warmup_steps: int,
        milestones: tuple[int, ...],
        lr_decay: float,
        compile: bool,
    ) -> None:
        if warmup not in ("constant", "linear"):
            raise ValueError(f"`warmup` must be 'constant' or 'linear', got {warmup!r}")
        if not 0 < warmup_start_lr <= lr:
            raise ValueError(f"`warmup_start_lr` must be in (0, lr={lr}], got {warmup_start_lr}")
        if warmup_steps < 0:
            raise ValueError(f"`warmup_steps` must be >= 0, got {warmup_steps}")
        if not 0 < lr_decay <= 1:
            raise ValueError(f"`lr_decay` must be in (0, 1], got {lr_decay}")
        super().__init__(
            network, lr=lr, momentum=momentum, num_classes=num_classes, weight_decay=weight_decay, compile=compile
        )
        self.warmup, self.warmup_start_lr, self.warmup_steps = warmup, warmup_start_lr, warmup_steps
        self.milestones, self.lr_decay = list(milestones), lr_decay

    @override
    def configure_optimizers(self) -> OptimizerLRScheduler:
        optimizer = torch.optim.SGD(
            self.parameters(), lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay
        )
        schedulers: list[dict[str, Any]] = []
        if self.warmup_steps:
            factor = self.warmup_start_lr / self.lr
            warmup = (
                torch.optim.lr_scheduler.ConstantLR(optimizer, factor=factor, total_iters=self.warmup_steps)
                if self.warmup == "constant"
                else torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=factor, total_iters=self.warmup_steps)
            )
            schedulers.append({"scheduler": warmup, "interval": "step", "name": "lr/warmup"})
        decay = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=self.milestones, gamma=self.lr_decay)
        schedulers.append({"scheduler": decay, "interval": "epoch", "name": "lr/decay"})
        # Lightning accepts scheduler dicts here; its type alias only names the LRSchedulerConfig dataclass
        return cast(OptimizerLRScheduler, ([optimizer], schedulers))
