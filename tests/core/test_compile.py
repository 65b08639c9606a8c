"""Issue 16: ``torch.compile(model)`` with BNP — the fast path — against eager on CPU.

The hooks are traced into the compiled forward (no graph break), and a few SGD steps leave the same
parameters and running statistics as eager for the ``eager``, ``aot_eager`` and ``inductor`` backends.
"""

from __future__ import annotations

import shutil
import warnings
from typing import Any

import pytest
import torch
import torch._dynamo
import torch._inductor.config
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_bnp.core import BNPPreconditioner, BNPWarning
from lightning_bnp.core.attention import register_functional_linear
from lightning_bnp.core.kinds import unregister_layer_kind

LINEAR, MHA_FORWARD = F.linear, F.multi_head_attention_forward

BACKENDS = [
    "eager",
    "aot_eager",
    pytest.param(
        "inductor",
        marks=pytest.mark.skipif(
            shutil.which("c++") is None and shutil.which("g++") is None, reason="inductor needs a C++ compiler on CPU"
        ),
    ),
]


def make_cnn() -> nn.Sequential:
    """Convolutions with and without bias, a grouped one, and a dense head."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1, bias=False),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, stride=2, groups=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 3 * 3, 5),
        nn.ReLU(),
        nn.Linear(5, 3),
    )


def train(model: nn.Module, backend: str | None, steps: int = 4) -> BNPPreconditioner:
    """SGD with BNP on fixed batches; ``backend=None`` is eager."""
    pre = BNPPreconditioner(model)  # hooks first, then compile: the hooks are traced
    forward = model if backend is None else torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(6, 1, 8, 8, generator=g) * 2 + 1
        y = torch.randint(0, 3, (6,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(forward(x), y).backward()
        pre.step(opt)
        opt.step()
    return pre


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_model_trains_like_eager(backend: str) -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager_model, compiled_model = make_cnn(), make_cnn()
    eager, compiled = train(eager_model, None), train(compiled_model, backend)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    for (name, p), q in zip(eager_model.named_parameters(), compiled_model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
    for name, layer in eager.layers.items():
        other = compiled.layers[name].running
        assert other.steps == layer.running.steps == 4
        torch.testing.assert_close(other.mean_acc, layer.running.mean_acc, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(other.var_acc, layer.running.var_acc, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("guard_hooks", [False, True])
def test_a_graph_compiled_without_bnp_is_reused_unless_dynamo_guards_hooks(guard_hooks: bool) -> None:
    """Dynamo does not guard on module hooks by default: a graph compiled earlier for the same network class
    without BNP runs without its hooks, and BNP says so ("never ran") instead of silently doing nothing.
    README "Cost" gives the two ways out; this pins both behaviours."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=not guard_hooks):
        torch.compile(make_cnn(), backend="eager")(torch.randn(6, 1, 8, 8))  # same class and shapes, no hooks
        model = make_cnn()
        if guard_hooks:
            pre = train(model, "eager")
            assert all(layer.running.steps == 4 for layer in pre.layers.values())
        else:
            with pytest.warns(BNPWarning, match="never ran"):
                pre = train(model, "eager")
            assert all(layer.running.steps == 0 for layer in pre.layers.values())
    torch._dynamo.reset()


