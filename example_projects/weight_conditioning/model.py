"""The LightningModule of ``weight_conditioning``: the networks that Weight Conditioning is compared on.

Weight Conditioning (paper 004, "BN + E") is not a model option: it is the
``lightning_bnp.WeightConditioning`` callback named in the YAML config, which equilibrates the
selected layers' weights with a parametrization at setup. Paper 004 §6.1 applies it to the first
convolution and the last dense layer of BN networks (``layers: first_and_last``), trained with SGD at
lr 1e-3 and batch 128; its §6.3 applies it to an MLP without normalization (NeRF).
"""

from __future__ import annotations

from typing import Literal

from torch import nn

from example_projects.classifier import Classifier
from example_projects.models import cnn5, fc_network


class WCClassifier(Classifier):
    """The BNP paper's 5-layer CNN or 3×100 MLP, with or without BN, for Weight Conditioning comparisons.

    Args:
        network: ``"cnn5"`` (3 conv 32-64-32 + 2 dense) or ``"mlp"`` (3 hidden layers of 100, ReLU).
        norm: ``"bn"`` (BatchNorm after each hidden activation) or ``"none"``.
        padding: the CNN's convolutions: ``"valid"`` (the paper's network, TensorFlow's default; images of
            at least 18×18) or ``"same"`` (any image of at least 4×4, e.g. the 8×8 digits).
        lr: learning rate (paper 004 §6.1: SGD, 1e-3).
        momentum: SGD momentum.
        weight_decay: L2 weight decay.
        input_shape: image shape (c, h, w); linked from ``data.input_shape`` by the CLI.
        num_classes: number of classes; linked from ``data.num_classes`` by the CLI.
        compile: ``torch.compile`` the network (the fast path with BNP; README "Cost").

    Raises:
        ValueError: an unknown network or normalization.
    """

    def __init__(
        self,
        *,
        network: Literal["cnn5", "mlp"] = "cnn5",
        norm: Literal["none", "bn"] = "bn",
        padding: Literal["valid", "same"] = "valid",
        lr: float = 1e-3,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        input_shape: tuple[int, int, int] = (3, 32, 32),
        num_classes: int = 10,
        compile: bool = False,
    ) -> None:
        if norm not in ("none", "bn"):
            raise ValueError(f"`norm` must be 'none' or 'bn', got {norm!r}")
        c, h, w = input_shape
        net: nn.Module
        if network == "cnn5":
            net = cnn5(c, h, num_classes, norm=norm, padding=padding)
        elif network == "mlp":
            net = fc_network(c * h * w, num_classes, norm=norm)
        else:
            raise ValueError(f"`network` must be 'cnn5' or 'mlp', got {network!r}")
        super().__init__(
            net, lr=lr, momentum=momentum, num_classes=num_classes, weight_decay=weight_decay, compile=compile
        )
        self.save_hyperparameters()
