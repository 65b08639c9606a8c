"""Layer-input statistics (Alg. 2/3 steps 1–2, eqs. 13, 21–22) against direct computations."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_bnp.core import BNPPreconditioner
from lightning_bnp.core.moments import (
    column_moments_of_input,
    feature_moments,
    masked_feature_moments,
    moments_of_input,
    token_moments,
)
from lightning_bnp.core.statistics import Moments, RunningStatistics, ema_update
from tests.host_reads import HostReads


def _update(stats: RunningStatistics, mu_h: torch.Tensor, var_h: torch.Tensor) -> None:
    """One running update as a step commits it (``preconditioner._step_math`` and ``PendingUpdate``): the state
    [m ; v ; d] moved towards [μ_H ; σ²_H ; κ] by :func:`ema_update`, then :meth:`RunningStatistics.assign` with
    t + 1 and d = ρ^t + κ as (1,) tensors."""
    n = stats.mean_acc.numel()
    state = torch.cat([stats.mean_acc, stats.var_acc, stats.decay])
    batch = torch.cat([mu_h, var_h, torch.tensor([stats.decay_offset], dtype=stats.decay.dtype)])
    after = ema_update(state, batch.to(state.dtype), stats.rho)
    stats.assign(after[:n], after[n : 2 * n], torch.tensor([stats.steps + 1]), after[2 * n :])


def test_linear_pools_all_leading_dimensions() -> None:
    layer = nn.Linear(5, 2)
    h = torch.randn(3, 7, 5) * 2 + 1
    m = moments_of_input(layer, h, layer(h))
    flat = h.reshape(-1, 5).double()
    assert (m.rows, m.samples, m.out_positions) == (21, 21, 21)
    torch.testing.assert_close(m.mean.double(), flat.mean(0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m.var.double(), flat.var(0, unbiased=False), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "conv",
    [
        nn.Conv1d(3, 4, 3, stride=2),
        nn.Conv2d(4, 6, 3, padding=1, padding_mode="reflect"),
        nn.Conv2d(4, 4, 3, dilation=2, padding=2, padding_mode="circular", groups=4),  # depthwise
        nn.Conv2d(4, 6, (1, 3), stride=(2, 1), padding=0, groups=2),
        nn.Conv3d(2, 3, 2, padding=1, padding_mode="replicate"),
    ],
)
def test_conv_statistics_per_input_channel(conv: nn.Module) -> None:
    spatial = {nn.Conv1d: (9,), nn.Conv2d: (7, 6), nn.Conv3d: (4, 5, 3)}[type(conv)]
    c_in = conv.in_channels  # type: ignore[attr-defined]
    h = torch.randn(5, c_in, *spatial) * torch.arange(1, c_in + 1).view(1, -1, *[1] * len(spatial)) + 3
    out = conv(h)
    m = moments_of_input(conv, h, out)
    per_channel = h.transpose(0, 1).reshape(c_in, -1).double()  # eqs. 21–22: batch × all positions
    torch.testing.assert_close(m.mean.double(), per_channel.mean(1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.var.double(), per_channel.var(1, unbiased=False), rtol=1e-4, atol=1e-5)
    assert m.rows == per_channel.shape[1]
    assert m.samples == 5
    assert m.out_positions == 5 * math.prod(out.shape[2:])  # r·s counts *output* positions


def test_unbatched_conv_input_is_one_sample() -> None:
    conv = nn.Conv2d(2, 3, 3)
    h = torch.randn(2, 6, 6)
    m = moments_of_input(conv, h, conv(h))
    assert (m.samples, m.rows, m.out_positions) == (1, 36, 16)


def test_statistics_are_float32_for_half_inputs() -> None:
    layer = nn.Linear(4, 2)
    h = torch.randn(8, 4).to(torch.bfloat16)
    m = moments_of_input(layer, h, torch.empty(8, 2))
    assert m.mean.dtype == torch.float32 and m.var.dtype == torch.float32


def test_chan_merge_equals_pooled_and_is_stable_when_mean_dominates() -> None:
    # |μ| / σ = 1e5: raw Σh² − (Σh)²/n in float32 loses every digit here
    g = torch.Generator().manual_seed(0)
    h = (1e4 + 0.1 * torch.randn(1000, 3, generator=g, dtype=torch.float64)).float()
    layer = nn.Linear(3, 1)
    parts = [h[:1], h[1:300], h[300:301], h[301:]]
    merged = Moments.empty(3, torch.device("cpu"))
    for part in parts:
        merged = merged.merge(moments_of_input(layer, part, torch.empty(len(part), 1)))
    ref = h.double()
    assert merged.rows == 1000
    torch.testing.assert_close(merged.mean.double(), ref.mean(0), rtol=1e-7, atol=0)
    # each part's float32 σ² is centred on ATen's row-by-row float32 mean, a few ULPs of 1e4 off: (δμ/σ)² ≈ 1.6e-3
    # relative with one thread (the merge itself is pinned in float64 below)
    torch.testing.assert_close(merged.var.double(), ref.var(0, unbiased=False), rtol=5e-3, atol=0)
    naive = (h.square().sum(0) - h.sum(0).square() / 1000) / 1000
    assert (naive.double() - ref.var(0, unbiased=False)).abs().max() > 1.0  # what Chan avoids


def test_chan_merge_is_the_pooled_mean_and_variance_to_rounding() -> None:
    """Issue 27: the merge in float64, where the parts' own moments are exact to rounding, so that any change of
    the pairwise update (its δ² term is ~1e-3 of σ² here) shows: pooled μ, σ², rows, samples and positions."""
    g = torch.Generator().manual_seed(0)
    spread = torch.tensor([0.1, 1.0, 10.0], dtype=torch.float64)
    h = 1e4 + torch.randn(1000, 3, generator=g, dtype=torch.float64) * spread
    h[:300] += 0.05  # parts with different means: δ² n_a n_b / n² is a visible share of σ²
    layer = nn.Linear(3, 1)
    merged = Moments.empty(3, torch.device("cpu"), torch.float64)
    for lo, hi in ((0, 1), (1, 300), (300, 300), (300, 301), (301, 1000)):  # an empty part too
        merged = merged.merge(moments_of_input(layer, h[lo:hi], torch.empty(hi - lo, 1)))
    assert (merged.rows, merged.samples, merged.out_positions) == (1000, 1000, 1000)
    torch.testing.assert_close(merged.mean, h.mean(0), rtol=1e-12, atol=0)
    torch.testing.assert_close(merged.var, h.var(0, correction=0), rtol=1e-9, atol=0)
    # the conv bookkeeping: samples and output positions add up independently of rows
    a = Moments(6, 2, 8, torch.zeros(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64))
    b = Moments(3, 1, 4, torch.ones(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64))
    ab = a.merge(b)
    assert (ab.rows, ab.samples, ab.out_positions) == (9, 3, 12)
    torch.testing.assert_close(ab.mean, torch.tensor([1 / 3], dtype=torch.float64))
    torch.testing.assert_close(ab.var, torch.tensor([1 + 6 * 3 / 81], dtype=torch.float64))  # 1 + δ² n_a n_b / n²


def test_pack_round_trip() -> None:
    m = Moments(7, 3, 12, torch.randn(4), torch.rand(4))
    back = Moments.unpack(m.pack(), 4, torch.float32)
    assert (back.rows, back.samples, back.out_positions) == (7, 3, 12)
    torch.testing.assert_close(back.mean, m.mean)
    torch.testing.assert_close(back.var, m.var)


def test_empty_moments_are_zeros_of_the_given_dtype_and_merge_as_the_identity() -> None:
    """What a rank that saw no rows sends under DDP (``pack``): all zeros, so that the pooled counts are the
    other ranks' (issue 27: survivors of `make mutate` in ``Moments.empty``)."""
    empty = Moments.empty(3, torch.device("cpu"), torch.float64)
    assert empty.mean.dtype == empty.var.dtype == torch.float64
    assert torch.equal(empty.pack(), torch.zeros(9, dtype=torch.float64))
    assert Moments.empty(2, torch.device("cpu")).mean.dtype == torch.float32
    part = Moments(4, 2, 6, torch.ones(3, dtype=torch.float64), torch.full((3,), 2.0, dtype=torch.float64))
    for merged in (empty.merge(part), part.merge(empty)):
        assert (merged.rows, merged.samples, merged.out_positions) == (4, 2, 6)
        assert torch.equal(merged.mean, part.mean) and torch.equal(merged.var, part.var)
    back = Moments.unpack(part.pack(), 3, torch.float64)
    assert (back.rows, back.samples, back.out_positions) == (4, 2, 6)
    assert torch.equal(back.mean, part.mean) and torch.equal(back.var, part.var)


