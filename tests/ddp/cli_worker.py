"""Fit an example project's LightningCLI on several processes and save what every rank ran (issue 26: the
``fsdp2`` config under ``ModelParallelStrategy``).

Run as a script (Lightning's launcher runs the same command again for the other rank)::

    python -m tests.ddp.cli_worker --out DIR --project fsdp2 fit --config <yaml> [CLI arguments]

Each rank writes ``DIR/rank{r}.pt``: whether the fit finished, its global step and world size, the class path of
the strategy, the class names of the trainer's callbacks, the layers BNP manages and, per parameter of the network,
its type and its local and global number of rows (dim 0).
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from typing import Any

import torch

from lightning_bnp import BatchNormPreconditioning
from tests.ddp.fit_worker import release_process_group


def _class_path(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--project", required=True)
    args, cli_args = parser.parse_known_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cli = importlib.import_module(f"example_projects.{args.project}.__main__").cli_main(cli_args)
    trainer = cli.trainer
    bnp = next(cb for cb in trainer.callbacks if isinstance(cb, BatchNormPreconditioning))
    assert bnp.preconditioner is not None
    rows: dict[str, tuple[str, int, int]] = {}
    for name, p in cli.model.network.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        rows[name] = (type(p).__name__, local.shape[0], p.shape[0])
    state: dict[str, Any] = {
        "finished": trainer.state.finished,
        "global_step": trainer.global_step,
        "world_size": trainer.world_size,
        "strategy": _class_path(trainer.strategy),
        "callbacks": [type(cb).__name__ for cb in trainer.callbacks],
        "bnp_layers": sorted(bnp.preconditioner.layers),
        "rows": rows,
    }
    release_process_group()
    torch.save(state, args.out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
