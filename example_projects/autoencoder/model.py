"""The LightningModule of ``autoencoder``: an autoencoder whose decoder upsamples with ``ConvTranspose2d``
(network: :func:`example_projects.decoders.conv_autoencoder`), trained on squared reconstruction error.

BNP is not a model option: it is the ``lightning_bnp.BatchNormPreconditioning`` callback, named in the YAML config
under ``trainer.callbacks`` (``conv_statistics: channel`` or ``column`` for the transposed convolutions); with it,
``norm`` stays ``"none"``. ``norm: bn`` is the usual decoder with BatchNorm after the reshape and the first transposed
convolution, evaluated with its running statistics (Lightning's eval mode), as it would be deployed.
"""

from __future__ import annotations

from typing import Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from torch import Tensor
from typing_extensions import override

from example_projects.classifier import check_optimizer, make_optimizer
from example_projects.decoders import DecoderNorm, conv_autoencoder

SHOWN = 8  # reconstructions drawn to TensorBoard at each validation


class Autoencoder(pl.LightningModule):
    """Squared reconstruction error of the images (the labels are not used), SGD with momentum or Adam.

    Logs the mean squared error per pixel as ``train/loss``, ``val/loss`` and ``test/loss``, and with TensorBoard the
    first validation images above their reconstructions (``val/reconstructions``).

    Args:
        norm: ``"none"`` (vanilla, or BNP with the callback) or ``"bn"`` (BatchNorm in the decoder).
        code: width of the bottleneck.
        width: channels of the decoder's first map.
        lr: learning rate.
        momentum: SGD momentum (ignored by Adam; benchmarks/RESULTS.md §9 trains with 0.9).
        weight_decay: L2 weight decay.
        optimizer: ``"sgd"`` or ``"adam"``.
        input_shape: image shape (c, h, w), sides multiples of 4; linked from ``data.input_shape`` by the CLI.
    """

    def __init__(
        self,
        *,
        norm: DecoderNorm = "none",
        code: int = 64,
        width: int = 32,
        lr: float = 0.5,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        optimizer: Literal["sgd", "adam"] = "sgd",
        input_shape: tuple[int, int, int] = (1, 28, 28),
    ) -> None:
        super().__init__()
        check_optimizer(lr, optimizer)
        self.save_hyperparameters()
        self.network = conv_autoencoder(input_shape, code=code, width=width, norm=norm)
        self.lr, self.momentum, self.weight_decay, self.optimizer_name = lr, momentum, weight_decay, optimizer

    @override
    def forward(self, x: Tensor) -> Tensor:
        return self.network(x)

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, _ = batch
        loss = (self(x) - x).square().mean()
        self.log("train/loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, _ = batch
        out = self(x)
        self.log("val/loss", (out - x).square().mean(), prog_bar=True)
        if batch_idx == 0 and isinstance(self.logger, TensorBoardLogger):
            shown = x[:SHOWN].clamp(0, 1), out[:SHOWN].clamp(0, 1)
            self.logger.experiment.add_images("val/reconstructions", torch.cat(shown), self.global_step)

    @override
    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, _ = batch
        self.log("test/loss", (self(x) - x).square().mean())

    @override
    def configure_optimizers(self) -> OptimizerLRScheduler:
        return make_optimizer(self, self.optimizer_name, self.lr, self.momentum, self.weight_decay)
