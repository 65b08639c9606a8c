"""Issue 17 item 11: what BNP does under Adam. Adam divides each coordinate by its own running RMS, so a
per-coordinate gradient scale that stays constant cancels: BNP's D⁻¹/q² (a per-input-column scale) has
no effect on a layer without bias, and only the centring (the μ coupling of weight and bias, eq. 15)
changes Adam's steps. Measured here, exactly, with batch statistics of a fixed batch (a constant P)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_bnp.core import BNPPreconditioner


def adam_run(bias: bool, bnp: bool, steps: int = 5) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3, bias=bias)).double()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-300)  # eps ≈ 0: exact scale invariance
    pre = BNPPreconditioner(model, statistics="batch") if bnp else None
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 4, generator=g, dtype=torch.float64) * torch.tensor([0.1, 1.0, 5.0, 20.0]) + 3.0
    y = torch.randn(16, 3, generator=g, dtype=torch.float64)
    for _ in range(steps):  # the same batch every step: the same P every step
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if pre is not None:
            pre.step()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_adam_cancels_bnp_column_scaling_without_bias() -> None:
    for with_bnp, without in zip(adam_run(bias=False, bnp=True), adam_run(bias=False, bnp=False)):
        torch.testing.assert_close(with_bnp, without, rtol=1e-12, atol=1e-12)


def test_adam_keeps_bnp_centring_with_bias() -> None:
    differences = [(a - b).abs().max().item() for a, b in zip(adam_run(True, True), adam_run(True, False))]
    assert max(differences) > 1e-3
