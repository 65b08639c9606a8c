"""The BNP gradient transform (paper 000, eq. 15 for dense layers, eq. 23 for convolutions).

For one output neuron i with bias gradient g_b and weight-gradient row g_w (the kernel slice
``G_w[i]`` flattened, input channel j repeated over its kernel positions), BNP replaces

.. math::
    \\begin{bmatrix} g_b \\\\ g_w \\end{bmatrix} \\leftarrow \\frac{1}{q^2} P P^T
    \\begin{bmatrix} g_b \\\\ g_w \\end{bmatrix}, \\qquad
    P = \\begin{bmatrix} 1 & -μ^T \\\\ 0 & I \\end{bmatrix}
        \\begin{bmatrix} 1 & 0 \\\\ 0 & \\operatorname{diag}(1/\\tilde σ) \\end{bmatrix},

which Alg. 2/3 steps 4–5 write without matrices:

.. math::
    G_w[i, j] \\leftarrow \\frac{G_w[i, j] - μ_j G_b[i]}{q^2 \\tilde σ_j^2}, \\qquad
    G_b[i] \\leftarrow \\frac{G_b[i]}{q^2} - \\sum_j μ_j G_w^{new}[i, j].

Layers without bias have no centring direction: P = diag(1/σ̃) and only the first formula with
μ = 0 applies (σ̃² is then built from the uncentred second moment, see ``preconditioner.py``).

A convolution's μ, σ̃² have one entry per input channel j (eq. 23: P uses μ⊗e, σ̃⊗e, the channel's
value repeated over its kernel offsets) or, with ``conv_statistics="column"``, one per im2col column
(input channel, kernel offset): then P is Alg. 2's P of the unfolded input and j above runs over the
columns. Which one a vector is follows from its length (c_in or c_in·kernel volume).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["broadcast_shapes", "precondition_", "precondition_many_", "precondition_scaled_", "q_squared", "var_tilde"]


def var_tilde(var: Tensor, eps1: float, eps2: float, maxima: Tensor | None = None) -> Tensor:
    """σ̃² = σ² + ε1·max(σ²) + ε2 (Alg. 2/3 step 3).

    ``maxima``: when ``var`` holds several layers one after another, each entry's own layer's max(σ²)
    (:meth:`~lightning_bnp.core.layout.FeatureLayout.layer_max`); by default the max of all of ``var``.
    """
    floor = var.max() if maxima is None else maxima
    return torch.add(var, floor, alpha=eps1).add_(eps2)


def q_squared(fan_in: int, samples: int, out_positions_per_sample: float) -> float:
    """q² of Alg. 2/3 step 3.

    Dense (Prop. 5): ``max(n_in / N, 1)``. Convolution (§4): ``max(c_in·k² / N, √(r·s))`` with r·s
    the output positions per sample. One formula covers both because a dense layer has one
    output position per row. ``fan_in`` is what one output neuron sees: ``weight[0].numel()``
    (per-group input channels × kernel volume for grouped convolutions).
    """
    return max(fan_in / samples, math.sqrt(out_positions_per_sample))


@functools.lru_cache(maxsize=512)
def _broadcast_shapes(
    shape: tuple[int, ...], groups: int, features: int
) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None, tuple[int, ...], bool]:
    """How a weight gradient of ``shape`` meets the statistics vectors (``features`` entries: c_in, or
    c_in·kernel volume for per-column statistics) and its bias gradient (out,).

    Returns ``(gradient view, statistics view, bias view, per_column)``, ``None`` where the tensor is used as
    it is. With groups, the gradient is viewed as (groups, out/groups, c_in/groups, *k): output channel o
    belongs to group o // (out/groups) and sees that group's input channels only. Cached per shape: the
    step runs this for every layer every step (issue 16).

    Raises:
        ValueError: ``features`` fits neither per-channel nor per-column statistics of this weight.
    """
    out, cin_g, kernel = shape[0], shape[1], shape[2:]
    kernel_volume = math.prod(kernel)
    per_column = kernel_volume > 1 and features == groups * cin_g * kernel_volume
    if not per_column and features != groups * cin_g:
        raise ValueError(
            f"statistics of {features} entries fit neither the {groups * cin_g} input channels nor the "
            f"{groups * cin_g * kernel_volume} im2col columns of a weight of shape {shape} with groups={groups}"
        )
    ones = (1,) * len(kernel)
    spread = kernel if per_column else ones  # per column: one entry per kernel offset
    if groups == 1:  # Linear: a (c_in,) vector broadcasts against (out, c_in) as it is
        return None, ((cin_g, *spread) if kernel else None), (out, 1, *ones), per_column
    return (
        (groups, out // groups, cin_g, *kernel),
        (groups, 1, cin_g, *spread),
        (groups, out // groups, 1, *ones),
        per_column,
    )


@torch.no_grad()
def precondition_(
    grad_w: Tensor,
    grad_b: Tensor | None,
    mu: Tensor | None,
    var_t: Tensor,
    q2: float | Tensor,
    groups: int = 1,
    share: int = 1,
) -> None:
    """Apply (1/q²)·P·Pᵀ to one layer's gradients, in place (Alg. 2/3 steps 4–5).

    Args:
        grad_w: weight gradient, (out, in) or ``(out, c_in/groups, *kernel)``.
        grad_b: bias gradient (out,), or ``None`` for a layer without bias.
        mu: mean μ per input channel (c_in,) or per im2col column (c_in·kernel volume,), or ``None`` for a
            layer without bias.
        var_t: σ̃², same length as μ.
        q2: the scale q² (a float, or a 0-dim tensor when it comes from counts pooled over ranks).
        groups: convolution groups (1 for Linear).
        share: n where the bias is one of n tensors that hold one bias, each the bias of one column block of the
            layer (a recurrent layer's ``b_ih``, ``b_hh``: :mod:`~lightning_bnp.core.recurrent`): its update is then
            G_b/(n·q²) − Σ_j μ_j·G_w_new[i, j] over this block's columns j, so that the n updates sum to the
            layer's.
    """
    precondition_many_([grad_w], [grad_b], [mu], [var_t], [q2], [groups], [share])


@torch.no_grad()
def precondition_many_(
    grads_w: Sequence[Tensor],
    grads_b: Sequence[Tensor | None],
    mus: Sequence[Tensor | None],
    var_ts: Sequence[Tensor],
    q2s: Sequence[float | Tensor],
    groups: Sequence[int],
    shares: Sequence[int] | None = None,
) -> None:
    """:func:`precondition_` for several layers at once, with ``torch._foreach_*`` kernels.

    A layer is centred (has the μ block of P) when both its ``grads_b`` and ``mus`` entries are given.
    """
    # q² σ̃² in the statistics' dtype (float32 or float64); q² may be a 0-dim tensor (counts pooled over ranks)
    scales: Sequence[Tensor]
    if any(isinstance(q2, Tensor) for q2 in q2s):
        scales = [var_t * q2 for var_t, q2 in zip(var_ts, q2s)]
    else:
        scales = torch._foreach_mul(list(var_ts), list(q2s))  # type: ignore[arg-type]
    precondition_scaled_(grads_w, grads_b, mus, scales, q2s, groups, None, shares)


def broadcast_shapes(grad_w: Tensor, groups: int, features: int) -> tuple[Any, ...]:
    """How a weight gradient meets its statistics vectors of ``features`` entries and its bias gradient: the
    ``(gradient view, statistics view, bias view, per_column)`` that :func:`precondition_scaled_` uses, fixed for a
    layer (a step's plan computes them once: :class:`~lightning_bnp.core.step_math.StepConfig`)."""
    shapes = _broadcast_shapes.__wrapped__ if torch.compiler.is_compiling() else _broadcast_shapes
    return shapes(tuple(grad_w.shape), groups, features)


def precondition_scaled_(
    grads_w: Sequence[Tensor],
    grads_b: Sequence[Tensor | None],
    mus: Sequence[Tensor | None],
    scales: Sequence[Tensor],
    q2s: Sequence[float | Tensor],
    groups: Sequence[int],
    shapes: Sequence[tuple[Any, ...]] | None = None,
    shares: Sequence[int] | None = None,
) -> None:
    """:func:`precondition_many_` given ``scales`` = q²·σ̃² per layer (the step computes them for all layers
    in one flat product). Every elementwise step is one foreach call for all layers, on views that need no
    copy; the bias update is one matrix–vector product per centred layer (issue 16).

    An entry may also be the n equal row blocks of one linear weight, each block a layer with its own
    statistics (``nn.MultiheadAttention``'s q, k, v): the gradient (n·out, in) with ``groups`` = n, μ and
    q²σ̃² the n layers' vectors one after another (n·in,), the bias gradient (n·out,), and q² one float for
    all blocks or a (n, 1) tensor. The grouped views then give each block its own μ and σ̃², and the bias
    update is one batched product for the n blocks (issue 24).

    ``shapes``: each entry's :func:`broadcast_shapes`, when the caller has them (else they are looked up).
    ``shares``: per entry, the n of :func:`precondition_`'s ``share`` (1 for all when ``None``)."""
    with torch.no_grad():
        gw, scale_w, centred, mu_w, gb_w, columns = [], [], [], [], [], []
        for i, (g, k, scale, gb, mu) in enumerate(zip(grads_w, groups, scales, grads_b, mus)):
            g_shape, v_shape, b_shape, per_column = (
                broadcast_shapes(g, k, scale.numel()) if shapes is None else shapes[i]
            )
            columns.append(per_column)
            g = g if g_shape is None else g.view(g_shape)
            # q²σ̃² stays in the statistics' dtype (float32 for a half model): the division rounds once, into the
            # gradient's dtype. A float16 copy would be inf above 65504 (features of σ > 256) and 0 below 6e-8:
            # the gradient zeroed or infinite where the formula's value is a float16 number
            gw.append(g)
            scale_w.append(scale if v_shape is None else scale.view(v_shape))
            if gb is not None and mu is not None:
                mu = mu if mu.dtype == g.dtype else mu.to(g.dtype)
                centred.append(i)
                mu_w.append(mu if v_shape is None else mu.view(v_shape))
                gb_w.append(gb.view(b_shape))
        if centred:  # G_w − μ_j G_b[i]
            torch._foreach_addcmul_([gw[i] for i in centred], mu_w, gb_w, value=-1.0)
        torch._foreach_div_(gw, scale_w)  # ÷ q²σ̃²_j
        for i, mu in zip(centred, mu_w):  # G_b ← G_b/q² − Σ_j μ_j G_w_new[i, j]
            g, grad_b, q2 = gw[i], grads_b[i], q2s[i]
            assert grad_b is not None
            share = 1 if shares is None else shares[i]  # G_b/(n·q²): one of n bias tensors of one bias
            if isinstance(q2, Tensor):  # on the device (counts pooled over ranks): never read back
                # a (blocks, 1) q² for the row blocks of one grouped entry (one value per block)
                (grad_b if q2.dim() == 0 else grad_b.view(q2.shape[0], -1)).div_(q2)
                beta = 1.0 / share
            else:
                beta = 1.0 / (share * q2)
            if groups[i] == 1:  # kernel positions summed first: (out, c_in); per column: (out, c_in·k)
                per_channel = g if g.dim() == 2 else (g.flatten(1) if columns[i] else g.flatten(2).sum(-1))
                grad_b.addmv_(per_channel, mu if mu.dim() == 1 else mu.view(-1), beta=beta, alpha=-1.0)
            else:  # per group: (groups, 1, c_in/g) @ (groups, c_in/g, out/g), or c_in/g·k per column
                # (a 3-D view: row blocks of a linear weight, the q, k, v of an attention, see above). μ on the
                # left: a (1, c) @ (c, out) product per group runs as BLAS gemm on the CPU, where ATen's batched
                # (out, c) @ (c, 1) is 3–10× slower than the per-layer matrix–vector products (measured, E ≥ 128)
                per_channel = g if g.dim() == 3 else (g.flatten(2) if columns[i] else g.flatten(3).sum(-1))
                mu_g = mu.reshape(g.shape[0], 1, per_channel.shape[2])
                grad_b.view(g.shape[0], 1, g.shape[1]).baddbmm_(
                    mu_g, per_channel.transpose(1, 2), beta=beta, alpha=-1.0
                )
