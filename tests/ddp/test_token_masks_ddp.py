"""Issue 24 item 3 under DDP (2 gloo processes on CPU): token masks with statistics pooled over ranks. The ranks'
padded batches differ in length and padding; the pooled μ, σ², N (counts on the device, never read back: no host
read in a step) equal those of plain BNP fed every real sequence alone in one process, and both ranks end
bit-identical."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.ddp.launch import run_worker

pytestmark = pytest.mark.slow


def test_masked_statistics_pooled_over_ranks_equal_the_unpadded_sequences_in_one_process(tmp_path: Path) -> None:
    first, second = run_worker("token_mask_worker", tmp_path)
    assert first["world_size"] == second["world_size"] == 2
    reference = first["reference"]
    for state in (first, second):
        assert state["reads"] == [{}] * 3
    assert set(first["bnp"]["layers"]) == {"embed", "attn.q", "attn.k", "attn.v", "attn.out_proj", "head"}
    for name, layer in first["bnp"]["layers"].items():
        other, ref = second["bnp"]["layers"][name], reference["bnp"]["layers"][name]
        assert layer["steps"] == other["steps"] == ref["steps"] == 3, name
        for key in ("mean_acc", "var_acc"):
            assert torch.equal(layer[key], other[key]), (name, key)
            torch.testing.assert_close(layer[key], ref[key], rtol=1e-5, atol=1e-6, msg=f"{name} {key}")
    for name, p in first["params"].items():
        assert torch.equal(p, second["params"][name]), name
        torch.testing.assert_close(p, reference["params"][name], rtol=1e-5, atol=1e-6, msg=name)
