"""Fit with BNP under DDP, with or without the monitors, and save every rank's final state and logged tags.

Run as a script (Lightning's ``ddp`` launcher re-executes it for the other ranks)::

    python -m tests.ddp.monitor_worker --devices 2 --monitors --out DIR

Each rank writes ``DIR/rank{r}.pt``: parameters, optimizer state, BNP statistics, the torch RNG state
and the monitor tags that reached its logger (a logger that records on every rank, unlike Lightning's).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import Logger
from typing_extensions import override

from lightning_bnp.callbacks.bnp import BatchNormPreconditioning
from lightning_bnp.callbacks.condition_monitor import ConditionNumberMonitor
from lightning_bnp.callbacks.timing_monitor import TimingMonitor
from tests.ddp.fit_worker import OrderedData, release_process_group
from tests.helpers import BoringClassifier, make_data, make_mlp


class EveryRankLogger(Logger):
    """Records the monitors' tags on whichever rank calls ``log_metrics`` (no ``rank_zero_only``)."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[int, str]] = []

    @property
    @override
    def name(self) -> str:
        return "every_rank"

    @property
    @override
    def version(self) -> int:
        return 0

    @override
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        return None

    @override
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.tags += [(int(step or 0), k) for k in metrics if k.startswith(("bnp/", "timing/"))]


class SaveFinalState(pl.Callback):
    def __init__(self, out: Path, bnp: BatchNormPreconditioning, logger: EveryRankLogger) -> None:
        self.out, self.bnp, self.logger = out, bnp, logger

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.bnp.preconditioner is not None
        state = {
            "params": {k: v.detach().clone() for k, v in pl_module.named_parameters()},
            "optimizer": trainer.optimizers[0].state_dict(),
            "bnp": self.bnp.preconditioner.state_dict(),
            "rng": torch.get_rng_state(),
            "tags": self.logger.tags,
            "world_size": trainer.world_size,
        }
        torch.save(state, self.out / f"rank{trainer.global_rank}.pt")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--monitors", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    bnp, logger = BatchNormPreconditioning(), EveryRankLogger()
    callbacks: list[pl.Callback] = [bnp, SaveFinalState(args.out, bnp, logger)]
    if args.monitors:
        callbacks += [
            ConditionNumberMonitor(
                every_n_steps=3, hessian_layers=["*"], landscape=True, lanczos=True, lanczos_iters=3
            ),
            TimingMonitor(every_n_steps=3),
        ]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp",
        max_epochs=1,
        callbacks=callbacks,
        logger=logger,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    torch.manual_seed(0)
    model = BoringClassifier(make_mlp(), momentum=0.9)
    trainer.fit(model, datamodule=OrderedData(make_data(n=96), batch_size=8))
    release_process_group()


if __name__ == "__main__":
    main()
