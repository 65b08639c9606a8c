"""BNP under DDP on CPU with 2 gloo processes (each run is a subprocess; see ``fit_worker.py``)."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.ddp.launch import run_worker

pytestmark = pytest.mark.slow

N_SAMPLES = 160  # 10 steps per epoch at a global batch of 16: checkpoints fall on epoch ends


def run_fit(out: Path, *args: str) -> list[dict[str, Any]]:
    """Run the worker and return every rank's final state."""
    return run_worker("fit_worker", out, "--n", str(N_SAMPLES), *args)


@cache
def single_process(tmp: str, net: str, batch_size: int = 16, statistics: str = "running") -> dict[str, Any]:
    """One process, 20 steps (2 epochs)."""
    (state,) = run_fit(Path(tmp) / f"single_{net}_{batch_size}_{statistics}", "--strategy", "auto", "--devices", "1",
                       "--batch-size", str(batch_size), "--epochs", "2", "--net", net, "--statistics", statistics,
                       "--n", str(10 * batch_size))  # fmt: skip
    return state


@pytest.fixture(scope="module")
def shared_tmp(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("ddp"))


def assert_ranks_bitwise_equal(states: list[dict[str, Any]]) -> None:
    assert len(states) == 2 and all(s["world_size"] == 2 for s in states)
    first, second = states
    for name, p in first["params"].items():
        assert torch.equal(p, second["params"][name]), name
    for name, layer in first["bnp"]["layers"].items():
        other = second["bnp"]["layers"][name]
        assert layer["steps"] == other["steps"]
        assert torch.equal(layer["mean_acc"], other["mean_acc"]), name
        assert torch.equal(layer["var_acc"], other["var_acc"]), name


def assert_close_to(state: dict[str, Any], reference: dict[str, Any]) -> None:
    for name, p in reference["params"].items():
        torch.testing.assert_close(state["params"][name], p, rtol=1e-5, atol=1e-5 * p.abs().max().item())
    for name, layer in reference["bnp"]["layers"].items():
        assert state["bnp"]["layers"][name]["steps"] == layer["steps"]
        for key in ("mean_acc", "var_acc"):
            ref = layer[key]
            torch.testing.assert_close(
                state["bnp"]["layers"][name][key], ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item()
            )


@pytest.mark.parametrize("net", ["mlp", "cnn"])
def test_two_ranks_of_half_batch_equal_one_process(tmp_path: Path, shared_tmp: str, net: str) -> None:
    states = run_fit(
        tmp_path, "--strategy", "ddp", "--devices", "2", "--batch-size", "8", "--epochs", "2", "--net", net
    )
    assert_ranks_bitwise_equal(states)
    assert_close_to(states[0], single_process(shared_tmp, net))


@pytest.mark.parametrize(
    ("statistics", "per_rank_batch"),
    [("batch", 8), ("running", 1)],  # per-rank batch 1: N = 2 globally, so not the N = 1 rule
)
def test_batch_mode_and_per_rank_batch_one_use_global_statistics(
    tmp_path: Path, shared_tmp: str, statistics: str, per_rank_batch: int
) -> None:
    states = run_fit(tmp_path, "--strategy", "ddp", "--devices", "2", "--batch-size", str(per_rank_batch),
                     "--epochs", "2", "--statistics", statistics, "--n", str(20 * per_rank_batch))  # fmt: skip
    assert_ranks_bitwise_equal(states)
    assert_close_to(states[0], single_process(shared_tmp, "mlp", 2 * per_rank_batch, statistics))


@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp_find_unused_parameters_true"])
def test_other_ddp_strategies(tmp_path: Path, shared_tmp: str, strategy: str) -> None:
    states = run_fit(tmp_path, "--strategy", strategy, "--devices", "2", "--batch-size", "8", "--epochs", "2")
    assert_ranks_bitwise_equal(states)
    assert_close_to(states[0], single_process(shared_tmp, "mlp"))


def test_checkpoint_from_ddp_resumes_in_one_process_and_the_reverse(tmp_path: Path, shared_tmp: str) -> None:
    straight = single_process(shared_tmp, "mlp")
    # DDP for one epoch (10 steps), then one process for one more
    run_fit(tmp_path / "a", "--strategy", "ddp", "--devices", "2", "--batch-size", "8", "--epochs", "1",
            "--ckpt-dir", str(tmp_path / "ckpt_ddp"))  # fmt: skip
    (resumed,) = run_fit(tmp_path / "b", "--strategy", "auto", "--devices", "1", "--batch-size", "16", "--epochs", "2",
                         "--ckpt-in", str(tmp_path / "ckpt_ddp" / "last.ckpt"))  # fmt: skip
    assert_close_to(resumed, straight)
    # one process for one epoch, then DDP for one more
    run_fit(tmp_path / "c", "--strategy", "auto", "--devices", "1", "--batch-size", "16", "--epochs", "1",
            "--ckpt-dir", str(tmp_path / "ckpt_single"))  # fmt: skip
    states = run_fit(tmp_path / "d", "--strategy", "ddp", "--devices", "2", "--batch-size", "8", "--epochs", "2",
                     "--ckpt-in", str(tmp_path / "ckpt_single" / "last.ckpt"))  # fmt: skip
    assert_ranks_bitwise_equal(states)
    assert_close_to(states[0], straight)


def test_without_sync_the_replicas_drift_apart(tmp_path: Path) -> None:
    """What `sync_statistics=False` costs: each rank builds P from its own half batch."""
    first, second = run_fit(tmp_path, "--strategy", "ddp", "--devices", "2", "--batch-size", "8", "--epochs", "1",
                            "--no-sync")  # fmt: skip
    assert any(not torch.equal(p, second["params"][name]) for name, p in first["params"].items())


def test_ranks_stay_identical_with_gradient_regularization(tmp_path: Path, shared_tmp: str) -> None:
    """The Hessian-vector product is computed on each rank's shard and averaged over ranks."""
    states = run_fit(tmp_path, "--strategy", "ddp", "--devices", "2", "--batch-size", "8", "--epochs", "1",
                     "--gradient-penalty", "0.05")  # fmt: skip
    assert_ranks_bitwise_equal(states)
    (single,) = run_fit(tmp_path / "single", "--strategy", "auto", "--devices", "1", "--batch-size", "16",
                        "--epochs", "1", "--gradient-penalty", "0.05")  # fmt: skip
    for name, p in single["params"].items():  # second derivatives amplify rounding: a looser match
        torch.testing.assert_close(states[0]["params"][name], p, rtol=1e-3, atol=1e-4)
