"""The forward-statistics collection (``lightning_bnp/core/collection.py``): behaviour that the mutation run of the
split collection found untested (tests/MUTANTS.md, "The fifth pass"). The q, k and v layers of a self-attention
reduce their one input once (and again once it is changed in place); a traced forward's attention statistics and
those of a kind with several calls per forward (given the module and each output); a collection pickled before the
discarded-gradient bookkeeping existed."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_bnp.core import BNPPreconditioner
from lightning_bnp.core.attention import MHAProjectionKind
from lightning_bnp.core.collection import StatisticsCollection
from lightning_bnp.core.kinds import LayerKind, register_layer_kind, unregister_layer_kind
from lightning_bnp.core.statistics import Moments
from tests.core.test_layer_kinds import Pair, PairKind

E, HEADS = 8, 2
QKV = ("attn.q", "attn.k", "attn.v")


class SelfAttention(nn.Module):
    """One ``nn.MultiheadAttention`` fed one tensor as query, key and value."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(E, HEADS, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.attn(x, x, x, need_weights=False)[0]


def _model() -> SelfAttention:
    torch.manual_seed(0)
    return SelfAttention().double()


def _counting_reductions(monkeypatch: pytest.MonkeyPatch) -> list[Tensor]:
    """Patch the q, k, v kind's reduction to record the input of every call (the reduction itself unchanged)."""
    reduce = MHAProjectionKind.moments
    seen: list[Tensor] = []

    def counting(self: MHAProjectionKind, module: nn.Module, h: Tensor, output: Any) -> Moments:
        seen.append(h)
        return reduce(self, module, h, output)

    monkeypatch.setattr(MHAProjectionKind, "moments", counting)
    return seen


