"""A small LightningModule that trains any classifier network with SGD (or Adam) and logs torchmetrics accuracy.

The example projects' LightningModules subclass it and build ``network`` from simple typed arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import lightning.pytorch as pl
import torch
import torchmetrics
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from torch import Tensor, nn
from typing_extensions import override


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
        if lr <= 0:
            raise ValueError(f"`lr` must be > 0, got {lr}")
        if optimizer not in ("sgd", "adam"):
            raise ValueError(f"`optimizer` must be 'sgd' or 'adam', got {optimizer!r}")
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
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)
