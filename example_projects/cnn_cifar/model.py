"""The LightningModule of ``cnn_cifar``: the 5-layer CNN of the BNP paper's §5 (TensorFlow's CIFAR-10 tutorial CNN)."""

from __future__ import annotations

from typing import Literal

from example_projects.classifier import Classifier
from example_projects.models import cnn5


class CNNClassifier(Classifier):
    """Three 3×3 convolutions (32-64-32 filters, ReLU, max-pooling after the first two) and two dense layers.

    BNP is the ``lightning_bnp.BatchNormPreconditioning`` callback named in the YAML config; with it,
    ``norm`` stays ``"none"``.

    Args:
        norm: ``"none"`` (vanilla, or BNP with the callback), ``"bn"``, ``"gn"``, ``"renorm"`` (Batch
            Renormalization, Ioffe 2017) or ``"bn4"`` ("BN with 4 things", Summers & Dinneen 2020) after each
            convolution's ReLU (:mod:`example_projects.norms`).
        padding: the CNN's convolutions: ``"valid"`` (the paper's network, TensorFlow's default; images of
            at least 18×18) or ``"same"`` (any image of at least 4×4, e.g. the 8×8 digits).
        gn_groups: GroupNorm's number of groups (must divide 32 and 64).
        ghost_batch_size: ``bn4``: samples per ghost batch (0: the whole batch).
        bn4_gn_groups: ``bn4``: groups of the affine-free GroupNorm before BN (0: none).
        example_weight: ``bn4``: the inference example weight α in [0, 1).
        lr: learning rate (paper's Table 3, CIFAR-10: batch 128 → 0.1 for vanilla, BN and BNP;
            batch 2 → vanilla 1e-3, BN 1e-3, BNP 1e-2).
        momentum: SGD momentum (paper: plain SGD).
        weight_decay: L2 weight decay on every parameter, the norms' γ and β included (one of the "4 things").
        optimizer: ``"sgd"`` or ``"adam"`` (the paper used Adam for the vanilla network at batch 128 and for
            "BN with 4 things").
        input_shape: image shape (c, h, w); linked from ``data.input_shape`` by the CLI.
        num_classes: number of classes; linked from ``data.num_classes`` by the CLI.
        compile: ``torch.compile`` the network (the fast path with BNP; README "Cost").
    """

    def __init__(
        self,
        *,
        norm: Literal["none", "bn", "gn", "renorm", "bn4"] = "none",
        padding: Literal["valid", "same"] = "valid",
        gn_groups: int = 4,
        ghost_batch_size: int = 0,
        bn4_gn_groups: int = 0,
        example_weight: float = 0.0,
        lr: float = 0.1,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        optimizer: Literal["sgd", "adam"] = "sgd",
        input_shape: tuple[int, int, int] = (3, 32, 32),
        num_classes: int = 10,
        compile: bool = False,
    ) -> None:
        c, h, _ = input_shape
        network = cnn5(
            c,
            h,
            num_classes,
            norm=norm,
            groups=gn_groups,
            padding=padding,
            ghost_batch_size=ghost_batch_size,
            bn4_gn_groups=bn4_gn_groups,
            example_weight=example_weight,
        )
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
