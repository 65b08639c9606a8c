"""WeightConditioning (+ BNP) under DDP on CPU with 2 gloo processes (subprocesses; see ``wc_worker.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.ddp.launch import run_worker

pytestmark = pytest.mark.slow


def run_fit(out: Path, *args: str) -> list[dict[str, Any]]:
    return run_worker("wc_worker", out, *args)


def test_two_ranks_of_half_batch_are_identical_and_equal_one_process(tmp_path: Path) -> None:
    """DDP wraps the model after the parametrization is registered: it all-reduces the gradient of
    ``parametrizations.weight.original``, every rank recomputes the same conditioned weight."""
    first, second = run_fit(tmp_path / "ddp", "--devices", "2", "--batch-size", "8", "--bnp")
    (single,) = run_fit(tmp_path / "one", "--strategy", "auto", "--devices", "1", "--batch-size", "16", "--bnp")
    assert first["world_size"] == second["world_size"] == 2 and first["global_step"] == single["global_step"] == 20
    assert "network.0.parametrizations.weight.original" in first["params"]
    assert set(first["conditioned"]) == {"network.0", "network.2", "network.5"}
    for key in ("params", "conditioned"):
        for name, value in first[key].items():
            assert torch.equal(value, second[key][name]), name  # ranks bitwise identical
            ref = single[key][name]
            torch.testing.assert_close(value, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item(), msg=name)
