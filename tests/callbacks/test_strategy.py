"""Which strategies run `fit` in worker processes (pins Lightning's private launcher class the check relies on)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest

from lightning_bnp.callbacks._strategy import holds_full_replica, spawns_workers


@pytest.mark.parametrize(
    ("strategy", "spawned"),
    [("ddp_spawn", True), ("ddp_fork", True), ("ddp_notebook", True), ("ddp", False), ("auto", False)],
)
def test_spawning_strategies_are_recognised(strategy: str, spawned: bool) -> None:
    devices = 1 if strategy == "auto" else 2
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False)
    assert spawns_workers(trainer.strategy) is spawned
    assert holds_full_replica(trainer.strategy)
