"""The LightningModule of ``online``: the FC network (or the 5-layer CNN) trained one sample at a time.

With one sample per step BN cannot train (a dense BN layer has no batch statistics). BNP can: for a
dense layer at N = 1 the callback uses the paper's online update, μ_H = h and σ²_H = (h − μ)² with the
running μ (text after Alg. 2), and conv layers still have spatial statistics. LayerNorm (FC) and
GroupNorm (CNN) are the batch-independent baselines.
"""

from __future__ import annotations

from typing import Literal

from torch import nn

from example_projects.classifier import Classifier
from example_projects.models import cnn5, fc_network


class OnlineClassifier(Classifier):
    """The BNP paper's 3×100 FC network (or 5-layer CNN) for online learning.

    Args:
        network: ``"fc"`` (3 hidden layers of 100) or ``"cnn5"`` (3 conv 32-64-32 + 2 dense).
        norm: ``"none"`` (vanilla, or BNP with the callback), ``"ln"`` (FC only) or ``"gn"`` (CNN only).
        padding: the CNN's convolutions: ``"valid"`` (the paper's network, TensorFlow's default; images of
            at least 18×18) or ``"same"`` (any image of at least 4×4, e.g. the 8×8 digits).
        lr: learning rate (paper's Tables 2 and 3 at batch 1: FC vanilla 5e-4, LN 1e-2, BNP 0.1;
            CNN vanilla 1e-3, BNP 0.1).
        momentum: SGD momentum (paper: plain SGD).
        input_shape: image shape (c, h, w); linked from ``data.input_shape`` by the CLI.
        num_classes: number of classes; linked from ``data.num_classes`` by the CLI.
        compile: ``torch.compile`` the network (the fast path with BNP; README "Cost").

    Raises:
        ValueError: a normalization the network does not support.
    """

    def __init__(
        self,
        *,
        network: Literal["fc", "cnn5"] = "fc",
        norm: Literal["none", "ln", "gn"] = "none",
        padding: Literal["valid", "same"] = "valid",
        lr: float = 0.1,
        momentum: float = 0.0,
        input_shape: tuple[int, int, int] = (1, 28, 28),
        num_classes: int = 10,
        compile: bool = False,
    ) -> None:
        c, h, w = input_shape
        net: nn.Module
        if network == "fc":
            if norm == "gn":
                raise ValueError("`norm` 'gn' needs `network` 'cnn5'; the FC network takes 'none' or 'ln'")
            net = fc_network(c * h * w, num_classes, norm=norm)
        elif network == "cnn5":
            if norm == "ln":
                raise ValueError("`norm` 'ln' needs `network` 'fc'; the CNN takes 'none' or 'gn'")
            net = cnn5(c, h, num_classes, norm=norm, padding=padding)
        else:
            raise ValueError(f"`network` must be 'fc' or 'cnn5', got {network!r}")
        super().__init__(net, lr=lr, momentum=momentum, num_classes=num_classes, compile=compile)
        self.save_hyperparameters()
