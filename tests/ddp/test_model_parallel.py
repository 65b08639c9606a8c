"""Issue 26 under Lightning's ``ModelParallelStrategy`` (FSDP2, tensor-parallel size 1; 2 gloo processes on CPU):
the network is built and sharded with ``fully_shard`` in ``configure_model``; BNP (Conv and Linear layers, uneven
shards, a layer with no row on rank 1), ZSpaceRegularization's z-space decay and TimingMonitor run on the shards.
With gradient accumulation the result equals one process on the combined batch, the ranks' statistics are bitwise
equal, and a run resumed from Lightning's distributed or full checkpoint equals the uninterrupted one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.ddp.launch import run_worker

pytestmark = pytest.mark.slow


def _assert_close(state: dict[str, Any], reference: dict[str, Any], atol: float) -> None:
    assert state["global_step"] == reference["global_step"] == 8
    for name, p in reference["params"].items():
        torch.testing.assert_close(state["params"][name], p, rtol=1e-5, atol=atol, msg=name)
    assert set(state["bnp"]["layers"]) == {"network.0", "network.2", "network.5"}
    for name, layer in reference["bnp"]["layers"].items():
        other = state["bnp"]["layers"][name]
        assert int(other["steps"]) == int(layer["steps"]) == 8, name
        for key in ("mean_acc", "var_acc"):
            torch.testing.assert_close(other[key], layer[key], rtol=1e-5, atol=atol, msg=f"{name} {key}")


def _assert_ranks_bitwise_equal(states: list[dict[str, Any]]) -> None:
    first, second = states
    assert first["world_size"] == second["world_size"] == 2
    for name, p in first["params"].items():
        assert torch.equal(p, second["params"][name]), name
    for name, layer in first["bnp"]["layers"].items():
        for key in ("mean_acc", "var_acc"):
            assert torch.equal(layer[key], second["bnp"]["layers"][name][key]), (name, key)


def test_model_parallel_strategy_equals_one_process_and_resumes(tmp_path: Path) -> None:
    (single,) = run_worker("model_parallel_worker", tmp_path / "single", "--single")
    for kind, flags in (("distributed", ()), ("full", ("--full-checkpoint",))):
        ckpt = tmp_path / f"ckpt_{kind}"
        straight = run_worker("model_parallel_worker", tmp_path / f"straight_{kind}", "--ckpt-dir", str(ckpt), *flags)
        _assert_ranks_bitwise_equal(straight)
        _assert_close(straight[0], single, atol=1e-6)
        mid = ckpt / "epoch=0.ckpt"  # after epoch 0 of 2, with BNP state
        assert mid.is_dir() if kind == "distributed" else mid.is_file()  # a folder of shards, or one file
        resumed = run_worker("model_parallel_worker", tmp_path / f"resumed_{kind}", "--ckpt-in", str(mid), *flags)
        _assert_ranks_bitwise_equal(resumed)
        _assert_close(resumed[0], straight[0], atol=0)
