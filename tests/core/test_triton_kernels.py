"""BNP's grouped Triton kernels: the transform of every entry in one launch, the per-feature statistics and the
running-state update, against independent references — the explicit (1/q²)·P·Pᵀ in float64, float64 moments, and the
pure-torch step (the default, without ``grouped_kernels=True``) — under Triton's CPU interpreter, in one subprocess for
every case
(``tests/core/triton_interpreted.py``: the interpreter must be on before the kernels are defined). The choice of path
is tested here, in process; the tests that launch the kernels on a GPU are ``test_triton_kernels_cuda.py``.
"""

from __future__ import annotations

import copy
import math
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_bnp.core import BNPPreconditioner, BNPWarning, step_path
from lightning_bnp.core.statistics import Moments
from lightning_bnp.core.step_plan import StepPlan
from lightning_bnp.core.transform import precondition_scaled_
from tests.core.test_transform import reference

ROOT = Path(__file__).resolve().parents[2]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
EPS32 = torch.finfo(torch.float32).eps


# ----------------------------------------------------------------------------------------------- the cases
def _entries(dtype: torch.dtype, g: torch.Generator) -> list[dict[str, Any]]:
    """Entries of one transform call: weight gradient (its rows, as saved: strides and views kept), bias gradient,
    groups, the features of each of its layers (several: row blocks of one weight), per column or per channel."""

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    in_proj, in_proj_b = r(12, 5).to(dtype), r(12).to(dtype)
    split, split_b = r(12, 5).to(dtype), r(12).to(dtype)
    return [
        # a Linear of more rows and columns than one program's block (16 × 64)
        {"w": r(20, 70), "b": r(20), "groups": 1, "layers": [70], "column": False},
        {"w": r(5, 9).t(), "b": r(9), "groups": 1, "layers": [5], "column": False},  # transposed (GPT-2's Conv1D)
        {
            "w": r(6, 3, 3, 3).to(memory_format=torch.channels_last),
            "b": r(6),
            "groups": 1,
            "layers": [3],
            "column": False,
        },
        {"w": r(4, 2, 3, 2), "b": r(4), "groups": 1, "layers": [12], "column": True},  # per im2col column
        {"w": r(3, 2, 2, 2, 2), "b": None, "groups": 1, "layers": [2], "column": False},  # Conv3d without bias
        {"w": r(6, 2, 3), "b": r(6), "groups": 2, "layers": [4], "column": False},  # grouped Conv1d
        {"w": r(4, 1, 3), "b": r(4), "groups": 2, "layers": [6], "column": True},  # grouped, per column
        {"w": in_proj, "b": in_proj_b, "groups": 3, "layers": [5, 5, 5], "column": False},  # q, k, v: one entry
        # q, k, v blocks as entries of their own: views into one larger gradient
        *(
            {
                "w": split[4 * i : 4 * i + 4],
                "b": split_b[4 * i : 4 * i + 4],
                "groups": 1,
                "layers": [5],
                "column": False,
            }
            for i in range(3)
        ),
        {"w": r(3, 4), "b": None, "groups": 1, "layers": [4], "column": False},  # a frozen bias: only divided
        # q²σ̃² beyond float16's range (1e5, 1e-8): the division by the float32 value (tests/MUTANTS.md)
        {
            "w": torch.tensor([[8.0, 1.0, 1e-4], [-16.0, 2.0, -2e-4]]),
            "b": torch.tensor([2.0, -1.0]),
            "groups": 1,
            "layers": [3],
            "column": False,
            "stats": ([0.5, 0.25, 0.0], [1e5, 1.0, 1e-8]),
        },
    ]


