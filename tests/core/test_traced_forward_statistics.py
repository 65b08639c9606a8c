"""How a forward hook counts statistics while ``torch.compiler.is_compiling()`` (a traced forward): at the
forward, merged over the layer's calls, instead of when the backward reaches the layer. Checked in eager mode with
``is_compiling`` patched to answer True, so the branch runs without torch.compile (issue 27 survivors of
``BNPPreconditioner._make_hook``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_bnp.core import BNPPreconditioner


def test_a_traced_forward_merges_the_moments_of_every_call_of_a_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = nn.Linear(3, 2).double()
    pre = BNPPreconditioner(layer)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, generator=g, dtype=torch.float64)
    y = torch.randn(6, 3, generator=g, dtype=torch.float64) * 3 + 1
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    layer(x)
    layer(y)
    monkeypatch.undo()
    moments = pre.layers[""].moments
    assert moments is not None
    both = torch.cat([x, y])  # one call on both batches: 10 rows, their mean and biased variance
    assert int(moments.rows) == int(moments.samples) == 10
    torch.testing.assert_close(moments.mean, both.mean(0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(moments.var, both.var(0, correction=0), rtol=1e-12, atol=1e-12)
    pre.detach()
