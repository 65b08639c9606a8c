"""BNP's statistics and running state in Triton (paper 000, Alg. 2/3 steps 1–3; DESIGN §6b).

:func:`feature_moments` is the mean and biased variance of a layer input per feature (Linear: the last dimension;
ConvNd: the channel, over batch and positions, eqs. 21–22), one launch, any strides (``channels_last`` included),
float32 / float16 / bfloat16 inputs reduced in float32. Two passes over the input in one program per block of
features: the mean of x − p, p the feature's first value (a pivot near the data, so that the sum does not carry
|μ|), then the centred Σ(x − μ)² with the rounding error of μ taken out (Σ(x − μ))²/n: accurate when |μ| ≫ σ,
where a one-pass Σx, Σx² loses every digit.

:func:`state_update` is Alg. 2/3 steps 2–3 for every layer of a step with counts known on the host, one program
per layer: the N = 1 rule, the uncentred second moment of layers without bias, each layer's max σ²_H (NaN when a
value is not finite) and its saturation, the running update of ``[m ; v ; d]`` (kept where the moments are not
finite), μ, σ̃² and q²σ̃² in either view of the running statistics, or from the batch alone — what
:func:`~lightning_bnp.core.step_math.step_math` computes with some twenty ATen calls. Sums of a product and a term
are rounded once (float64 inside), as ATen's fused CPU kernels round them.

Both are ``torch.library.triton_op`` custom ops: ``torch.compile`` traces the kernel as it is and a CUDA graph
captures it (no host read). Under ``TRITON_INTERPRET=1`` (set before this module is imported) they run on CPU
tensors, which is how the tests compare them with the pure-torch step.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

__all__ = ["feature_moments", "state_update"]

FEATURES = 32  # features per program
ROWS = 64  # rows per inner iteration


@triton.jit
def _moments_kernel(x_ptr, mean_ptr, var_ptr, samples, positions, features, s_n, s_c, s_p,  # type: ignore[no-untyped-def]
                    FEATURES: tl.constexpr, ROWS: tl.constexpr):  # fmt: skip
    f = tl.program_id(0) * FEATURES + tl.arange(0, FEATURES)
    f_ok = f < features
    rows = samples * positions
    pivot = tl.load(x_ptr + f * s_c, mask=f_ok, other=0.0).to(tl.float32)  # row 0 of each feature
    total = tl.zeros((FEATURES,), dtype=tl.float32)
    for r0 in range(0, rows, ROWS):
        r = r0 + tl.arange(0, ROWS)
        addr = (r // positions) * s_n + (r % positions) * s_p
        mask = (r < rows)[:, None] & f_ok[None, :]
        x = tl.load(x_ptr + addr[:, None] + f[None, :] * s_c, mask=mask, other=0.0).to(tl.float32)
        total += tl.sum(tl.where(mask, x - pivot[None, :], 0.0), axis=0)
    mean = pivot + total / rows
    centred = tl.zeros((FEATURES,), dtype=tl.float32)
    squares = tl.zeros((FEATURES,), dtype=tl.float32)
    for r0 in range(0, rows, ROWS):
        r = r0 + tl.arange(0, ROWS)
        addr = (r // positions) * s_n + (r % positions) * s_p
        mask = (r < rows)[:, None] & f_ok[None, :]
        x = tl.load(x_ptr + addr[:, None] + f[None, :] * s_c, mask=mask, other=0.0).to(tl.float32)
        d = tl.where(mask, x - mean[None, :], 0.0)
        centred += tl.sum(d, axis=0)
        squares += tl.sum(d * d, axis=0)
    tl.store(mean_ptr + f, mean, mask=f_ok)
    tl.store(var_ptr + f, tl.maximum(squares - centred * centred / rows, 0.0) / rows, mask=f_ok)


def _as_rows_features_positions(x: Tensor, channel_dim: int) -> tuple[Tensor, int, int, int, int, int, int]:
    """``x`` as (samples, features, positions) with one stride each: a view where its strides allow (contiguous
    and ``channels_last`` inputs), else a contiguous copy."""
    if channel_dim == -1 or channel_dim == x.dim() - 1:  # Linear: every leading index a row
        lead = x.shape[:-1]
        if x.dim() != 2:
            x = x.reshape(-1, x.shape[-1])  # a view where the leading dimensions allow it
        return x, (math.prod(lead) if lead else 1), x.shape[-1], 1, x.stride(0), x.stride(1), 0
    spatial, strides = x.shape[2:], x.stride()[2:]
    flat = all(strides[i] == strides[i + 1] * spatial[i + 1] or spatial[i] == 1 for i in range(len(spatial) - 1))
    if not flat:
        x = x.contiguous()
        strides = x.stride()[2:]
    positions = math.prod(spatial)
    return x, x.shape[0], x.shape[1], positions, x.stride(0), x.stride(1), (strides[-1] if spatial else 0)


@triton_op("lightning_bnp::feature_moments", mutates_args=())
def feature_moments(x: Tensor, channel_dim: int) -> tuple[Tensor, Tensor]:
    """Per-feature mean and biased variance (float32) of ``x``: over every leading dimension for
    ``channel_dim`` = −1 (a Linear layer's input), over the batch and every position for ``channel_dim`` = 1 (a
    ConvNd's (N, C, *spatial) input). ``x`` holds at least one row."""
    view, samples, features, positions, s_n, s_c, s_p = _as_rows_features_positions(x, channel_dim)
    mean = torch.empty(features, dtype=torch.float32, device=x.device)
    var = torch.empty(features, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(features, FEATURES),)
    wrap_triton(_moments_kernel)[grid](
        view, mean, var, samples, positions, features, s_n, s_c, s_p, FEATURES=FEATURES, ROWS=ROWS
    )
    return mean, var


@triton.jit
def _fma(a, b, c):  # type: ignore[no-untyped-def]  # (Triton reads a kernel's annotations)
    """a·b + c rounded once to float32 (float64 inside), as ATen's fused CPU kernels round it."""
    return (tl.cast(a, tl.float64) * tl.cast(b, tl.float64) + tl.cast(c, tl.float64)).to(tl.float32)


@triton.jit
def _lerp(start, end, weight):  # type: ignore[no-untyped-def]
    """torch.lerp(start, end, weight) as ATen computes it (the branch on weight, the product and sum rounded once)."""
    if weight < 0.5:
        out = _fma(weight, end - start, start)
    else:
        out = _fma(-(end - start), 1.0 - weight, end)
    return out


@triton.jit
def _state_kernel(layers_ptr, batch_ptr, before_ptr, q2_ptr, mu_ptr, var_t_ptr, scale_ptr, after_ptr, finite_ptr,  # type: ignore[no-untyped-def]
                  peak_ptr, total, n_layers, weight, eps1, eps2, floor_alpha, ceiling, RUNNING: tl.constexpr,
                  BIAS_CORRECTION: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    layer = tl.program_id(0)
    start = tl.load(layers_ptr + 4 * layer)
    size = tl.load(layers_ptr + 4 * layer + 1)
    one_row = tl.load(layers_ptr + 4 * layer + 2)
    uncentred = tl.load(layers_ptr + 4 * layer + 3)
    d_before = tl.full((), 0.0, tl.float32)
    d_batch = tl.full((), 0.0, tl.float32)
    if RUNNING:
        d_before = tl.load(before_ptr + 2 * total + layer)
        d_batch = tl.load(batch_ptr + 2 * total + layer)
    # pass 1: each layer's max σ²_H of the batch values as the step uses them (NaN if one is NaN)
    peak = tl.full((), float("-inf"), tl.float32)
    nan = tl.full((), 0, tl.int32)
    for k0 in range(0, size, BLOCK):
        k = start + k0 + tl.arange(0, BLOCK)
        ok = k < start + size
        mu_h, var_h = _batch_values(batch_ptr, before_ptr, k, ok, total, d_before, one_row, uncentred,
                                    RUNNING, BIAS_CORRECTION)  # fmt: skip
        nan = tl.maximum(nan, tl.max(tl.where(ok & (var_h != var_h), 1, 0), axis=0))
        peak = tl.maximum(peak, tl.max(tl.where(ok, var_h, float("-inf")), axis=0))
    peak = tl.where(nan != 0, float("nan"), peak)
    finite = peak == peak
    d_after = d_before
    if RUNNING:
        d_after = tl.where(finite, _lerp(d_before, d_batch, weight), d_before)
        if BIAS_CORRECTION:
            d_scale = 1.0 / (1.0 - d_after)
    tl.store(peak_ptr + layer, peak)
    tl.store(finite_ptr + layer, finite)
    # pass 2: the state after the step and the maxima σ̃² is floored with
    top = tl.full((), float("-inf"), tl.float32)
    for k0 in range(0, size, BLOCK):
        k = start + k0 + tl.arange(0, BLOCK)
        ok = k < start + size
        mu_h, var_h = _batch_values(batch_ptr, before_ptr, k, ok, total, d_before, one_row, uncentred,
                                    RUNNING, BIAS_CORRECTION)  # fmt: skip
        var_h = tl.where(var_h > ceiling, ceiling, var_h)  # an overflowed σ²_H saturates (NaN stays NaN)
        if RUNNING:
            m_before = tl.load(before_ptr + k, mask=ok, other=0.0)
            v_before = tl.load(before_ptr + total + k, mask=ok, other=0.0)
            m = tl.where(finite, _lerp(m_before, mu_h, weight), m_before)
            v = tl.where(finite, _lerp(v_before, var_h, weight), v_before)
            tl.store(after_ptr + k, m, mask=ok)
            tl.store(after_ptr + total + k, v, mask=ok)
            if BIAS_CORRECTION:
                v = v * d_scale
        else:
            v = var_h
        top = tl.maximum(top, tl.max(tl.where(ok, v, float("-inf")), axis=0))
        top = tl.where(tl.max(tl.where(ok & (v != v), 1, 0), axis=0) != 0, float("nan"), top)
    if RUNNING:
        tl.store(after_ptr + 2 * total + layer, d_after)
    # pass 3: μ, σ̃² = σ² + ε1·max σ² + ε2 (the paper's view: v + ε1·(max v + d·(1 + ε1)/ε1)) and q²σ̃²
    floor = _fma(d_after, floor_alpha, top)
    for k0 in range(0, size, BLOCK):
        k = start + k0 + tl.arange(0, BLOCK)
        ok = k < start + size
        if RUNNING:
            m = tl.load(after_ptr + k, mask=ok, other=0.0)
            v = tl.load(after_ptr + total + k, mask=ok, other=0.0)
            if BIAS_CORRECTION:
                mu = m * d_scale
                var_t = _fma(eps1, top, v * d_scale) + eps2
            else:
                mu = m
                var_t = _fma(eps1, floor, v)
        else:
            mu, v = _batch_values(batch_ptr, before_ptr, k, ok, total, d_before, one_row, uncentred,
                                  RUNNING, BIAS_CORRECTION)  # fmt: skip
            v = tl.where(v > ceiling, ceiling, v)
            var_t = _fma(eps1, top, v) + eps2
        tl.store(mu_ptr + k, mu, mask=ok)
        tl.store(var_t_ptr + k, var_t, mask=ok)
        tl.store(scale_ptr + k, var_t * tl.load(q2_ptr + k, mask=ok, other=1.0), mask=ok)


@triton.jit
def _batch_values(batch_ptr, before_ptr, k, ok, total, d_before, one_row, uncentred,  # type: ignore[no-untyped-def]
                  RUNNING: tl.constexpr, BIAS_CORRECTION: tl.constexpr):  # fmt: skip
    """μ_H and σ²_H of entries ``k`` as the step uses them: the N = 1 rule (σ²_H = (h − μ)², μ the running one
    before the update), and without bias μ_H = 0 and the uncentred second moment σ²_H + μ_H²."""
    mu_h = tl.load(batch_ptr + k, mask=ok, other=0.0)
    var_h = tl.load(batch_ptr + total + k, mask=ok, other=0.0)
    if RUNNING and one_row != 0:
        m = tl.load(before_ptr + k, mask=ok, other=0.0)
        if BIAS_CORRECTION:
            m = m / tl.maximum(1.0 - d_before, 1.1754943508222875e-38)
        var_h = (mu_h - m) * (mu_h - m)
    if uncentred != 0:
        var_h = _fma(mu_h, mu_h, var_h)
        mu_h = mu_h - mu_h
    return mu_h, var_h


@triton_op("lightning_bnp::state_update", mutates_args=())
def state_update(layers: Tensor, batch: Tensor, before: Tensor, q2_flat: Tensor, running: bool, bias_correction: bool,
                 rho: float, eps1: float, eps2: float, ceiling: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                             Tensor]:  # fmt: skip
    """Alg. 2/3 steps 2–3 for every layer in one launch.

    Args:
        layers: (start, features, N = 1 rule, no bias) per layer, int64, on the device.
        batch: ``[μ_H ; σ²_H ; κ]`` of every layer (κ, the batch value of d, only with ``running``).
        before: the running state ``[m ; v ; d]`` before the step (``running``; else not read: any float32 tensor).
        q2_flat: q² on every entry of its layer.
        running, bias_correction, rho, eps1, eps2: the step's settings; ``ceiling``: where σ²_H saturates.

    Returns:
        (μ, σ̃², q²σ̃², the state after the step, per layer whether its moments were finite, per-layer max σ²_H
        before saturation); the state after is empty without ``running``.
    """
    n_layers, total = layers.shape[0], q2_flat.shape[0]
    like = q2_flat
    mu, var_t, scale = torch.empty_like(like), torch.empty_like(like), torch.empty_like(like)
    after = torch.empty(2 * total + n_layers if running else 0, dtype=like.dtype, device=like.device)
    finite = torch.empty(n_layers, dtype=torch.bool, device=like.device)
    peak = torch.empty(n_layers, dtype=like.dtype, device=like.device)
    wrap_triton(_state_kernel)[(n_layers,)](
        layers, batch, before, q2_flat, mu, var_t, scale, after, finite, peak, total, n_layers, 1.0 - rho, eps1,
        eps2, (1.0 + eps1) / eps1, ceiling, RUNNING=running, BIAS_CORRECTION=bias_correction, BLOCK=128,
    )  # fmt: skip
    return mu, var_t, scale, after, finite, peak
