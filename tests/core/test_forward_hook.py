"""Issue 27 (survivors of ``BNPPreconditioner._make_hook``): the forward hook of a registered kind that reads its own
input (``LayerKind.input``: here a keyword the module names) and its own rows under a token mask
(``LayerKind.token_rows``: here from a positional or keyword argument of the call), reduced by the kind's
``moments`` (given the module and the output) — in eager mode, where a forward counts when the backward reaches
its output, and in the traced branch (``torch.compiler.is_compiling()``, patched to run in eager), where every
training forward counts at once."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_bnp import BNPPreconditioner, LayerKind, register_layer_kind
from lightning_bnp.core.kinds import unregister_layer_kind
from lightning_bnp.core.moments import feature_moments, masked_feature_moments
from lightning_bnp.core.statistics import Moments
from tests.helpers import spy_moments


class Keyed(nn.Module):
    """A dense layer applied to every keyword input; BNP's rows are the one under the keyword ``key``, cast to the
    output's dtype and scaled by ``input_scale``. The optional first argument ``keep`` only tells the kind which
    rows count under a token mask."""

    def __init__(self, in_features: int, out_features: int, key: str, input_scale: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features))
        self.bias = nn.Parameter(torch.randn(out_features))
        self.key, self.input_scale = key, input_scale

    def forward(self, keep: Tensor | None = None, **inputs: Tensor) -> Tensor:
        scale = self.input_scale
        return torch.stack(
            [F.linear(h.to(self.weight.dtype) * scale, self.weight, self.bias) for h in inputs.values()]
        ).sum(0)


class KeyedKind(LayerKind):
    name = "Keyed"
    module_type = Keyed

    def input(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return kwargs.get(str(module.key))

    def token_rows(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], h: Tensor, mask: Tensor
    ) -> Tensor | None:
        keep = args[0] if args else kwargs.get("keep")
        real = mask if keep is None else mask & keep
        return real if real.shape == h.shape[:-1] else None

    def moments(self, module: nn.Module, h: Tensor, output: Any) -> Moments:
        return feature_moments(h.to(output.dtype) * float(module.input_scale))  # type: ignore[arg-type]

    def masked_moments(self, module: nn.Module, h: Tensor, output: Any, real: Tensor) -> Moments:
        return masked_feature_moments(h.to(output.dtype) * float(module.input_scale), real)  # type: ignore[arg-type]


@pytest.fixture
def keyed() -> Iterator[tuple[Keyed, BNPPreconditioner, dict[str, Moments]]]:
    register_layer_kind(KeyedKind())
    try:
        torch.manual_seed(0)
        module = Keyed(3, 2, key="x", input_scale=0.5).double()
        pre = BNPPreconditioner(nn.ModuleDict({"k": module}), layer_types=["Keyed"], statistics="batch")
        yield module, pre, spy_moments(pre)
    finally:
        unregister_layer_kind("Keyed")


def assert_moments_of_rows(m: Moments, rows: Tensor) -> None:
    """``m`` are the statistics of ``rows`` (float32 inputs of a float64 layer, scaled by 0.5): N, μ, biased σ²."""
    rows = rows.reshape(-1, rows.shape[-1]).double() * 0.5
    assert float(m.rows) == rows.shape[0]
    torch.testing.assert_close(m.mean, rows.mean(0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m.var, rows.var(0, correction=0), rtol=1e-12, atol=1e-12)


def inputs() -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Three (2, 4, 3) float32 inputs, a token mask and two ``keep`` flags (2, 4) that each drop other real rows."""
    g = torch.Generator().manual_seed(1)
    a, b, c = (torch.randn(2, 4, 3, generator=g) * 3 + 1 for _ in range(3))
    mask = torch.tensor([[True, True, False, True], [True, False, True, True]])
    keep1 = torch.tensor([[True, False, True, True], [False, True, True, True]])
    keep2 = torch.tensor([[False, True, True, True], [True, True, True, False]])
    return a, b, c, mask, keep1, keep2


def run(forwards: Callable[[], Tensor], traced: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as patch:
        if traced:
            patch.setattr(torch.compiler, "is_compiling", lambda: True)
        loss = forwards()
    loss.backward()


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_a_kind_with_its_own_input_counts_the_keyword_it_names_and_the_rows_it_keeps(
    keyed: tuple[Keyed, BNPPreconditioner, dict[str, Moments]], traced: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two training forwards with the input under ``x`` count both, reduced by the kind's own ``moments``; a call
    without it (its input under another keyword) counts nothing. Under a token mask each call counts the rows
    the mask and its own ``keep`` (positional in one call, a keyword in the other) mark."""
    module, pre, seen = keyed
    a, b, c, mask, keep1, keep2 = inputs()
    run(lambda: module(x=a).sum() + module(x=b).square().sum() + module(y=c).sum(), traced, monkeypatch)
    pre.step()
    assert_moments_of_rows(seen["k"], torch.cat([a, b]))
    with pre.token_mask(mask):
        run(lambda: module(keep1, x=a).sum() + module(keep=keep2, x=b).square().sum(), traced, monkeypatch)
    pre.step()
    assert_moments_of_rows(seen["k"], torch.cat([a[mask & keep1], b[mask & keep2]]))
