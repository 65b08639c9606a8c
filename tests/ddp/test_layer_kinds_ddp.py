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


def test_multihead_attention_under_ddp_equals_the_four_linear_twin_in_one_process(tmp_path: Path) -> None:
    """Issue 24: nn.MultiheadAttention's q, k, v blocks and out_proj pooled over 2 ranks (batch 8 each) end where
    BNP on its four-nn.Linear twin ends in one process with batch 16."""
    common = ("--n", "64", "--epochs", "2")
    (single,) = run_worker("fit_worker", tmp_path / "single", *common, "--strategy", "auto", "--devices", "1",
                           "--batch-size", "16", "--net", "mha_twin")  # fmt: skip
    states = run_worker("fit_worker", tmp_path / "ddp", *common, "--strategy", "ddp", "--devices", "2",
                        "--batch-size", "8", "--net", "mha")  # fmt: skip
    assert len(states) == 2 and all(s["world_size"] == 2 and s["global_step"] == 8 for s in states)
    for state in states:
        got = state["params"]
        blocks = dict(zip("qkv", got["network.attention.attn.in_proj_weight"].split(8)))
        biases = dict(zip("qkv", got["network.attention.attn.in_proj_bias"].split(8)))
        mapped = {f"network.attention.{b}.weight": w for b, w in blocks.items()}
        mapped |= {f"network.attention.{b}.bias": w for b, w in biases.items()}
        mapped["network.attention.o.weight"] = got["network.attention.attn.out_proj.weight"]
        mapped["network.attention.o.bias"] = got["network.attention.attn.out_proj.bias"]
        mapped |= {k: v for k, v in got.items() if k.startswith("network.head")}
        assert set(mapped) == set(single["params"])
        for name, p in single["params"].items():
            torch.testing.assert_close(mapped[name], p, rtol=1e-5, atol=1e-5 * p.abs().max().item(), msg=name)
        for name, layer in single["bnp"]["layers"].items():
            ddp_name = name.replace("attention.o", "attention.attn.out_proj").replace("attention.", "attention.attn.")
            ddp_name = ddp_name.replace("attn.attn.", "attn.")
            assert state["bnp"]["layers"][ddp_name]["steps"] == layer["steps"] == 8
            for key in ("mean_acc", "var_acc"):
                torch.testing.assert_close(state["bnp"]["layers"][ddp_name][key], layer[key], rtol=1e-5, atol=1e-6)


def test_embedding_with_padding_under_ddp_equals_one_process(tmp_path: Path) -> None:
    """Issue 24 item 4: an embedding's token counts pooled over 2 ranks (batch 8 each) end where one process with
    batch 16 ends; with ``padding_idx`` each rank's count of real tokens is a device tensor, packed into the one
    all-gather and merged there."""
    common = ("--n", "64", "--epochs", "2", "--net", "tokens", "--embeddings")
    (single,) = run_worker("fit_worker", tmp_path / "single", *common, "--strategy", "auto", "--devices", "1",
                           "--batch-size", "16")  # fmt: skip
    states = run_worker("fit_worker", tmp_path / "ddp", *common, "--strategy", "ddp", "--devices", "2",
                        "--batch-size", "8")  # fmt: skip
    assert len(states) == 2 and all(s["world_size"] == 2 and s["global_step"] == 8 for s in states)
    assert set(single["bnp"]["layers"]) == {"network.inner.emb", "network.inner.head"}
    for state in states:
        for name, p in single["params"].items():
            torch.testing.assert_close(state["params"][name], p, rtol=1e-5, atol=1e-5 * p.abs().max().item(), msg=name)
        for name, layer in single["bnp"]["layers"].items():
            assert state["bnp"]["layers"][name]["steps"] == layer["steps"] == 8
            for key in ("mean_acc", "var_acc"):
                torch.testing.assert_close(state["bnp"]["layers"][name][key], layer[key], rtol=1e-5, atol=1e-6)


def test_a_bidirectional_lstm_under_ddp_equals_one_process(tmp_path: Path) -> None:
    """Issue 44: a recurrent layer's two column blocks per direction (x_t and h_{t−1} statistics, one floor, the bias
    pair) pooled over 2 ranks (batch 8 each) end where one process with batch 16 ends."""
    common = ("--n", "64", "--epochs", "2", "--net", "lstm")
    (single,) = run_worker("fit_worker", tmp_path / "single", *common, "--strategy", "auto", "--devices", "1",
                           "--batch-size", "16")  # fmt: skip
    states = run_worker("fit_worker", tmp_path / "ddp", *common, "--strategy", "ddp", "--devices", "2",
                        "--batch-size", "8")  # fmt: skip
    assert len(states) == 2 and all(s["world_size"] == 2 and s["global_step"] == 8 for s in states)
    layers = {f"network.lstm.{b}_l0{d}" for b in ("ih", "hh") for d in ("", "_reverse")} | {"network.head"}
    assert set(single["bnp"]["layers"]) == layers
    for state in states:
        for name, p in single["params"].items():
            torch.testing.assert_close(state["params"][name], p, rtol=1e-5, atol=1e-5 * p.abs().max().item(), msg=name)
        for name, layer in single["bnp"]["layers"].items():
            assert state["bnp"]["layers"][name]["steps"] == layer["steps"] == 8
            for key in ("mean_acc", "var_acc"):
                torch.testing.assert_close(state["bnp"]["layers"][name][key], layer[key], rtol=1e-5, atol=1e-6)