def _assert_moments_of(moments: Moments | None, x: Tensor) -> None:
    """``moments`` are the per-feature mean and biased variance of the rows of ``x`` (B, T, E)."""
    assert moments is not None
    rows = x.reshape(-1, E)
    assert int(moments.rows) == int(moments.samples) == rows.shape[0]
    torch.testing.assert_close(moments.mean, rows.mean(0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(moments.var, rows.var(0, correction=0), rtol=1e-12, atol=1e-12)


def test_the_q_k_v_layers_of_a_self_attention_reduce_their_one_input_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A self-attention's query, key and value are one tensor: one reduction per forward serves the three layers
    (each still gets the moments of that tensor), and the next forward's new tensor is reduced once more."""
    model = _model()
    pre = BNPPreconditioner(model)
    seen = _counting_reductions(monkeypatch)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 5, E, generator=g, dtype=torch.float64)
    model(x).sum().backward()
    assert len(seen) == 1 and seen[0] is x
    for name in QKV:
        _assert_moments_of(pre.layers[name].moments, x)
    y = torch.randn(3, 5, E, generator=g, dtype=torch.float64) * 2 + 1
    model(y).sum().backward()
    assert len(seen) == 2 and seen[1] is y
    for name in QKV:
        _assert_moments_of(pre.layers[name].moments, torch.cat([x, y]))
    pre.detach()


def test_an_input_changed_in_place_since_the_last_forward_is_reduced_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one reduction is kept for the same tensor at the same version only: the same input tensor scaled in
    place between two forwards gives the second step the moments of its new values (not the first forward's)."""
    model = _model()
    pre = BNPPreconditioner(model)
    seen = _counting_reductions(monkeypatch)
    x = torch.randn(4, 5, E, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    model(x).sum().backward()
    pre.step()
    model.zero_grad()
    assert all(pre.layers[name].moments is None for name in QKV)  # the step took them
    with torch.no_grad():
        x.mul_(3).add_(1)
    model(x).sum().backward()
    assert len(seen) == 2
    for name in QKV:
        _assert_moments_of(pre.layers[name].moments, x)
    pre.detach()


def test_a_traced_forward_counts_the_q_k_v_moments_of_a_self_attention_at_the_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While ``torch.compiler.is_compiling()`` (patched in eager, as in test_traced_forward_statistics.py) the
    q, k and v layers count the moments of the attention's input at the forward, before any backward, one
    reduction per layer (a traced forward fuses them: no identity cache)."""
    model = _model()
    pre = BNPPreconditioner(model)
    seen = _counting_reductions(monkeypatch)
    x = torch.randn(4, 5, E, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    model(x)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    assert len(seen) == 3 and all(h is x for h in seen)
    for name in QKV:
        _assert_moments_of(pre.layers[name].moments, x)
    out_proj = pre.layers["attn.out_proj"].moments  # the attention output, captured from F.linear: its rows
    assert out_proj is not None and int(out_proj.rows) == 4 * 5
    pre.detach()


def test_a_traced_forward_gives_a_kind_with_several_calls_the_module_and_the_output_of_each_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kind whose forward yields (input, output) pairs (``LayerKind.calls``) reduces each pair with its own
    ``moments`` in a traced forward too, given the module and that pair's output: ``PairKind``'s rows are its
    float32 inputs cast to the float64 output's dtype and scaled by the module's ``input_scale``."""
    register_layer_kind(PairKind())
    try:
        torch.manual_seed(0)
        net = nn.ModuleDict({"pair": Pair(3, 2, input_scale=0.5).double()})
        pre = BNPPreconditioner(net, layer_types=["Pair"])
        g = torch.Generator().manual_seed(5)
        a, b = torch.randn(4, 3, generator=g) * 3 + 1, torch.randn(5, 3, generator=g)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        net["pair"](a, other=b)
        monkeypatch.undo()
        moments = pre.layers["pair"].moments  # counted at the forward: no backward ran
        assert moments is not None and moments.mean.dtype == torch.float64
        rows = torch.cat([b, a]).double() * 0.5
        assert int(moments.rows) == 9
        torch.testing.assert_close(moments.mean, rows.mean(0), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(moments.var, rows.var(0, correction=0), rtol=1e-12, atol=1e-12)
        pre.detach()
    finally:
        unregister_layer_kind("Pair")


def test_a_collection_pickled_before_the_discarded_gradient_bookkeeping_loads_and_drops_a_discarded_gradient(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A preconditioner whose collection was pickled without ``settled`` (written between the split into parts and
    the discarded-gradient bookkeeping) loads attached, and its statistics go with a gradient that ``zero_grad()``
    throws away: only the forward after it counts."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    pre = BNPPreconditioner(model)
    getstate = StatisticsCollection.__getstate__
    monkeypatch.setattr(
        StatisticsCollection, "__getstate__", lambda self: {k: v for k, v in getstate(self).items() if k != "settled"}
    )
    blob = pickle.dumps({"model": model, "pre": pre})
    monkeypatch.undo()
    pre.detach()
    saved = pickle.loads(blob)
    model, pre = saved["model"], saved["pre"]
    assert pre.attached
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(4, 3, generator=g, dtype=torch.float64), torch.randn(6, 3, generator=g, dtype=torch.float64)
    model(x).sum().backward()
    model.zero_grad()  # set_to_none: the gradient x's statistics reached is thrown away
    model(y).sum().backward()
    moments = pre.layers[""].moments
    assert moments is not None and int(moments.rows) == 6
    torch.testing.assert_close(moments.mean, y.mean(0), rtol=1e-12, atol=1e-12)
    pre.detach()


class ScaledInput(nn.Module):
    """A dense layer whose forward takes a scale first and its input second: ``linear(scale · x)``."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features))
        self.bias = nn.Parameter(torch.randn(out_features))

    def forward(self, scale: float, x: Tensor) -> Tensor:
        return F.linear(x * scale, self.weight, self.bias)


class ScaledInputKind(LayerKind):
    """The rows ``ScaledInput``'s weight multiplies: its second positional argument times its first (or the
    keywords ``x`` and ``scale``)."""

    name = "ScaledInput"
    module_type = ScaledInput

    def input(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        x = args[1] if len(args) > 1 else kwargs.get("x")
        scale = args[0] if args else kwargs.get("scale")
        return None if x is None or scale is None else x * scale


def test_a_kind_with_its_own_input_is_given_the_positional_arguments_of_the_call() -> None:
    """A kind whose ``input`` reads the forward's positional arguments (the plain forward hook, one call per
    forward) counts the rows it builds from them: ``2 · x`` of ``module(2.0, x)``, and ``3 · y`` of
    ``module(scale=3.0, x=y)``."""
    register_layer_kind(ScaledInputKind())
    try:
        torch.manual_seed(0)
        module = ScaledInput(3, 2).double()
        pre = BNPPreconditioner(nn.ModuleDict({"s": module}), layer_types=["ScaledInput"])
        g = torch.Generator().manual_seed(6)
        x, y = (torch.randn(n, 3, generator=g, dtype=torch.float64) for n in (4, 5))
        (module(2.0, x).sum() + module(scale=3.0, x=y).sum()).backward()
        moments = pre.layers["s"].moments
        rows = torch.cat([2 * x, 3 * y])
        assert moments is not None and int(moments.rows) == 9
        torch.testing.assert_close(moments.mean, rows.mean(0), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(moments.var, rows.var(0, correction=0), rtol=1e-12, atol=1e-12)
        pre.detach()
    finally:
        unregister_layer_kind("ScaledInput")