def test_an_empty_batch_gives_empty_moments_of_the_layers_width_and_dtype() -> None:
    conv, linear = nn.Conv2d(3, 2, 3), nn.Linear(4, 2)
    for layer, h, features in ((conv, torch.zeros(0, 3, 5, 5), 3), (linear, torch.zeros(0, 4), 4)):
        for dtype, expected in ((torch.float64, torch.float64), (torch.float16, torch.float32)):
            m = moments_of_input(layer, h.to(dtype), torch.zeros(0, 2))
            assert m.rows == 0 and m.mean.shape == m.var.shape == (features,)
            assert m.mean.dtype == m.var.dtype == expected


def test_statistics_stay_on_the_device_of_their_input() -> None:
    """Every tensor the statistics make lives where the layer input or the accumulators live. Checked on the
    ``meta`` device, so that a tensor made on the default device shows on a CPU-only machine (issue 27: the
    `device=` arguments were `make mutate` survivors)."""
    meta = torch.device("meta")
    conv, linear = nn.Conv2d(2, 3, 3, padding=1), nn.Linear(4, 2)
    cases = [
        (moments_of_input, conv, torch.empty(2, 2, 5, 5, device=meta), torch.empty(2, 3, 5, 5, device=meta)),
        (moments_of_input, conv, torch.empty(0, 2, 5, 5, device=meta), torch.empty(0, 3, 5, 5, device=meta)),
        (moments_of_input, linear, torch.empty(0, 4, device=meta), torch.empty(0, 2, device=meta)),
        (column_moments_of_input, conv, torch.empty(2, 2, 5, 5, device=meta), torch.empty(2, 3, 5, 5, device=meta)),
        (column_moments_of_input, conv, torch.empty(0, 2, 5, 5, device=meta), torch.empty(0, 3, 5, 5, device=meta)),
    ]
    for moments, layer, h, out in cases:
        m = moments(layer.to(meta), h, out)
        assert m.mean.device == m.var.device == meta, (moments.__name__, tuple(h.shape))
        assert m.pack().device == meta
    made = RunningStatistics(3, rho=0.9, bias_correction=False, device=meta, dtype=torch.float64)
    for acc in (made.mean_acc, made.var_acc):
        assert acc.device == meta and acc.dtype == torch.float64
    running = RunningStatistics(3, rho=0.9, bias_correction=False, device=torch.device("cpu"))
    running.to(meta, torch.float32)
    assert running.mean_acc.device == running.var_acc.device == meta
    saved = RunningStatistics(3, rho=0.9, bias_correction=False, device=torch.device("cpu")).state_dict()
    running.load_state_dict(saved)
    assert running.mean_acc.device == running.var_acc.device == meta


