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
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["precondition_", "precondition_many_", "q_squared", "var_tilde", "var_tilde_many"]


def var_tilde(var: Tensor, eps1: float, eps2: float) -> Tensor:
    """σ̃² = σ² + ε1·max(σ²) + ε2 (Alg. 2/3 step 3)."""
    return var_tilde_many([var], eps1, eps2)[0]


def var_tilde_many(variances: Sequence[Tensor], eps1: float, eps2: float) -> list[Tensor]:
    """:func:`var_tilde` of several layers with ``torch._foreach_*`` kernels."""
    floors = torch._foreach_max(list(variances))  # max(σ²) per layer, 0-d
    torch._foreach_mul_(floors, eps1)
    torch._foreach_add_(floors, eps2)
    return list(torch._foreach_add(list(variances), floors))


def q_squared(fan_in: int, samples: int, out_positions_per_sample: float) -> float:
    """q² of Alg. 2/3 step 3.

    Dense (Prop. 5): ``max(n_in / N, 1)``. Convolution (§4): ``max(c_in·k² / N, √(r·s))`` with r·s
    the output positions per sample. One formula covers both because a dense layer has one
    output position per row. ``fan_in`` is what one output neuron sees: ``weight[0].numel()``
    (per-group input channels × kernel volume for grouped convolutions).
    """
    return max(fan_in / samples, math.sqrt(out_positions_per_sample))


def _per_weight_view(vec: Tensor, grad_w: Tensor, groups: int) -> Tensor:
    """Broadcast a per-input-channel vector (length c_in) onto ``grad_w`` of shape (out, c_in/groups, *k)."""
    out, cin_g = grad_w.shape[0], grad_w.shape[1]
    trailing = (1,) * (grad_w.dim() - 2)
    if groups == 1:
        return vec.view(1, cin_g, *trailing)
    # output channel o belongs to group o // (out / groups) and sees input channels of that group only
    per_out = vec.view(groups, 1, cin_g).expand(groups, out // groups, cin_g).reshape(out, cin_g)
    return per_out.view(out, cin_g, *trailing)


@torch.no_grad()
def precondition_(
    grad_w: Tensor,
    grad_b: Tensor | None,
    mu: Tensor | None,
    var_t: Tensor,
    q2: float,
    groups: int = 1,
) -> None:
    """Apply (1/q²)·P·Pᵀ to one layer's gradients, in place (Alg. 2/3 steps 4–5).

    Args:
        grad_w: weight gradient, (out, in) or (out, c_in/groups, *kernel).
        grad_b: bias gradient (out,), or ``None`` for a layer without bias.
        mu: per-input-channel mean μ (c_in,), or ``None`` for a layer without bias.
        var_t: per-input-channel σ̃² (c_in,).
        q2: the scale q².
        groups: convolution groups (1 for Linear).
    """
    precondition_many_([grad_w], [grad_b], [mu], [var_t], [q2], [groups])


@torch.no_grad()
def precondition_many_(
    grads_w: Sequence[Tensor],
    grads_b: Sequence[Tensor | None],
    mus: Sequence[Tensor | None],
    var_ts: Sequence[Tensor],
    q2s: Sequence[float],
    groups: Sequence[int],
) -> None:
    """:func:`precondition_` for several layers at once, with ``torch._foreach_*`` kernels.

    A layer is centred (has the μ block of P) when both its ``grads_b`` and ``mus`` entries are given.
    """
    dtype = grads_w[0].dtype
    # 1/(q² σ̃²) in the statistics' dtype (float32 or float64), applied in the gradient's dtype
    inv = torch._foreach_mul(list(var_ts), list(q2s))
    torch._foreach_reciprocal_(inv)
    inv_w = [_per_weight_view(v.to(g.dtype), g, k) for v, g, k in zip(inv, grads_w, groups)]
    centred = [i for i, (gb, mu) in enumerate(zip(grads_b, mus)) if gb is not None and mu is not None]
    gw_c = [grads_w[i] for i in centred]
    gb_c: list[Tensor] = [grads_b[i] for i in centred]  # type: ignore[misc]
    mu_w = [_per_weight_view(mus[i].to(dtype), grads_w[i], groups[i]) for i in centred]  # type: ignore[union-attr]
    if centred:  # G_w − μ_j G_b[i]
        gb_views = [gb.view(-1, *(1,) * (gw.dim() - 1)) for gb, gw in zip(gb_c, gw_c)]
        torch._foreach_addcmul_(gw_c, mu_w, gb_views, value=-1.0)
    torch._foreach_mul_(list(grads_w), inv_w)  # ÷ q²σ̃²_j
    if not centred:
        return
    corrections = []  # Σ_j μ_j G_w_new[i, j] over input channels and kernel positions
    for i, gw, mw in zip(centred, gw_c, mu_w):
        kernel_sum = gw.flatten(2).sum(-1) if gw.dim() > 2 else gw  # (out, c_in/groups)
        if groups[i] == 1:
            corrections.append(kernel_sum @ mw.reshape(-1))
        else:
            corrections.append((kernel_sum * mw.reshape(kernel_sum.shape)).sum(1))
    torch._foreach_div_(gb_c, [q2s[i] for i in centred])
    torch._foreach_sub_(gb_c, corrections)
