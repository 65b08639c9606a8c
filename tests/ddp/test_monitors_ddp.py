"""The monitors under DDP on CPU with 2 gloo processes (subprocesses; see ``monitor_worker.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.ddp.launch import run_worker

pytestmark = pytest.mark.slow


def run_fit(out: Path, *args: str) -> list[dict[str, Any]]:
    return run_worker("monitor_worker", out, *args)


def test_monitors_log_on_rank_zero_only_and_do_not_change_ddp_training(tmp_path: Path) -> None:
    watched = run_fit(tmp_path / "watched", "--monitors")
    plain = run_fit(tmp_path / "plain")
    assert len(watched) == len(plain) == 2 and watched[0]["world_size"] == 2
    tags = {tag for _, tag in watched[0]["tags"]}
    assert {"bnp/kappa_D/network.0", "bnp/hessian_kappa/network.2/preconditioned", "bnp/lanczos/lambda_min",
            "bnp/landscape/beta_smoothness", "timing/step_ms"} <= tags  # fmt: skip
    assert sorted({step for step, _ in watched[0]["tags"]}) == [0, 3]  # 6 steps of a global batch of 16
    assert watched[1]["tags"] == []  # rank 1 computes (collectives stay matched) but never logs
    for a, b in zip(watched, plain):  # every rank: the same end state as without monitors
        for name, p in a["params"].items():
            assert torch.equal(p, b["params"][name]), name
        for i, s in a["optimizer"]["state"].items():
            assert torch.equal(s["momentum_buffer"], b["optimizer"]["state"][i]["momentum_buffer"])
        for name, layer in a["bnp"]["layers"].items():
            assert torch.equal(layer["mean_acc"], b["bnp"]["layers"][name]["mean_acc"]), name
            assert torch.equal(layer["var_acc"], b["bnp"]["layers"][name]["var_acc"]), name
        assert torch.equal(a["rng"], b["rng"])