@pytest.mark.parametrize("bias_correction", [False, True])
def test_data_view_is_the_bias_corrected_average_whichever_view_p_uses(bias_correction: bool) -> None:
    rho = 0.9
    stats = RunningStatistics(2, rho=rho, bias_correction=bias_correction, device=torch.device("cpu"))
    torch.testing.assert_close(stats.data_view()[1], torch.ones(2))  # before any update: the paper's σ² = 1
    batches = [
        (torch.tensor([1.0, -2.0]), torch.tensor([0.5, 4.0])),
        (torch.tensor([3.0, 0.0]), torch.tensor([2.5, 1.0])),
    ]
    for mu_h, var_h in batches:
        _update(stats, mu_h, var_h)
    # Σ (1 − ρ) ρ^(t−k) x_k / (1 − ρ^t): the weights 0.09 and 0.1 of the two batches, normalised
    weights = torch.tensor([rho * (1 - rho), 1 - rho]) / (1 - rho**2)
    mu, var = stats.data_view()
    torch.testing.assert_close(mu, weights[0] * batches[0][0] + weights[1] * batches[1][0])
    torch.testing.assert_close(var, weights[0] * batches[0][1] + weights[1] * batches[1][1])


def test_running_paper_view_is_the_recurrence_from_mu0_var1() -> None:
    rho = 0.9
    stats = RunningStatistics(2, rho=rho, bias_correction=False, device=torch.device("cpu"))
    mu, var = torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64)
    torch.testing.assert_close(stats.mu, mu.float())
    torch.testing.assert_close(stats.var, var.float())
    for step in range(5):
        mu_h, var_h = torch.tensor([step, -2.0 * step]), torch.tensor([0.5 + step, 3.0])
        _update(stats, mu_h, var_h)
        mu = rho * mu + (1 - rho) * mu_h.double()  # Alg. 2 step 2
        var = rho * var + (1 - rho) * var_h.double()
        torch.testing.assert_close(stats.mu.double(), mu, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(stats.var.double(), var, rtol=1e-6, atol=1e-6)


def test_running_bias_corrected_view_divides_by_one_minus_rho_t() -> None:
    rho = 0.99
    stats = RunningStatistics(1, rho=rho, bias_correction=True, device=torch.device("cpu"))
    _update(stats, torch.tensor([2.0]), torch.tensor([5.0]))
    # one step: the bias-corrected averages are exactly the batch statistics
    torch.testing.assert_close(stats.mu, torch.tensor([2.0]))
    torch.testing.assert_close(stats.var, torch.tensor([5.0]))
    _update(stats, torch.tensor([4.0]), torch.tensor([1.0]))
    w = (1 - rho) / (1 - rho**2)  # weight of the newest batch after two steps
    torch.testing.assert_close(stats.mu, torch.tensor([w * 4.0 + (1 - w) * 2.0]))
    torch.testing.assert_close(stats.var, torch.tensor([w * 1.0 + (1 - w) * 5.0]))


def test_running_state_dict_round_trip_and_shape_check() -> None:
    a = RunningStatistics(3, rho=0.99, bias_correction=True, device=torch.device("cpu"))
    _update(a, torch.ones(3), torch.full((3,), 2.0))
    b = RunningStatistics(3, rho=0.99, bias_correction=True, device=torch.device("cpu"))
    b.load_state_dict(a.state_dict())
    assert b.steps == 1
    torch.testing.assert_close(b.mu, a.mu)
    c = RunningStatistics(4, rho=0.99, bias_correction=True, device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"shape \(3,\) do not fit a layer with 4 input features"):
        c.load_state_dict(a.state_dict())


def test_a_state_resumed_under_another_rho_keeps_the_saved_product_at_the_resume_and_after() -> None:
    """Paper view σ² = v_t + Πρ: three updates under ρ = 0.9 resumed under ρ = 0.5 give, at the resume (t = 3),
    v + 0.9³ (the ρ's the saved steps applied), and after two more steps' worth of t, v + 0.9³·0.5². A step count set
    back by hand below the resume (t = 2) cannot know which ρ's made it: v + 0.5² (ρ^t of the current ρ)."""
    cpu = torch.device("cpu")
    saved = RunningStatistics(2, rho=0.9, bias_correction=False, device=cpu, dtype=torch.float64)
    for x in (1.0, 2.0, 4.0):
        _update(saved, torch.full((2,), x, dtype=torch.float64), torch.full((2,), x * x, dtype=torch.float64))
    resumed = RunningStatistics(2, rho=0.5, bias_correction=False, device=cpu, dtype=torch.float64)
    resumed.load_state_dict(saved.state_dict(), saved_rho=0.9)
    v = saved.var_acc
    assert resumed.steps == 3
    torch.testing.assert_close(resumed.var, v + 0.9**3, rtol=1e-14, atol=0.0)
    resumed.steps = 5
    torch.testing.assert_close(resumed.var, v + 0.9**3 * 0.5**2, rtol=1e-14, atol=0.0)
    resumed.steps = 2
    torch.testing.assert_close(resumed.var, v + 0.5**2, rtol=1e-14, atol=0.0)


def test_decay_offset_is_carried_by_the_state_and_converted_when_the_settings_differ() -> None:
    """``decay`` = ρ^t + κ (the paper view's ε2 folded in, κ = ε2/(1 + ε1)): a state saved with one κ loads into
    another as ρ^t + the new κ, a state saved before κ existed (plain ρ^t) as ρ^t + κ, the same κ bit for bit."""
    cpu, rho = torch.device("cpu"), 0.9
    pre = BNPPreconditioner(nn.Linear(3, 2), rho=rho, eps1=0.5, eps2=0.3)
    running = pre.layers[""].running
    assert running.decay_offset == pytest.approx(0.3 / 1.5)
    torch.testing.assert_close(running.decay, torch.tensor([1.0 + 0.2]))
    pre.detach()
    a = RunningStatistics(2, rho=rho, bias_correction=False, device=cpu, decay_offset=0.2)
    for _ in range(3):
        _update(a, torch.ones(2), torch.ones(2))
    torch.testing.assert_close(a.decay, torch.tensor([rho**3 + 0.2]))
    saved = a.state_dict()
    assert saved["decay_offset"] == 0.2
    same = RunningStatistics(2, rho=rho, bias_correction=False, device=cpu, decay_offset=0.2)
    same.load_state_dict(saved)
    assert torch.equal(same.decay, a.decay)
    other = RunningStatistics(2, rho=rho, bias_correction=True, device=cpu)  # κ = 0 with bias correction
    other.load_state_dict(saved)
    torch.testing.assert_close(other.decay, torch.tensor([rho**3]))
    torch.testing.assert_close(other.device_mu(), torch.ones(2))  # m / (1 − ρ^t) for a constant μ_H = 1
    old = {k: v for k, v in saved.items() if k != "decay_offset"}
    old["decay"] = torch.tensor([rho**3])  # saved before κ existed: plain ρ^t
    same.load_state_dict(old)
    torch.testing.assert_close(same.decay, torch.tensor([rho**3 + 0.2]))


def test_a_float64_layers_decay_starts_at_one_plus_kappa_in_float64() -> None:
    """A float64 model's ``decay`` = ρ^t + κ is float64 from the start: κ = ε2/(1 + ε1) = 0.2 is not a float32
    number, and ρ^t + κ made in float32 (1.2000000477) would carry its round-off into every later step's view."""
    rho, kappa = 0.9, 0.3 / 1.5
    pre = BNPPreconditioner(nn.Linear(3, 2).double(), rho=rho, eps1=0.5, eps2=0.3)
    running = pre.layers[""].running
    assert running.decay.dtype == torch.float64 and running.decay.item() == 1.0 + kappa
    pre.layers[""].module(torch.randn(4, 3, dtype=torch.float64)).sum().backward()
    pre.step()
    assert abs(running.decay.item() - (rho * (1.0 + kappa) + (1.0 - rho) * kappa)) < 1e-15
    pre.detach()


def test_a_host_part_merges_with_a_pooled_part_in_float64_counts_either_way() -> None:
    """A part with host counts (this rank's ``moments_of_input``) merged with one whose counts are device tensors
    (unpacked after a collective, or a token mask's count) gives the pooled moments with float64 counts, in
    either order; 2²⁴ + 1 rows (a large conv batch) stay exact, as float32 counts would not (issue 27: the
    mixed merge was not pinned)."""
    n_big = 2**24 + 1
    mean_a, var_a = torch.tensor([1.0, -2.0]), torch.tensor([4.0, 0.5])
    mean_b, var_b = torch.tensor([3.0, 2.0]), torch.tensor([1.0, 2.0])
    host = Moments(n_big, 5, 7, mean_a, var_a)
    device = Moments.unpack(Moments(3, 1, 4, mean_b, var_b).pack(), 2, torch.float32)
    assert isinstance(device.rows, torch.Tensor)
    with HostReads() as reads:  # the counts stay on the device: no read to branch on them
        both = (host.merge(device), device.merge(host))
    assert reads.reads == {}
    for merged in both:
        for count, expected in ((merged.rows, n_big + 3), (merged.samples, 6), (merged.out_positions, 11)):
            assert isinstance(count, torch.Tensor) and count.dtype == torch.float64
            assert float(count) == expected
    # small counts, where the pooled values are far from either part's: μ = (2·μa + 3·μb)/5,
    # σ² = (2·σa² + 3·σb²)/5 + δ²·2·3/5²
    small = Moments(2, 2, 2, mean_a, var_a)
    expected_mean = (2 * mean_a + 3 * mean_b) / 5
    expected_var = (2 * var_a + 3 * var_b) / 5 + (mean_b - mean_a).square() * 6 / 25
    for merged in (small.merge(device), device.merge(small)):
        assert float(merged.rows) == 5 and float(merged.samples) == 3 and float(merged.out_positions) == 6
        torch.testing.assert_close(merged.mean, expected_mean)
        torch.testing.assert_close(merged.var, expected_var)


def test_a_pooled_empty_part_merged_with_one_row_gives_that_row() -> None:
    """n = 1: the merged mean is the single row's, its variance 0 (an empty part pooled from a rank that saw no
    rows, merged on the device)."""
    empty = Moments.unpack(Moments.empty(2, torch.device("cpu")).pack(), 2, torch.float32)
    one = Moments(1, 1, 1, torch.tensor([5.0, -3.0]), torch.zeros(2))
    for merged in (empty.merge(one), one.merge(empty)):
        assert float(merged.rows) == 1
        torch.testing.assert_close(merged.mean, torch.tensor([5.0, -3.0]))
        torch.testing.assert_close(merged.var, torch.zeros(2))


def test_pack_of_partly_device_counts_is_float64_on_the_device() -> None:
    """``pack`` with some counts on the device and some on the host: one float64 vector, exact counts, on the
    statistics' device (checked on ``meta``: a count made on the default device shows there)."""
    m = Moments(torch.tensor(4.0, dtype=torch.float64), 2**24 + 1, 6, torch.ones(2), torch.full((2,), 2.0))
    flat = m.pack()
    assert flat.dtype == torch.float64
    assert flat.tolist() == [4.0, 2**24 + 1, 6.0, 1.0, 1.0, 2.0, 2.0]
    meta = torch.device("meta")
    on_meta = Moments(
        torch.empty((), dtype=torch.float64, device=meta),
        2,
        6,
        torch.empty(2, device=meta),
        torch.empty(2, device=meta),
    )
    assert on_meta.pack().device == meta


def test_feature_moments_pool_every_leading_dimension() -> None:
    """``feature_moments`` (a linear layer's input whatever its module): per last-dimension feature over all
    leading dimensions, each row one sample; half inputs give float32 statistics; one row gives its values and
    σ² = 0; an empty batch gives zeros of the width and the statistics dtype, where the input is."""
    h = torch.randn(2, 3, 5) * 2 + 1
    m = feature_moments(h)
    flat = h.reshape(-1, 5).double()
    assert (m.rows, m.samples, m.out_positions) == (6, 6, 6)
    torch.testing.assert_close(m.mean.double(), flat.mean(0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m.var.double(), flat.var(0, correction=0), rtol=1e-5, atol=1e-6)
    half = feature_moments(h.to(torch.bfloat16))
    assert half.mean.dtype == half.var.dtype == torch.float32
    ref = h.to(torch.bfloat16).reshape(-1, 5).double()
    torch.testing.assert_close(half.mean.double(), ref.mean(0), rtol=1e-5, atol=1e-6)
    one = feature_moments(torch.tensor([[3.0]]))
    assert one.rows == 1
    torch.testing.assert_close(one.mean, torch.tensor([3.0]))
    torch.testing.assert_close(one.var, torch.tensor([0.0]))
    for dtype, expected in ((torch.float16, torch.float32), (torch.float64, torch.float64)):
        empty = feature_moments(torch.zeros(0, 3, 5, dtype=dtype))
        assert empty.rows == 0 and empty.mean.shape == empty.var.shape == (5,)
        assert empty.mean.dtype == empty.var.dtype == expected
        assert not empty.mean.any() and not empty.var.any()
    meta = torch.device("meta")
    assert feature_moments(torch.empty(0, 3, 5, device=meta)).mean.device == meta


def test_masked_feature_moments_are_those_of_the_real_rows() -> None:
    """Token masks: μ, σ² over the rows the mask keeps, N their number as a float64 0-dim tensor; half inputs
    give float32; one real row gives its values and σ² = 0; a mask on the host applies to an input elsewhere
    (``meta`` here)."""
    h = torch.randn(2, 4, 3) * 3 - 1
    real = torch.tensor([[True, False, True, True], [False, True, True, False]])
    for x in (h, h.to(torch.bfloat16)):
        m = masked_feature_moments(x, real)
        kept = x[real].double()
        assert isinstance(m.rows, torch.Tensor) and m.rows.dtype == torch.float64 and float(m.rows) == 5
        assert m.mean.dtype == m.var.dtype == torch.float32
        torch.testing.assert_close(m.mean.double(), kept.mean(0), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(m.var.double(), kept.var(0, correction=0), rtol=1e-5, atol=1e-5)
    only = torch.zeros(2, 4, dtype=torch.bool)
    only[1, 2] = True
    one = masked_feature_moments(h, only)
    assert float(one.rows) == 1
    torch.testing.assert_close(one.mean, h[1, 2])
    torch.testing.assert_close(one.var, torch.zeros(3))
    meta = torch.device("meta")
    assert masked_feature_moments(torch.empty(2, 4, 3, device=meta), real).mean.device == meta


def test_token_moments_dtype_device_and_counts() -> None:
    """Token frequencies in the requested dtype (exact float64 ones: c/N rounded once), N a float64 device
    tensor where padding or a mask makes it data-dependent, one real token a frequency of 1, no token at all
    zeros of the vocabulary's width; every tensor on the tokens' device (``meta``; a host mask too)."""
    tokens = torch.tensor([0, 3, 3, 5, 3, 1])
    m = token_moments(tokens, 7, None, torch.float64)
    assert m.rows == 6 and m.mean.dtype == torch.float64
    assert torch.equal(m.mean, torch.tensor([1, 1, 0, 3, 0, 1, 0], dtype=torch.float64) / 6)
    padded = token_moments(tokens, 7, 3, torch.float64)
    assert isinstance(padded.rows, torch.Tensor) and padded.rows.dtype == torch.float64 and float(padded.rows) == 3
    assert torch.equal(padded.mean, torch.tensor([1, 1, 0, 0, 0, 1, 0], dtype=torch.float64) / 3)
    single = token_moments(torch.tensor([3, 3, 5]), 7, 3, torch.float32)
    assert float(single.rows) == 1
    assert torch.equal(single.mean, torch.tensor([0, 0, 0, 0, 0, 1.0, 0]))
    assert torch.equal(single.var, torch.zeros(7))
    empty = token_moments(torch.zeros(0, dtype=torch.int64), 7, None, torch.float64)
    assert empty.rows == 0 and empty.mean.shape == empty.var.shape == (7,)
    assert empty.mean.dtype == empty.var.dtype == torch.float64 and not empty.mean.any()
    meta = torch.device("meta")
    on_meta = torch.empty(2, 3, dtype=torch.int64, device=meta)
    host_mask = torch.ones(2, 3, dtype=torch.bool)
    for part in (
        token_moments(on_meta, 7, None, torch.float32),
        token_moments(on_meta, 7, None, torch.float32, host_mask),
        token_moments(torch.empty(0, dtype=torch.int64, device=meta), 7, None, torch.float32),
    ):
        assert part.mean.device == part.var.device == meta


def test_device_mu_divides_by_one_minus_rho_t_whatever_the_decay_offset() -> None:
    """``decay`` holds ρ^t + κ: the bias-corrected μ on the device is m_t / (1 − ρ^t) for any κ (κ = 0.2 here)."""
    rho = 0.9
    stats = RunningStatistics(2, rho=rho, bias_correction=True, device=torch.device("cpu"), decay_offset=0.2)
    assert torch.equal(stats.device_mu(), torch.zeros(2))
    m = torch.zeros(2, dtype=torch.float64)
    for t, mu_h in enumerate((torch.tensor([2.0, -1.0]), torch.tensor([4.0, 3.0])), start=1):
        m_new, v_new = ema_update(stats.mean_acc, mu_h, rho), ema_update(stats.var_acc, torch.ones(2), rho)
        decay = stats.decay * rho + (1 - rho) * 0.2
        stats.assign(m_new, v_new, torch.tensor([t]), decay)
        m = rho * m + (1 - rho) * mu_h.double()
        torch.testing.assert_close(stats.device_mu().double(), m / (1 - rho**t), rtol=1e-6, atol=1e-6)


def test_a_state_loads_in_the_dtype_and_on_the_device_of_the_statistics() -> None:
    """``load_state_dict`` casts a float32 state to float64 statistics (and back) and puts ρ^t + κ where the
    accumulators are (``meta`` here)."""
    saved = RunningStatistics(3, rho=0.9, bias_correction=False, device=torch.device("cpu"))
    _update(saved, torch.tensor([1.0, 2.0, 3.0]), torch.ones(3))
    wide = RunningStatistics(3, rho=0.9, bias_correction=False, device=torch.device("cpu"), dtype=torch.float64)
    wide.load_state_dict(saved.state_dict())
    for tensor in (wide.mean_acc, wide.var_acc, wide.decay):
        assert tensor.dtype == torch.float64
    torch.testing.assert_close(wide.mean_acc, torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64))
    meta = torch.device("meta")
    on_meta = RunningStatistics(3, rho=0.9, bias_correction=False, device=meta)
    on_meta.load_state_dict(saved.state_dict())
    assert on_meta.decay.device == on_meta.mean_acc.device == meta


def test_counts_on_the_device_are_named_for_pooled_and_masked_parts_and_never_empty() -> None:
    """A part unpacked from a collective (pooled over ranks) and one of a token mask's real rows keep their counts
    on the device (``counted_on_device``) and are never called empty, even with no row; a part with host counts is
    empty exactly when it holds no row."""
    from lightning_bnp.core.moments import masked_feature_moments

    host = Moments(3, 3, 3, torch.zeros(2), torch.ones(2))
    pooled = Moments.unpack(host.pack(), 2, torch.float32)
    masked = masked_feature_moments(torch.randn(2, 4, 2), torch.zeros(2, 4, dtype=torch.bool))
    assert [m.counted_on_device for m in (host, pooled, masked)] == [False, True, True]
    assert [m.is_empty() for m in (host, pooled, masked, Moments.empty(2, torch.device("cpu")))] == [
        False, False, False, True,
    ]  # fmt: skip


@pytest.mark.parametrize("attribute", ["mean_acc", "var_acc", "decay", "_steps"])
def test_one_running_buffer_assigned_by_hand_between_steps_is_the_one_the_next_step_reads(attribute: str) -> None:
    """The step starts from its own flat buffers only while every layer still holds its views of them: one buffer
    of each layer assigned anew (``running.var_acc = …``) is read by the next step, as in a twin whose four buffers
    were all assigned anew (which the step always gathers)."""
    g = torch.Generator().manual_seed(0)
    x1, x2 = (torch.randn(6, 3, generator=g, dtype=torch.float64) for _ in range(2))
    runs = []
    for one_buffer in (True, False):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
        pre = BNPPreconditioner(net, rho=0.9, bias_correction=True)
        net(x1).sum().backward()
        pre.step()
        net.zero_grad()
        for layer in pre.layers.values():
            running = layer.running
            if not one_buffer:  # the twin: all four anew (no view of the step's buffers left)
                for name in ("mean_acc", "var_acc", "decay", "_steps"):
                    value = getattr(running, name)
                    setattr(running, name, value.clone() if isinstance(value, torch.Tensor) else value)
            new = {
                "mean_acc": torch.full_like(running.mean_acc, 0.5),
                "var_acc": torch.full_like(running.var_acc, 7.0),
                "decay": torch.tensor([0.25], dtype=torch.float64),
                "_steps": torch.tensor([5]),
            }[attribute]
            setattr(running, attribute, new)
        net(x2).sum().backward()
        pre.step()
        runs.append(
            [t for layer in pre.layers.values() for t in (layer.running.mean_acc, layer.running.var_acc,
             layer.running.decay, torch.tensor(layer.running.steps))] + [p.grad for p in net.parameters()]
        )  # fmt: skip
    assert runs[0][3] == 6 if attribute == "_steps" else runs[0][3] == 2
    for a, b in zip(*runs):
        assert torch.equal(a, b)
