"""Issue 18 §1 under DDP: per-column statistics (c_in·k entries per conv layer, next to per-feature ones of the
Linear layer in the same flat collective) pooled over 2 gloo ranks equal one process with the whole batch."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.ddp.test_ddp import assert_close_to, assert_ranks_bitwise_equal, run_fit

pytestmark = pytest.mark.slow


def test_two_ranks_of_half_batch_equal_one_process_with_column_statistics(tmp_path: Path) -> None:
    common = ("--epochs", "2", "--net", "cnn", "--conv-statistics", "column")
    (single,) = run_fit(tmp_path / "single", "--strategy", "auto", "--devices", "1", "--batch-size", "16", *common)
    states = run_fit(tmp_path / "ddp", "--strategy", "ddp", "--devices", "2", "--batch-size", "8", *common)
    assert_ranks_bitwise_equal(states)
    assert_close_to(states[0], single)
    assert single["bnp"]["layers"]["network.0"]["mean_acc"].shape == (2 * 9,)  # per column, not per channel
    assert single["bnp"]["hyperparameters"]["conv_statistics"] == "column"