def train_with_compiled_step(
    backend: str | None, steps: int = 4, **options: object
) -> tuple[nn.Module, BNPPreconditioner]:
    """``train`` with the model compiled by ``backend`` and the BNP step compiled too (issue 28 item 2);
    ``backend=None``: everything eager."""
    model = make_cnn()
    pre = BNPPreconditioner(model, **options)  # type: ignore[arg-type]
    if backend is not None:
        pre.compile_step(backend=backend)
    forward = model if backend is None else torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(6, 1, 8, 8, generator=g) * 2 + 1
        y = torch.randint(0, 3, (6,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(forward(x), y).backward()
        pre.step(opt)
        opt.step()
    return model, pre


@pytest.mark.parametrize(
    ("backend", "options"),
    [
        ("eager", {}),
        ("aot_eager", {}),
        pytest.param("inductor", {}, marks=BACKENDS[2].marks),  # type: ignore[union-attr]
        ("eager", {"bias_correction": True}),
        ("eager", {"statistics": "batch"}),
        ("eager", {"conv_statistics": "column"}),
    ],
)
def test_the_compiled_step_is_one_graph_and_trains_like_eager(backend: str, options: dict[str, object]) -> None:
    """Issue 28 item 2: the step's statistics update and transform trace whole (``fullgraph=True`` fails on any
    graph break) and give eager's parameters and statistics."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager_model, eager = train_with_compiled_step(None, **options)
    compiled_model, compiled = train_with_compiled_step(backend, **options)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert compiled.step_compiled
    for (name, p), q in zip(eager_model.named_parameters(), compiled_model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
    for name, layer in eager.layers.items():
        other = compiled.layers[name].running
        assert other.steps == layer.running.steps == (0 if options.get("statistics") == "batch" else 4)
        torch.testing.assert_close(other.mean_acc, layer.running.mean_acc, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(other.var_acc, layer.running.var_acc, rtol=1e-5, atol=1e-6, msg=name)


def train_attention(model: nn.Module, backend: str | None, inputs: Any, steps: int) -> BNPPreconditioner:
    """SGD + BNP on ``model`` fed ``inputs(generator)`` (a tuple of forward arguments); ``backend=None`` is eager,
    otherwise ``torch.compile(fullgraph=True)``: any graph break fails."""
    pre = BNPPreconditioner(model)
    forward = model if backend is None else torch.compile(model, backend=backend, fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BNPWarning)  # no layer is left untransformed
        for _ in range(steps):
            opt.zero_grad()
            out = forward(*inputs(g))
            (out[0] if isinstance(out, tuple) else out).square().mean().backward()
            pre.step(opt)
            opt.step()
    return pre


def assert_trained_alike(
    model: nn.Module, pre: BNPPreconditioner, eager: nn.Module, eager_pre: BNPPreconditioner
) -> None:
    for (name, p), q in zip(eager.named_parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
    for name, layer in eager_pre.layers.items():
        other = pre.layers[name].running
        assert other.steps == layer.running.steps > 0, name
        torch.testing.assert_close(other.mean_acc, layer.running.mean_acc, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(other.var_acc, layer.running.var_acc, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_multihead_attention_under_compile(backend: str) -> None:
    """Issue 24: a compiled nn.TransformerEncoder (dropout on) with BNP is one graph — no graph break, no
    recompilation over 12 steps — and every attention layer, out_proj included (whose input BNP captures from
    MHA's F.linear call), is preconditioned as in eager."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, batch_first=True)
        return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def inputs(g: torch.Generator) -> tuple[Tensor]:
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=g)))  # the same dropout masks in both runs
        return (torch.randn(3, 4, 8, generator=g),)

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager = build()
    eager_pre = train_attention(eager, None, inputs, 12)
    model = build()
    with torch._inductor.config.patch(fallback_random=True):  # inductor: eager's dropout masks
        pre = train_attention(model, backend, inputs, 12)
    counters = torch._dynamo.utils.counters
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # no recompilation
    assert sum(name.endswith(".out_proj") for name in pre.layers) == 2
    assert_trained_alike(model, pre, eager, eager_pre)
    assert F.linear is LINEAR and F.multi_head_attention_forward is MHA_FORWARD  # restored after the graph


@pytest.mark.parametrize("case", ["cross-key-padding-weights", "kdim-vdim-seq-first-causal"])
def test_multihead_attention_forms_under_compile(case: str) -> None:
    """Cross-attention with a key-padding mask and ``need_weights``, and separate q/k/v weights with a causal
    mask, sequence first: compiled (aot_eager, fullgraph) equals eager, out_proj included (eager BNP on MHA
    equals BNP on four nn.Linear layers: tests/core/test_attention.py)."""
    kdim, vdim, batch_first = (8, 8, True) if case.startswith("cross") else (5, 3, False)

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=batch_first, kdim=kdim, vdim=vdim)

        def forward(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
            if case.startswith("cross"):
                padding = torch.zeros(3, 6, dtype=torch.bool)
                padding[0, -2:] = True
                return self.attn(query, key, value, key_padding_mask=padding, need_weights=True)[0]
            causal = torch.ones(4, 6, dtype=torch.bool).triu(1)
            return self.attn(query, key, value, attn_mask=causal, need_weights=False)[0]

    def build() -> nn.Module:
        torch.manual_seed(0)
        return Attention()

    def inputs(g: torch.Generator) -> tuple[Tensor, ...]:
        shape = (lambda n, f: (3, n, f)) if batch_first else (lambda n, f: (n, 3, f))
        key = torch.randn(shape(6, kdim), generator=g) * 2 + 0.5
        value = key if kdim == vdim else torch.randn(shape(6, vdim), generator=g)
        return torch.randn(shape(4, 8), generator=g), key, value

    torch._dynamo.reset()
    eager = build()
    eager_pre = train_attention(eager, None, inputs, 4)
    model = build()
    pre = train_attention(model, "aot_eager", inputs, 4)
    assert len(pre.layers) == 4
    assert_trained_alike(model, pre, eager, eager_pre)


class FunctionalParent(nn.Module):
    """A parent that calls F.linear with its children's weights (as torchvision's Swin does)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(6, 12), nn.Linear(4, 5)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = F.linear(x, self.qkv.weight, self.qkv.bias).chunk(3, dim=-1)
        attn = (q @ k.transpose(-1, -2)).softmax(-1) @ v
        return F.linear(attn, self.proj.weight, self.proj.bias)


def test_functional_linear_under_compile() -> None:
    """The general F.linear capture (``register_functional_linear``): traced into one graph, equal to eager."""
    kinds = register_functional_linear(FunctionalParent, ["qkv", "proj"])
    try:

        def build() -> nn.Module:
            torch.manual_seed(0)
            return nn.Sequential(FunctionalParent(), nn.Linear(5, 3))

        def inputs(g: torch.Generator) -> tuple[Tensor]:
            return (torch.randn(3, 7, 6, generator=g) * 2 + 0.5,)

        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        eager = build()
        eager_pre = train_attention(eager, None, inputs, 4)
        model = build()
        pre = train_attention(model, "aot_eager", inputs, 4)
        assert list(pre.layers) == ["0.qkv", "0.proj", "1"]
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
        assert_trained_alike(model, pre, eager, eager_pre)
        assert F.linear is LINEAR
    finally:
        for kind in kinds:
            unregister_layer_kind(kind.name)
