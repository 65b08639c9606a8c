"""``benchmarks.overhead``'s Lightning loop in mode ``graphed`` (the ``GraphedSteps`` callback) times replayed steps:
run here on the CPU with the suite's stand-in for CUDA graphs (on a GPU it is ``benchmarks/gpu_checks.sh trainer``)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.overhead import ROWS, Key, lightning_sampler
from lightning_bnp import GraphedSteps
from tests.recorded_graphs import RecordedGraphs


@pytest.mark.parametrize("variant", ["vanilla", "BNP"])
def test_the_lightning_loop_in_graphed_mode_replays_the_steps_it_times(
    monkeypatch: pytest.MonkeyPatch, variant: str
) -> None:
    runtime = RecordedGraphs()
    monkeypatch.setattr(GraphedSteps, "runtime", runtime)
    row = next(row for row in ROWS if row.key == "tinyfc")
    sample = lightning_sampler(row, 4, Key("tinyfc", 4, variant, "graphed", "fp32", "lightning"), torch.device("cpu"))
    assert sample(8) > 0.0
    (graph,) = runtime.graphs
    assert graph.replays == 8 - 3  # (GraphedSteps' default warm-up: 3 eager steps)
