"""A small LightningModule that trains any classifier network with SGD and logs torchmetrics accuracy."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torchmetrics
from torch import Tensor, nn
from typing_extensions import override


class Classifier(pl.LightningModule):
    """Cross-entropy classifier.

    Args:
        network: the model mapping images to logits.
        lr: SGD learning rate.
        momentum: SGD momentum.
        num_classes: number of classes for the accuracy metrics.
    """

    def __init__(self, network: nn.Module, *, lr: float = 0.1, momentum: float = 0.0, num_classes: int = 10) -> None:
        super().__init__()
        self.network = network
        self.lr = lr
        self.momentum = momentum
        self.loss_fn = nn.CrossEntropyLoss()
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = torchmetrics.classification.MulticlassAccuracy(num_classes, average="micro")

    @override
    def forward(self, x: Tensor) -> Tensor:
        return self.network(x)

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
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)