def _transform_case(dtype: torch.dtype, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    entries = _entries(dtype, g)
    sizes = [n for e in entries for n in e["layers"]]
    mus, var_ts = [], []
    for e in entries:
        for n in e["layers"]:
            if "stats" in e:
                mus.append(torch.tensor(e["stats"][0]))
                var_ts.append(torch.tensor(e["stats"][1]))
            else:
                mus.append(2.0 * torch.randn(n, generator=g))
                var_ts.append(0.05 + torch.rand(n, generator=g) * torch.logspace(-1, 1, n))
    q2 = 1.0 + 2.0 * torch.rand(len(sizes), generator=g)
    mu, var_t = torch.cat(mus), torch.cat(var_ts)
    scale = var_t * torch.repeat_interleave(q2, torch.tensor(sizes))
    spans, first = [], 0
    for e in entries:
        spans.append((first, len(e["layers"])))
        first += len(e["layers"])
    grads_w = [e["w"].to(dtype) if e["w"].dtype != dtype else e["w"] for e in entries]
    grads_b = [None if e["b"] is None else (e["b"].to(dtype) if e["b"].dtype != dtype else e["b"]) for e in entries]
    return {
        "grads_w": grads_w, "grads_b": grads_b, "spans": spans, "groups": [e["groups"] for e in entries],
        "sizes": [sum(e["layers"]) for e in entries], "offsets": [sum(sizes[:i]) for i in range(len(sizes))],
        "mu": mu, "scale": scale, "q2": q2, "var_t": var_t, "columns": [e["column"] for e in entries],
    }  # fmt: skip


def _moment_inputs() -> list[tuple[torch.Tensor, int]]:
    g = torch.Generator().manual_seed(3)

    def r(*shape: int) -> torch.Tensor:
        return 1.5 + torch.randn(*shape, generator=g)

    nchw = r(4, 3, 5, 6)
    return [
        (r(200, 5), -1),  # more rows than one iteration's block
        (r(10, 40), -1),  # more features than one program's
        (r(3, 5, 7), -1),  # (B, T, F): every leading index a row
        (r(7, 50).t(), -1),  # strided
        (nchw, 1),
        (nchw.to(memory_format=torch.channels_last), 1),
        (nchw[:, :, ::2, 1:], 1),  # positions of no single stride: a contiguous copy
        (r(4, 3, 10), 1),
        (r(2, 3, 3, 4, 5), 1),
        (nchw.half(), 1),
        (nchw.bfloat16(), 1),
        (r(1, 4), -1),  # one row: σ² = 0
    ]


def _mean_dominated() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """test_statistics.py's |μ|/σ = 1e5 input and its four parts."""
    g = torch.Generator().manual_seed(0)
    h = (1e4 + 0.1 * torch.randn(1000, 3, generator=g, dtype=torch.float64)).float()
    return h, [h[:1], h[1:300], h[300:301], h[301:]]


STEP_CASES: list[tuple[str, dict[str, Any], int]] = [
    ("conv_attention", {}, 3),
    ("conv_attention", {"statistics": "batch"}, 2),
    ("conv_attention", {"bias_correction": True}, 3),
    ("conv_attention", {"conv_statistics": "column"}, 2),
    ("mlp", {"batch_size": 1}, 3),  # N = 1: σ²_H = (h − μ)² with the running μ
    ("mlp", {"batch_size": 1, "bias_correction": True}, 3),
    ("mlp", {"rho": 0.3}, 3),  # ρ < 0.5: the other branch of lerp
    ("mlp", {"poison": {1: math.nan}}, 3),  # a NaN sample: the layer keeps its state
    ("mlp", {"poison": {1: 1e20}}, 3),  # squares overflow: σ²_H saturates
    ("mlp_no_bias", {"bias_correction": True}, 2),  # uncentred second moment
    ("mlp_half", {}, 2),
    ("mlp_bfloat16", {"statistics": "batch"}, 2),
    ("conv3d", {}, 2),
    ("tokens", {"mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0], [1] * 5]).bool()}, 2),
]


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every case run once under the interpreter (one subprocess): inputs and results by name."""
    cases: dict[str, tuple[Any, ...]] = {}
    for i, dtype in enumerate(DTYPES):
        cases[f"transform {dtype}"] = ("transform", _transform_case(dtype, seed=10 + i))
    cases["compiled transform"] = ("compiled transform", _transform_case(torch.float32, seed=10))
    for i, (x, dim) in enumerate(_moment_inputs()):
        cases[f"moments {i}"] = ("moments", x, dim)
    for i, part in enumerate(_mean_dominated()[1]):
        cases[f"mean dominated {i}"] = ("moments", part, -1)
    for i, (name, options, steps) in enumerate(STEP_CASES):
        cases[f"steps {i}"] = ("steps", name, options, steps)
    folder = tmp_path_factory.mktemp("triton")
    inputs, outputs = folder / "cases.pt", folder / "results.pt"
    torch.save(list(cases.values()), inputs)
    # a new interpreter, not a fork of tests/warm_python.py's server: its torch has imported triton.language, whose
    # reductions (tl.sum, tl.max) are then compiled-mode functions that the interpreter cannot call
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "tests.core.triton_interpreted", str(inputs), str(outputs)]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-5000:]
    results = torch.load(outputs, weights_only=False)
    return {name: (case, result) for (name, case), result in zip(cases.items(), results)}


# ------------------------------------------------------------------------------------------ the transform
def _expected(
    case: dict[str, Any],
) -> list[tuple[torch.Tensor, torch.Tensor | None, list[tuple[int, int]], torch.Tensor]]:
    """Per entry: eq. 15 / 23 as the explicit (1/q²)·P·Pᵀ in float64 on the gradient before the kernel, each layer
    (row block) with its own statistics and q²; the row ranges of its layers; and the size of the terms of each
    new weight, (|G_w| + |μ_j G_b|)/(q²σ̃²_j) (the same matrix applied to |G_w|, |G_b| with −|μ|)."""
    out = []
    for e, (grad_w, grad_b, (first, n), groups, column) in enumerate(
        zip(case["grads_w"], case["grads_b"], case["spans"], case["groups"], case["columns"])
    ):
        w64 = grad_w.double()
        w64 = w64.reshape(w64.shape[0], -1) if column else w64
        b64 = None if grad_b is None else grad_b.double()
        new_w, new_b = torch.empty_like(w64), None if b64 is None else torch.empty_like(b64)
        size_w = torch.empty_like(w64)
        rows = w64.shape[0] // n
        blocks = []
        for k in range(n):
            layer = first + k
            size = case["sizes"][e] // n
            start = case["offsets"][layer]
            mu = case["mu"][start : start + size].double()
            var_t = case["var_t"][start : start + size].double()
            part = slice(k * rows, (k + 1) * rows)
            w, b = reference(
                w64[part], None if b64 is None else b64[part], None if b64 is None else mu, var_t,
                float(case["q2"][layer]), groups if n == 1 else 1,
            )  # fmt: skip
            new_w[part] = w
            size_w[part] = reference(
                w64[part].abs(), None if b64 is None else b64[part].abs(), None if b64 is None else -mu.abs(), var_t,
                float(case["q2"][layer]), groups if n == 1 else 1,
            )[0]  # fmt: skip
            if new_b is not None:
                new_b[part] = b
            blocks.append((k * rows, (k + 1) * rows))
        out.append((new_w.reshape(grad_w.shape), new_b, blocks, size_w.reshape(grad_w.shape)))
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_grouped_transform_is_the_explicit_p_pt_for_every_layout(interpreted: dict[str, Any], dtype: Any) -> None:
    """Every entry kind in one launch (Linear, transposed, channels_last conv with channel and column statistics,
    Conv3d without bias, grouped convs, the q, k, v row blocks as one entry and as views, a frozen bias, q²σ̃²
    beyond float16's range): the weight gradient is (1/q²)·P·Pᵀ·g in float64 rounded once into the gradient's
    dtype; the bias is G_b/q² − Σ_j μ_j G_w_new[i, j] of the new G_w as stored."""
    (_, case), (grads_w, grads_b) = interpreted[f"transform {dtype}"]
    eps = torch.finfo(dtype).eps
    for e, ((want_w, want_b, blocks, terms), got_w, got_b) in enumerate(zip(_expected(case), grads_w, grads_b)):
        assert got_w.dtype == dtype and got_w.stride() == case["grads_w"][e].stride()
        # float32 arithmetic inside (q²σ̃² rounded once): a few float32 ulps of the terms, then one rounding
        bound = eps * want_w.abs() + 8 * EPS32 * terms + 1e-30
        assert bool(((got_w.double() - want_w).abs() <= bound).all()), f"entry {e} weight"
        if want_b is None:
            assert got_b is None or torch.equal(got_b, case["grads_b"][e])
            continue
        first, n = case["spans"][e]
        flat = got_w.double().reshape(got_w.shape[0], -1)
        before_b = case["grads_b"][e].double()
        for k, (lo, hi) in enumerate(blocks):
            layer = first + k
            start = case["offsets"][layer]
            size = case["sizes"][e] // n
            mu = case["mu"][start : start + size].double()
            groups = case["groups"][e] if n == 1 else 1
            rows = flat[lo:hi].reshape(groups, (hi - lo) // groups, -1)
            kernel = rows.shape[-1] // (size // groups)
            mu_g = mu.view(groups, 1, -1)
            if not case["columns"][e]:
                mu_g = mu_g.repeat_interleave(kernel, dim=-1)
            dot = (rows * mu_g).sum(-1).reshape(-1)
            q2 = float(case["q2"][layer])
            want = before_b[lo:hi] / q2 - dot
            scale = (before_b[lo:hi] / q2).abs() + (rows * mu_g).abs().sum(-1).reshape(-1)
            assert bool(((got_b[lo:hi].double() - want).abs() <= eps * want.abs() + 8 * EPS32 * scale).all()), e
            # and the explicit P·Pᵀ's bias, up to the rounding of the stored G_w_new it is built from
            loose = eps * want.abs() + 2 * eps * scale
            assert bool(((got_b[lo:hi].double() - want_b[lo:hi]).abs() <= loose + 8 * EPS32 * scale).all()), e


def test_a_float32_grouped_transform_is_the_torch_transform_bit_for_bit_on_the_weights(
    interpreted: dict[str, Any],
) -> None:
    """float32: G_w − μ_j G_b[i] rounded once and divided by the same float32 q²σ̃² as the pure-torch transform
    (whose addcmul is fused): the same bits; the bias (a sum in another order) to float32 round-off."""
    (_, case), (grads_w, grads_b) = interpreted["transform torch.float32"]
    ref_w = [w.clone() for w in case["grads_w"]]
    ref_b = [None if b is None else b.clone() for b in case["grads_b"]]
    mus, scales, q2s = [], [], []
    for (first, n), size, b in zip(case["spans"], case["sizes"], case["grads_b"]):
        start = case["offsets"][first]
        mus.append(None if b is None else case["mu"][start : start + size])
        scales.append(case["scale"][start : start + size])
        q2s.append(float(case["q2"][first]) if n == 1 else case["q2"][first : first + n].view(n, 1))
    precondition_scaled_(ref_w, ref_b, mus, scales, q2s, [g if n == 1 else n for g, (_, n) in
                                                          zip(case["groups"], case["spans"])])  # fmt: skip
    for e, (got, want) in enumerate(zip(grads_w, ref_w)):
        assert torch.equal(got, want), f"entry {e}"
    for e, (got, want) in enumerate(zip(grads_b, ref_b)):
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()), msg=f"entry {e}")


def test_the_transform_op_compiles_as_one_opaque_call(interpreted: dict[str, Any]) -> None:
    """``torch.compile(fullgraph=True)`` takes the custom op as it is: the same gradients as eager."""
    _, (eager_w, eager_b) = interpreted["transform torch.float32"]
    _, (compiled_w, compiled_b) = interpreted["compiled transform"]
    for got, want in zip([*compiled_w, *compiled_b], [*eager_w, *eager_b]):
        assert (got is None and want is None) or torch.equal(got, want)


# ------------------------------------------------------------------------------------------- statistics
def test_feature_moments_are_the_float64_mean_and_variance_for_every_layout(interpreted: dict[str, Any]) -> None:
    """Linear inputs (2-D, (B, T, F), strided), conv inputs (NCHW, channels_last, positions of no single stride,
    1-D, 3-D), float16 and bfloat16 reduced in float32: per feature over every row, to float32 round-off."""
    for i in range(len(_moment_inputs())):
        (_, x, dim), (mean, var) = interpreted[f"moments {i}"]
        h = x.double()
        rows = h.reshape(-1, h.shape[-1]) if dim == -1 else h.transpose(0, 1).reshape(h.shape[1], -1).t()
        assert mean.dtype == var.dtype == torch.float32
        torch.testing.assert_close(mean.double(), rows.mean(0), rtol=4 * EPS32, atol=0, msg=f"input {i}")
        torch.testing.assert_close(
            var.double(), rows.var(0, unbiased=False), rtol=64 * EPS32, atol=1e-12, msg=f"input {i}"
        )


def test_feature_moments_pass_the_mean_dominated_check_of_the_torch_statistics(interpreted: dict[str, Any]) -> None:
    """test_statistics.py's check at |μ|/σ = 1e5 in float32, unchanged, with each part's moments from the kernel:
    the pooled mean to 1e-7 and the variance to 5e-3 of float64's (a one-pass Σx, Σx² loses every digit)."""
    h, parts = _mean_dominated()
    merged = Moments.empty(3, torch.device("cpu"))
    for i, part in enumerate(parts):
        _, (mean, var) = interpreted[f"mean dominated {i}"]
        merged = merged.merge(Moments(len(part), len(part), len(part), mean, var))
    ref = h.double()
    assert merged.rows == 1000
    torch.testing.assert_close(merged.mean.double(), ref.mean(0), rtol=1e-7, atol=0)
    torch.testing.assert_close(merged.var.double(), ref.var(0, unbiased=False), rtol=5e-3, atol=0)
    # the kernel alone does better than that bound: its own part of 699 rows to float32 round-off of σ²
    _, (_, var) = interpreted["mean dominated 3"]
    torch.testing.assert_close(var.double(), parts[3].double().var(0, unbiased=False), rtol=1e-3, atol=0)


# ----------------------------------------------------------------------------------- whole steps, both paths
@pytest.mark.parametrize("index", range(len(STEP_CASES)), ids=[f"{n}-{sorted(o)}" for n, o, _ in STEP_CASES])
def test_a_grouped_step_is_the_pure_torch_step(interpreted: dict[str, Any], index: int) -> None:
    """BNPPreconditioner steps with the grouped kernels against the default pure-torch step, from
    one seed: every transformed gradient, running state (m, v, ρ^t + κ, t) and (μ, σ̃²) to float32 round-off (the
    gradient's for half models), the same warnings; each step launched the state kernel and the transform kernel
    once per plan (the torch state ops where the counts are on the device: a token mask), the reference neither."""
    (_, _, options, _), result = interpreted[f"steps {index}"]
    grouped, ref = result["grouped"], result["reference"]
    assert all(grouped[-1]["grouped plans"]) and grouped[-1]["transform kernels"]
    assert all(grouped[-1]["transform kernels"]) and not any(ref[-1]["grouped plans"])
    assert grouped[-1]["warnings"] == ref[-1]["warnings"]
    plans = len(grouped[-1]["grouped plans"])
    state = 0 if "mask" in options else plans  # a token mask's counts are on the device: the torch state ops
    for step in grouped[:-1]:
        assert step["launches"] == {"state": state, "transform": plans}, "one launch of each kernel per plan"
    assert all(step["launches"] == {"state": 0, "transform": 0} for step in ref[:-1])
    if "poison" in options:
        assert grouped[-1]["warnings"], "a non-finite or overflowing step is named"
    for step, (got, want) in enumerate(zip(grouped[:-1], ref[:-1])):
        for n, g in want["grads"].items():
            if g.dtype != torch.float32:
                _closer_to_the_formula(got, want, n)
                continue
            tol = 64 * EPS32 * float(g.abs().nan_to_num(0.0, 0.0, 0.0).max()) + 1e-30
            torch.testing.assert_close(got["grads"][n], g, rtol=0, atol=tol, equal_nan=True, msg=f"step {step} {n}")
        for n, (m, v, d, t) in want["state"].items():
            gm, gv, gd, gt = got["state"][n]
            assert gt == t, f"step {step} {n}: steps"
            for a, b in ((gm, m), (gv, v), (gd, d)):
                torch.testing.assert_close(a, b, rtol=4 * EPS32, atol=0, equal_nan=True, msg=f"step {step} {n}")
        assert got["transform"].keys() == want["transform"].keys()
        for n, (mu, var_t, q2) in want["transform"].items():
            gmu, gvar, gq2 = got["transform"][n]
            assert gq2 == q2
            assert (gmu is None) == (mu is None), n
            if mu is not None:
                torch.testing.assert_close(gmu, mu, rtol=4 * EPS32, atol=4 * EPS32 * float(mu.abs().max()))
            torch.testing.assert_close(gvar, var_t, rtol=4 * EPS32, atol=0)


def _closer_to_the_formula(got: dict[str, Any], want: dict[str, Any], name: str) -> None:
    """A half model's parameter ``name`` (a Linear layer's): the grouped step's gradient is eq. 15 in float64 from the
    gradient before the step and the step's μ, σ̃², q², to within one rounding into the gradient's dtype — at least
    as close as the pure-torch step's, which rounds μ and G_w − μ G_b into the half dtype."""
    layer = name.rsplit(".", 1)[0]
    mu, var_t, q2 = got["transform"][layer]
    w, b = got["raw"][f"{layer}.weight"].double(), got["raw"][f"{layer}.bias"].double()
    want_w, want_b = reference(w, b, None if mu is None else mu.double(), var_t.double(), q2, 1)
    exact = want_w if name.endswith("weight") else want_b
    assert exact is not None
    grouped_error = float((got["grads"][name].double() - exact).abs().max())
    torch_error = float((want["grads"][name].double() - exact).abs().max())
    eps = torch.finfo(got["grads"][name].dtype).eps
    assert grouped_error <= max(torch_error, eps * float(exact.abs().max())), (name, grouped_error, torch_error)


# ------------------------------------------------------------------------------------- the path, chosen once
@pytest.fixture
def triton_present(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(step_path, "triton_importable", lambda: True)


@pytest.mark.usefixtures("triton_present")
@pytest.mark.parametrize(
    ("device", "dtype", "requested", "grouped"),
    [
        ("cuda", torch.float32, True, True),
        ("cuda", torch.float32, False, False),  # not asked for: the reference (the default)
        ("cuda", torch.float64, True, False),  # float64 statistics stay on the torch path
        ("cpu", torch.float32, True, False),  # the CPU path is the torch step
        ("meta", torch.float32, True, False),
    ],
)
def test_which_plan_takes_the_grouped_kernels(device: str, dtype: torch.dtype, requested: bool,
                                              grouped: bool) -> None:  # fmt: skip
    assert step_path.uses_grouped_kernels(torch.device(device), dtype, requested=requested) is grouped


def test_without_triton_every_plan_takes_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(step_path, "triton_importable", lambda: False)
    assert not step_path.uses_grouped_kernels(torch.device("cuda"), torch.float32, requested=True)


@pytest.mark.usefixtures("triton_present")
def test_the_path_is_chosen_once_per_plan_from_its_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan on a kernel device (here ``meta`` counted as one, in place of CUDA) holds the grouped path's tables;
    one without ``grouped_kernels``, or on the CPU, holds none; a CPU preconditioner's plans take the torch path."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2, bias=False))
    pre = BNPPreconditioner(model)
    layers = list(pre.layers.values())
    monkeypatch.setattr(step_path, "KERNEL_DEVICES", {"cuda", "meta"})
    meta = torch.device("meta")
    plan = StepPlan(layers, meta, torch.float32, 0.0, grouped_kernels=True)
    assert plan.grouped is not None and plan.grouped.offsets == [0, 3] and plan.grouped.centred == [True, False]
    assert StepPlan(layers, meta, torch.float32, 0.0).grouped is None
    assert StepPlan(layers, torch.device("cpu"), torch.float32, 0.0, grouped_kernels=True).grouped is None
    model(torch.randn(5, 3)).sum().backward()
    pre.step()
    assert [p.grouped for p in pre._step.plans.values()] == [None]


@pytest.mark.usefixtures("triton_present")
def test_recurrent_layers_take_the_torch_step_where_kernels_are_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """The two weight blocks of a recurrent layer share one floor and one bias gradient, which the kernels do not
    know: a plan holding them takes the pure-torch path, as a plan of Linears alone on the same device does not."""
    monkeypatch.setattr(step_path, "KERNEL_DEVICES", {"cuda", "meta"})
    meta = torch.device("meta")
    layers = list(BNPPreconditioner(nn.LSTM(3, 4)).layers.values())
    assert len(layers) == 2 and StepPlan(layers, meta, torch.float32, 0.0, grouped_kernels=True).grouped is None
    linears = list(BNPPreconditioner(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))).layers.values())
    assert StepPlan(linears, meta, torch.float32, 0.0, grouped_kernels=True).grouped is not None


def test_grouped_kernels_is_a_validated_keyword_kept_by_copies() -> None:
    model = nn.Sequential(nn.Linear(3, 2))
    with pytest.raises(TypeError, match="grouped_kernels"):
        BNPPreconditioner(model, grouped_kernels="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        BNPPreconditioner(model, True)  # type: ignore[misc]  # keyword-only
    pre = BNPPreconditioner(copy.deepcopy(model), grouped_kernels=True)
    assert "grouped_kernels=True" in repr(pre) and "grouped_kernels" not in repr(BNPPreconditioner(model))
    for copied in (copy.deepcopy(pre), pickle.loads(pickle.dumps(pre))):
        assert copied.grouped_kernels and copied._step.grouped_kernels


@pytest.mark.usefixtures("triton_present")
@pytest.mark.parametrize("proven", [False, True])
def test_kernels_that_cannot_run_leave_the_plan_on_the_torch_step(
    monkeypatch: pytest.MonkeyPatch, proven: bool
) -> None:
    """A plan whose grouped kernels fail at their first step (here the state kernel raises, as a Triton that cannot
    compile for the device would) takes the pure-torch step from then on, that step included, and says so once;
    once they have run, a failure is raised as it is."""

    def fails(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no kernel for this device")

    monkeypatch.setattr(step_path, "KERNEL_DEVICES", {"cuda", "cpu"})
    monkeypatch.setattr(step_path.GroupedKernels, "state", fails)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    reference = copy.deepcopy(model)
    pre, pre_ref = BNPPreconditioner(model, grouped_kernels=True), BNPPreconditioner(reference)
    x = torch.randn(6, 3)
    for net in (model, reference):
        net(x).sum().backward()
    if proven:  # (as if they had run at an earlier step)
        init = step_path.GroupedPath.__init__

        def proven_init(self: step_path.GroupedPath, *args: Any) -> None:
            init(self, *args)
            self.proven = True

        monkeypatch.setattr(step_path.GroupedPath, "__init__", proven_init)
        with pytest.raises(RuntimeError, match="no kernel for this device"):
            pre.step()
        return
    with pytest.warns(BNPWarning, match="grouped GPU kernels could not run here.*no kernel for this device"):
        pre.step()
    pre_ref.step()
    assert [p.grouped for p in pre._step.plans.values()] == [None]
    for a, b in zip(model.parameters(), reference.parameters()):
        assert a.grad is not None and b.grad is not None
        assert torch.equal(a.grad, b.grad)
