"""Issue 28 item 1 under DDP (2 gloo processes on CPU): with BNP's statistics pooled over ranks (counts,
means and variances in one ``all_gather``), a training step reads nothing back to the host — the pooled
counts (rank 1 has more rows than rank 0) stay on the device and q² is built there — and the result is
the single-process one on the whole batch, bit-identical on both ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.ddp.host_reads_worker import CONFIGS
from tests.ddp.launch import run_worker

pytestmark = pytest.mark.slow


def test_pooled_statistics_read_nothing_back_and_equal_one_process(tmp_path: Path) -> None:
    first_run, second_run = run_worker("host_reads_worker", tmp_path)
    assert first_run["world_size"] == second_run["world_size"] == 2
    for config in CONFIGS:
        first, second = first_run[f"{config[0]} {config[1]}"], second_run[f"{config[0]} {config[1]}"]
        for state in (first, second):
            assert state["reads"] == [{}] * 4, config
        reference = first["reference"]
        for name, layer in first["bnp"]["layers"].items():
            other, ref = second["bnp"]["layers"][name], reference["bnp"]["layers"][name]
            assert layer["steps"] == other["steps"] == ref["steps"] == 3, (config, name)  # the NaN step: not counted
            for key in ("mean_acc", "var_acc"):
                assert torch.equal(layer[key], other[key]), (config, name)
                torch.testing.assert_close(layer[key], ref[key], rtol=1e-5, atol=1e-6, msg=f"{config} {name} {key}")
        for name, p in first["params"].items():
            assert torch.equal(p, second["params"][name]), (config, name)
            torch.testing.assert_close(p, reference["params"][name], rtol=1e-5, atol=1e-6, msg=f"{config} {name}")
