"""The ``char_rnn`` project's LightningModule and data: a character-level LSTM (or GRU) on a text that ships with
Python (network and text: :mod:`example_projects.char_text`).

BNP is not a model option: it is the ``lightning_bnp.BatchNormPreconditioning`` callback, named in the YAML config
under ``trainer.callbacks``; with its defaults it transforms the recurrent layer's ``weight_ih`` and ``weight_hh`` (one
linear layer on [x_t ; h_{t−1}], shared over time, its bias pair treated as the one bias it is) and the read-out.
"""

from __future__ import annotations

import math
from typing import Literal

import lightning.pytorch as pl
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from torch import Tensor, nn
from typing_extensions import override

from example_projects.char_text import EMBED, HIDDEN, Cell, CharRNN, text_splits
from example_projects.classifier import check_optimizer, make_optimizer
from example_projects.transformer.model import WindowsDataModule
from lightning_bnp.core.validation import check_int


class CharRNNModule(pl.LightningModule):
    """:class:`~example_projects.char_text.CharRNN`: next-character cross-entropy, SGD or Adam.

    Logs ``train/loss`` (nats per character) and bits per character: ``train/bpc``, ``val/bpc``, ``test/bpc``.

    Args:
        cell: ``"LSTM"`` or ``"GRU"``.
        embed: width of the character embedding.
        hidden: units of the recurrent layer.
        lr: learning rate.
        momentum: SGD momentum (ignored by Adam).
        weight_decay: L2 weight decay.
        optimizer: ``"sgd"`` or ``"adam"``.
        vocabulary: number of distinct characters; linked from ``data.vocabulary`` by the CLI.
    """

    def __init__(
        self,
        *,
        cell: Cell = "LSTM",
        embed: int = EMBED,
        hidden: int = HIDDEN,
        lr: float = 1.0,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        optimizer: Literal["sgd", "adam"] = "sgd",
        vocabulary: int = 95,
    ) -> None:
        super().__init__()
        check_optimizer(lr, optimizer)
        self.save_hyperparameters()
        self.network = CharRNN(cell, vocabulary, embed=embed, hidden=hidden)
        self.lr, self.momentum, self.weight_decay, self.optimizer_name = lr, momentum, weight_decay, optimizer

    @override
    def forward(self, tokens: Tensor) -> Tensor:
        return self.network(tokens)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss)
        self.log("train/bpc", loss / math.log(2), prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val/bpc", self._loss(batch) / math.log(2), prog_bar=True)

    @override
    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("test/bpc", self._loss(batch) / math.log(2))

    @override
    def configure_optimizers(self) -> OptimizerLRScheduler:
        return make_optimizer(self, self.optimizer_name, self.lr, self.momentum, self.weight_decay)


class CharTextDataModule(WindowsDataModule):
    """:func:`~example_projects.char_text.text_splits` (the docstrings of 18 standard-library modules, 80% train /
    10% validation / 10% test, in order) as non-overlapping windows of ``window`` characters and their next characters
    (an epoch: every training window once, shuffled). Nothing is downloaded.

    Args:
        window: characters per window (the recurrent state starts at zero in each).
        batch_size: training windows per batch (1: online).
        eval_batch_size: windows per validation / test batch.

    Attributes:
        vocabulary: the number of distinct characters, known once built (the CLI links it into the model).
    """

    def __init__(self, *, window: int = 32, batch_size: int = 32, eval_batch_size: int = 256) -> None:
        super().__init__()
        for name, value in (("window", window), ("batch_size", batch_size), ("eval_batch_size", eval_batch_size)):
            check_int(name, value, low=1)
        self.save_hyperparameters()
        self.window, self.batch_size, self.eval_batch_size = window, batch_size, eval_batch_size
        self.splits, self.vocabulary = text_splits()
