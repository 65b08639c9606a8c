"""The figures of the docs' "Transposed convolutions" page (``benchmarks.transposed_conv``)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from benchmarks.transposed_conv import border_errors, explicit_h, preconditioned_spectrum, q2_of_input_positions
from lightning_bnp.core import BNPPreconditioner


def test_the_explicit_matrix_reproduces_the_layer() -> None:
    conv = nn.ConvTranspose2d(3, 2, 4, stride=2, padding=1).double()
    x = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    rows = conv.weight.transpose(0, 1).reshape(2, -1)
    expected = conv(x).movedim(1, -1).reshape(-1, 2)
    torch.testing.assert_close(explicit_h(conv, x) @ rows.T + conv.bias, expected, rtol=1e-12, atol=1e-12)


def test_q2_scales_the_largest_eigenvalue_and_leaves_the_condition_number() -> None:
    h = torch.relu(torch.randn(40, 6, dtype=torch.float64))
    lam1, kappa1 = preconditioned_spectrum(h, 4, 1.0)
    lam4, kappa4 = preconditioned_spectrum(h, 4, 4.0)
    assert abs(lam1 / lam4 - 4.0) < 1e-9 and abs(kappa1 / kappa4 - 1.0) < 1e-9


def test_the_per_channel_form_errs_only_with_padding() -> None:
    errors = border_errors(batch=2, channels=2)
    assert all(max(e) < 1e-9 for (k, s, p, side), e in errors.items() if p == 0)
    assert all(min(e) > 1e-3 for (k, s, p, side), e in errors.items() if p > 0)


def test_the_q2_alternative_counts_input_positions_and_is_undone() -> None:
    def q2_after_one_step(columns: str, alternative: bool) -> float:
        conv = nn.ConvTranspose2d(1, 1, 2, stride=2)  # fan_in 4, N 2: q² = √(positions) ≥ 2
        with q2_of_input_positions() if alternative else contextlib.nullcontext():
            pre = BNPPreconditioner(conv, conv_statistics=columns)  # type: ignore[arg-type]
        conv(torch.randn(2, 1, 4, 4)).sum().backward()
        pre.step()
        pre.detach()
        assert pre.layers[""].transform is not None
        return float(pre.layers[""].transform.q2)

    for columns in ("channel", "column"):
        assert q2_after_one_step(columns, True) == 4.0  # √16 input positions
        assert q2_after_one_step(columns, False) == 8.0  # √64 output positions: restored on exit
