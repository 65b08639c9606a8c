"""The ``transformer`` project's LightningModules and the LM's data (networks: :mod:`example_projects.transformers`).

BNP is not a model option: it is the ``lightning_bnp.BatchNormPreconditioning`` callback, named in the YAML config
under ``trainer.callbacks``; with its defaults it transforms every projection of both networks (q, k, v and
``out_proj`` of each ``nn.MultiheadAttention``, the MLP layers, the patch embedding, the head).
"""

from __future__ import annotations

from typing import Literal

import lightning.pytorch as pl
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from example_projects.classifier import Classifier, check_optimizer, make_optimizer
from example_projects.transformers import CORPUS_BYTES, VOCAB, CharLM, TransformerNorm, ViT, corpus_splits, torch_corpus
from lightning_bnp.core.validation import check_int


class ViTClassifier(Classifier):
    """:class:`~example_projects.transformers.ViT` trained as a classifier (SGD or Adam, accuracy metrics).

    Args:
        norm: ``"ln"`` (LayerNorm) or ``"none"`` (with the BNP callback: BNP in place of normalization).
        patch: patch side (must divide the image's sides; 7 on 28×28).
        d: token width.
        depth: number of blocks.
        heads: attention heads.
        lr: learning rate.
        momentum: SGD momentum.
        weight_decay: L2 weight decay.
        optimizer: ``"sgd"`` or ``"adam"``.
        input_shape: image shape (c, h, w) (the offline digits and MNIST: 1×28×28).
        num_classes: number of classes.
        compile: ``torch.compile`` the network.
    """

    def __init__(
        self,
        *,
        norm: TransformerNorm = "ln",
        patch: int = 7,
        d: int = 64,
        depth: int = 2,
        heads: int = 4,
        lr: float = 0.1,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        optimizer: Literal["sgd", "adam"] = "sgd",
        input_shape: tuple[int, int, int] = (1, 28, 28),
        num_classes: int = 10,
        compile: bool = False,
    ) -> None:
        network = ViT(input_shape, num_classes, patch=patch, d=d, depth=depth, heads=heads, norm=norm)
        super().__init__(
            network,
            lr=lr,
            momentum=momentum,
            num_classes=num_classes,
            weight_decay=weight_decay,
            optimizer=optimizer,
            compile=compile,
        )
        self.save_hyperparameters()


class CharLMModule(pl.LightningModule):
    """:class:`~example_projects.transformers.CharLM`: next-byte cross-entropy (nats per character), SGD or Adam.

    Logs ``train/loss``, ``val/loss`` and ``test/loss``.

    Args:
        norm: ``"ln"`` or ``"none"``.
        d: token width.
        depth: number of blocks.
        heads: attention heads.
        context: the longest sequence (must be ≥ the data's ``context``).
        lr: learning rate.
        momentum: SGD momentum (ignored by Adam).
        weight_decay: L2 weight decay.
        optimizer: ``"sgd"`` or ``"adam"``.
    """

    def __init__(
        self,
        *,
        norm: TransformerNorm = "ln",
        d: int = 128,
        depth: int = 2,
        heads: int = 4,
        context: int = 64,
        lr: float = 0.3,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        optimizer: Literal["sgd", "adam"] = "sgd",
    ) -> None:
        super().__init__()
        check_optimizer(lr, optimizer)
        self.save_hyperparameters()
        self.network = CharLM(VOCAB, d=d, depth=depth, heads=heads, context=context, norm=norm)
        self.lr, self.momentum, self.weight_decay, self.optimizer_name = lr, momentum, weight_decay, optimizer

    @override
    def forward(self, idx: Tensor) -> Tensor:
        return self.network(idx)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val/loss", self._loss(batch), prog_bar=True)

    @override
    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("test/loss", self._loss(batch))

    @override
    def configure_optimizers(self) -> OptimizerLRScheduler:
        return make_optimizer(self, self.optimizer_name, self.lr, self.momentum, self.weight_decay)


class Windows(Dataset[tuple[Tensor, Tensor]]):
    """Non-overlapping windows of ``context`` + 1 bytes: (input, next bytes)."""

    def __init__(self, ids: Tensor, context: int) -> None:
        self.ids, self.context = ids, context
        self.count = (len(ids) - 1) // context

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        w = self.ids[i * self.context : (i + 1) * self.context + 1]
        return w[:-1], w[1:]


class WindowsDataModule(pl.LightningDataModule):
    """Train / validation / test splits of a text (``splits``, one id tensor each) as :class:`Windows` of ``window``
    ids: every training window once per epoch, shuffled; ``batch_size`` training and ``eval_batch_size`` evaluation
    windows per batch. Subclasses set these four attributes."""

    splits: dict[str, Tensor]
    window: int
    batch_size: int
    eval_batch_size: int

    def _loader(self, split: str, batch_size: int, shuffle: bool) -> DataLoader:
        return DataLoader(Windows(self.splits[split], self.window), batch_size=batch_size, shuffle=shuffle)

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader("train", self.batch_size, True)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader("val", self.eval_batch_size, False)

    @override
    def test_dataloader(self) -> DataLoader:
        return self._loader("test", self.eval_batch_size, False)


class CorpusDataModule(WindowsDataModule):
    """The first ``max_bytes`` bytes of the installed torch package's ``.py`` sources
    (:func:`~example_projects.transformers.torch_corpus`), 90% train / 5% validation / 5% test, as non-overlapping
    windows of ``context`` bytes (an epoch: every training window once, shuffled). Nothing is downloaded; the text
    differs between torch versions.

    Args:
        context: bytes per window.
        batch_size: training windows per batch.
        eval_batch_size: windows per validation / test batch.
        max_bytes: how much of the sources to read.
    """

    def __init__(
        self, *, context: int = 64, batch_size: int = 32, eval_batch_size: int = 256, max_bytes: int = CORPUS_BYTES
    ) -> None:
        super().__init__()
        for name, value in (("context", context), ("batch_size", batch_size), ("eval_batch_size", eval_batch_size)):
            check_int(name, value, low=1)
        check_int("max_bytes", max_bytes, low=context * 20 + 1)
        self.save_hyperparameters()
        self.window, self.batch_size, self.eval_batch_size, self.max_bytes = (
            context,
            batch_size,
            eval_batch_size,
            max_bytes,
        )
        self.splits: dict[str, Tensor] = {}

    @override
    def setup(self, stage: str) -> None:
        if not self.splits:
            self.splits = corpus_splits(torch_corpus(self.max_bytes))
