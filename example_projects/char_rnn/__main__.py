"""``python -m example_projects.char_rnn fit --config example_projects/char_rnn/configs/<config>.yaml``

with ``<config>`` one of ``lstm_bnp_b32``, ``lstm_bnp_b1`` (online), ``lstm_vanilla_b32``, ``lstm_vanilla_b1``,
``lstm_adam_b32``, ``gru_bnp_b32``: :class:`~example_projects.char_rnn.CharRNNModule` on
:class:`~example_projects.char_rnn.CharTextDataModule`, the docstrings of standard-library modules (nothing is
downloaded). ``--model.cell GRU`` swaps the LSTM for a GRU in any config.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from typing_extensions import override

import lightning_bnp  # noqa: F401  # imported, its callbacks resolve by short name: --trainer.callbacks+=TimingMonitor
from example_projects.char_rnn.model import CharRNNModule, CharTextDataModule


class CharRNNCLI(LightningCLI):
    """LightningCLI with the data's ``vocabulary`` linked into the model; TensorBoard logs under ``runs/char_rnn``
    unless the config names another logger."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.vocabulary", "model.vocabulary", apply_on="instantiate")


def cli_main(args: ArgsType = None, *, run: bool = True) -> CharRNNCLI:
    """The project's LightningCLI (``args=None`` reads ``sys.argv``)."""
    trainer_defaults: dict[str, Any] = {
        "logger": {
            "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
            "init_args": {"save_dir": "runs", "name": "char_rnn"},
        },
    }
    return CharRNNCLI(
        CharRNNModule,
        CharTextDataModule,
        trainer_defaults=trainer_defaults,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


if __name__ == "__main__":
    cli_main()
