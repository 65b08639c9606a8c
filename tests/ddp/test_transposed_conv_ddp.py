"""Issue 44 under DDP: a transposed convolution's statistics (its H's rows are the output positions) pooled over 2
gloo ranks of batch 8 equal one process with batch 16, per channel and per column."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.ddp.test_ddp import assert_close_to, assert_ranks_bitwise_equal, run_fit

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("conv_statistics", ["channel", "column"])
def test_two_ranks_of_half_batch_equal_one_process(tmp_path: Path, conv_statistics: str) -> None:
    common = ("--epochs", "2", "--n", "64", "--net", "tconv", "--conv-statistics", conv_statistics)
    (single,) = run_fit(tmp_path / "single", "--strategy", "auto", "--devices", "1", "--batch-size", "16", *common)
    states = run_fit(tmp_path / "ddp", "--strategy", "ddp", "--devices", "2", "--batch-size", "8", *common)
    assert_ranks_bitwise_equal(states)
    assert_close_to(states[0], single)
    features = {"channel": 3, "column": 3 * 16}[conv_statistics]  # c_in, or c_in·k² columns (c, κ)
    assert single["bnp"]["layers"]["network.2"]["mean_acc"].shape == (features,)
    assert single["bnp"]["layers"]["network.2"]["steps"] == 8
