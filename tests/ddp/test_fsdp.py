"""Issue 26 item 2 under FSDP2's plain ``fully_shard`` (2 gloo processes on CPU): each rank transforms the rows of
every weight and bias it holds (uneven shards, a layer with no row on rank 1) with the full-width statistics pooled
over both ranks; the result is the single-process one on the whole batch, for Linear and Conv layers, channel and
column statistics, with gradient accumulation, and the only collective of a BNP step is its statistics all-gather."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.ddp.fsdp_worker import CONFIGS, STEPS
from tests.ddp.launch import run_worker

pytestmark = pytest.mark.slow


def test_fully_shard_equals_one_process_on_the_whole_batch(tmp_path: Path) -> None:
    first_run, second_run = run_worker("fsdp_worker", tmp_path)
    assert first_run["world_size"] == second_run["world_size"] == 2
    for config in CONFIGS:
        key = " ".join(map(str, config))
        first, second = first_run[key], second_run[key]
        for state in (first, second):
            assert state["collectives"] == [{"all_gather": 1}] * STEPS, config
        reference = first["reference"]
        assert reference["collectives"] == [{}] * STEPS
        for name, layer in first["bnp"]["layers"].items():
            other, ref = second["bnp"]["layers"][name], reference["bnp"]["layers"][name]
            assert layer["steps"] == other["steps"] == ref["steps"] == STEPS, (config, name)
            for k in ("mean_acc", "var_acc"):
                assert torch.equal(layer[k], other[k]), (config, name)  # ranks bitwise equal
                torch.testing.assert_close(layer[k], ref[k], rtol=1e-5, atol=1e-6, msg=f"{config} {name} {k}")
        for name, p in first["params"].items():
            assert torch.equal(p, second["params"][name]), (config, name)
            torch.testing.assert_close(p, reference["params"][name], rtol=1e-5, atol=1e-6, msg=f"{config} {name}")
