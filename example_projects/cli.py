"""The LightningCLI shared by the example projects.

Each project's ``__main__`` calls :func:`run_cli` with its LightningModule. The CLI

* uses :class:`~example_projects.data.ImageDataModule` as the data (``data.*`` in YAML), with the
  project's preferred torchvision dataset for ``data.dataset: auto``;
* links the data's ``input_shape`` and ``num_classes`` into the model when both are built (``links``: the ones the
  model takes; an autoencoder has no classes), so a model trains on the 1×28×28 offline MNIST digits, 1×28×28 MNIST
  or 3×32×32 CIFAR-10 without any config change;
* logs to TensorBoard under ``runs/<project>`` unless the config names another logger.

Callbacks such as ``lightning_bnp.BatchNormPreconditioning`` are named in YAML under
``trainer.callbacks`` or appended on the command line with ``--trainer.callbacks+=CLASS``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from typing_extensions import override

import lightning_bnp  # noqa: F401  # imported, its callbacks resolve by short name: --trainer.callbacks+=TimingMonitor
from example_projects.data import ImageDataModule, TorchvisionName


class ProjectCLI(LightningCLI):
    """LightningCLI with the data → model links and the project's data defaults.

    Args:
        model_class: the project's LightningModule (not subclass mode: its arguments are ``model.*``).
        project: the name used for the default TensorBoard directory ``runs/<project>``.
        prefer: the torchvision dataset ``data.dataset: auto`` looks for.
        links: the data's attributes linked into the model's arguments of the same name.
        args: command-line arguments (``None``: ``sys.argv``), e.g. ``["fit", "--config", "cfg.yaml"]``.
        run: run the subcommand (``False``: only parse and instantiate; ``args`` then has no subcommand).
    """

    def __init__(
        self,
        model_class: type[pl.LightningModule],
        *,
        project: str,
        prefer: TorchvisionName,
        links: tuple[str, ...] = ("input_shape", "num_classes"),
        args: ArgsType = None,
        run: bool = True,
    ) -> None:
        self.project, self.prefer, self.links = project, prefer, links
        trainer_defaults: dict[str, Any] = {
            "logger": {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                "init_args": {"save_dir": "runs", "name": project},
            },
        }
        super().__init__(
            model_class,
            ImageDataModule,
            trainer_defaults=trainer_defaults,
            # a rerun into the same log directory (e.g. with fast_dev_run) replaces its config.yaml
            save_config_kwargs={"overwrite": True},
            args=args,
            run=run,
        )

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.set_defaults({"data.prefer": self.prefer})
        for name in self.links:
            parser.link_arguments(f"data.{name}", f"model.{name}", apply_on="instantiate")


def run_cli(
    model_class: type[pl.LightningModule],
    args: ArgsType = None,
    *,
    project: str,
    prefer: TorchvisionName,
    links: tuple[str, ...] = ("input_shape", "num_classes"),
    run: bool = True,
) -> ProjectCLI:
    """Build (and by default run) the project's CLI; returns it so tests can inspect the trainer and model."""
    return ProjectCLI(model_class, project=project, prefer=prefer, links=links, args=args, run=run)
