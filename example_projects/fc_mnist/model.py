"""The LightningModule of ``fc_mnist``: the FC network of Ioffe & Szegedy used in the BNP paper's §5."""

from __future__ import annotations

from typing import Literal

from example_projects.classifier import Classifier
from example_projects.models import fc_network


class FCClassifier(Classifier):
    """Hidden layers of ``hidden`` units with ReLU, optional post-activation BN/LN, trained with SGD.

    BNP is not a model option: it is the ``lightning_bnp.BatchNormPreconditioning`` callback, named
    in the YAML config under ``trainer.callbacks``; with it, ``norm`` stays ``"none"``.

    Args:
        norm: ``"none"`` (vanilla, or BNP with the callback), ``"bn"``, ``"ln"`` or ``"renorm"`` (Batch
            Renormalization, Ioffe 2017: the paper's baseline at batch 6).
        hidden: width of each hidden layer (paper: 100).
        depth: number of hidden layers (paper: 3; 2 in the §5.1 condition-number experiment).
        lr: learning rate (paper's Table 2 on MNIST, batch 60: vanilla 0.1, BN 0.5, BNP 0.5, LN 0.1; on
            CIFAR-10 at batch 60: vanilla 1e-2, BN 0.5, BNP 0.1, LN 0.5; at batch 6: vanilla 5e-3, the others 5e-2).
        momentum: SGD momentum (paper: plain SGD).
        weight_decay: L2 weight decay.
        optimizer: ``"sgd"`` or ``"adam"``.
        input_shape: image shape (c, h, w); linked from ``data.input_shape`` by the CLI.
        num_classes: number of classes; linked from ``data.num_classes`` by the CLI.
        compile: ``torch.compile`` the network (the fast path with BNP; README "Cost").
    """

    def __init__(
        self,
        *,
        norm: Literal["none", "bn", "ln", "renorm"] = "none",
        hidden: int = 100,
        depth: int = 3,
        lr: float = 0.1,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        optimizer: Literal["sgd", "adam"] = "sgd",
        input_shape: tuple[int, int, int] = (1, 28, 28),
        num_classes: int = 10,
        compile: bool = False,
    ) -> None:
        c, h, w = input_shape
        network = fc_network(c * h * w, num_classes, hidden=hidden, depth=depth, norm=norm)
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
