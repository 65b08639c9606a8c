"""Issue 29 under DDP: a user-registered layer kind (a linear layer stored (in, out), tests/transposed.py) on 2 gloo
processes with per-rank batch 8 equals BNP on the ``nn.Linear`` twin in one process with batch 16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.ddp.launch import run_worker

pytestmark = pytest.mark.slow


def test_registered_kind_under_ddp_equals_nn_linear_in_one_process(tmp_path: Path) -> None:
    common = ("--n", "160", "--epochs", "2")
    (single,) = run_worker("fit_worker", tmp_path / "single", *common, "--strategy", "auto", "--devices", "1",
                           "--batch-size", "16", "--net", "mlp")  # fmt: skip
    states = run_worker("fit_worker", tmp_path / "ddp", *common, "--strategy", "ddp", "--devices", "2",
                        "--batch-size", "8", "--net", "tmlp")  # fmt: skip
    assert len(states) == 2 and all(s["world_size"] == 2 and s["global_step"] == 20 for s in states)
    for state in states:
        for name, p in single["params"].items():
            got = state["params"][name]
            got = got.t() if name.endswith("weight") else got  # stored (in, out)
            torch.testing.assert_close(got, p, rtol=1e-5, atol=1e-5 * p.abs().max().item(), msg=name)
        for name, layer in single["bnp"]["layers"].items():
            assert state["bnp"]["layers"][name]["steps"] == layer["steps"] == 20
            for key in ("mean_acc", "var_acc"):
                torch.testing.assert_close(state["bnp"]["layers"][name][key], layer[key], rtol=1e-5, atol=1e-6)
    assert all(torch.equal(p, states[1]["params"][k]) for k, p in states[0]["params"].items())
