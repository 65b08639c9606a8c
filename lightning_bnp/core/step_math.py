"""The tensor work of one BNP step for a group of layers (Alg. 2/3 steps 1–5): pure functions of tensors,
without a read back to the host, traceable whole by ``torch.compile(fullgraph=True)``.

:func:`step_math` pools nothing and decides nothing in Python that depends on data: the step's plan
(:mod:`~lightning_bnp.core.step_plan`) gathers its inputs and :class:`StepConfig` carries the constants.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_bnp.core.layout import FeatureLayout
from lightning_bnp.core.statistics import ema_update
from lightning_bnp.core.step_path import GroupedKernels
from lightning_bnp.core.transform import precondition_scaled_, var_tilde

__all__ = ["StepConfig", "step_math"]


@dataclass(frozen=True)
class StepConfig:
    """What shapes a step's tensor work besides its tensors (constants of a compiled step)."""

    running: bool
    bias_correction: bool
    rho: float
    eps1: float
    eps2: float
    one_row: tuple[int, ...]  # layers whose σ²_H follows the N = 1 rule (or may, where the count is pooled)
    # the transform's entries: (first layer, layers) each, a run of n > 1 layers being the n row blocks of one
    # weight (LayerKind.row_block); their features and groups (n for such a run)
    spans: tuple[tuple[int, int], ...]
    sizes: tuple[int, ...]
    groups: tuple[int, ...]
    # per entry, how its gradient meets its statistics and bias gradient (transform.broadcast_shapes)
    shapes: tuple[tuple[Any, ...], ...]
    # per entry, n where its bias is one of n tensors holding one bias (column blocks: LayerKind.column_block), else 1
    shares: tuple[int, ...] = ()


def step_math(
    layout: FeatureLayout,
    config: StepConfig,
    means: list[Tensor],
    variances: list[Tensor],
    running_mus: list[Tensor],
    before: Tensor | None,
    counts: Tensor | None,
    fan_in: Tensor | None,
    q2_flat: Tensor | None,
    q2s: list[Any],
    grads_w: list[Tensor],
    grads_b: list[Tensor | None],
    kernels: GroupedKernels | None,
    q2_layers: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The tensor work of one step for a group of layers (Alg. 2/3 steps 1–5), without a single read back to
    the host, and traceable whole by ``torch.compile(fullgraph=True)``.

    The running state is one vector ``[m ; v ; d]`` (d = ρ^t + κ per layer, κ = ε2/(1 + ε1) in the paper's view
    and 0 with bias correction: :class:`~lightning_bnp.core.statistics.RunningStatistics`); a layer's step count
    grows by its entry of the returned ``finite``.
    ``counts``: (rows, samples, out positions) per layer when they were pooled over ranks (then q² is built
    here, and a layer that no rank ran keeps its state and gets M = I); else ``q2_flat`` and ``q2s`` are given.
    ``grads_w``, ``grads_b`` and ``q2s`` are per entry of the transform (``config.spans``): one per layer, or
    one for the n row blocks of one weight (the whole gradient and bias gradient, q² one float or (n, 1)).
    ``kernels``: the plan's grouped kernels (:mod:`~lightning_bnp.core.step_path`): the running state of every
    layer in one launch where the counts are the host's, and every entry's transform in one more where the transform
    kernel takes them, with q² per layer (``q2_layers``, or the pooled ones); the pure-torch ops elsewhere.

    Returns:
        (μ, σ̃², state after, per layer whether its moments were finite (it counts as a step), per-layer max σ²_H
        before saturation, q² per layer when pooled);
        the gradients are transformed in place.
    """
    # [μ_H ; σ²_H ; κ] of every layer (κ: the batch value of d = ρ^t + κ, so that d − κ ← ρ·(d − κ) in the same update)
    batch = torch.cat(means + variances + ([layout.decay_target] if config.running else []))
    if kernels is not None and counts is None:  # steps 2–3 of every layer in one launch
        assert q2_flat is not None
        mu, var_t, scale, after, finite, peak = kernels.state(
            batch, before, q2_flat, config.running, config.bias_correction, config.rho, config.eps1, config.eps2,
            layout.ceiling,
        )  # fmt: skip
        if not config.running:
            after = finite = peak
        _transform(config, kernels, mu, scale, q2s, q2_layers, grads_w, grads_b)
        return mu, var_t, after, finite, peak, peak
    mu_h, var_h = batch.split_with_sizes(layout.state_sizes if config.running else layout.state_sizes[:2])[:2]
    for i, running_mu in zip(config.one_row, running_mus):  # N = 1: σ²_H = (h − μ)², μ before the update
        part = layout.slice(i)
        one_row = (mu_h[part] - running_mu.to(mu_h.dtype)).square()
        # pooled over ranks the count is on the device: the rule applies where it is 1
        var_h[part] = one_row if counts is None else torch.where(counts[i, 0] == 1, one_row, var_h[part])
    if layout.uncentred_mask is not None:  # no bias: uncentred second moment σ²_H + μ_H², and μ stays 0
        mu_uncentred = mu_h * layout.uncentred_mask
        var_h.addcmul_(mu_uncentred, mu_uncentred)
        mu_h.sub_(mu_uncentred)
    ran = None
    if counts is not None:  # pooled over ranks: a layer no rank ran keeps its state and gets M = I
        ran = (counts[:, 0] > 0).index_select(0, layout.owner)
        var_h.copy_(torch.where(ran, var_h, math.nan))
    # per layer max σ²_H: NaN when a sample was NaN or ±Inf (σ²_H is computed from centred values, so a
    # non-finite μ_H makes it NaN too), +Inf when finite inputs' squares overflow the dtype
    peak = layout.segment_max(var_h)
    var_h.clamp_(max=layout.ceiling)  # an overflowed σ²_H saturates (the warning says so): variance_ceiling
    if not config.running:
        mu, var_t = mu_h, var_tilde(var_h, config.eps1, config.eps2, maxima=layout.layer_max(var_h))
        after = finite = peak
    else:
        assert before is not None
        after = ema_update(before, batch, config.rho)  # [m ; v ; d] ← ρ[m ; v ; d] + (1−ρ)[μ_H ; σ²_H ; κ]
        # a layer whose moments are not finite keeps its state (and step count): P uses what was stored
        finite = torch.eq(peak, peak)
        after = torch.where(finite.index_select(0, layout.state_owner), after, before)
        mean_acc, var_acc, decay = after.split_with_sizes(layout.state_sizes)
        if config.bias_correction:  # μ = m/(1 − ρ^t), σ² = v/(1 − ρ^t)
            scale = torch.reciprocal(1.0 - decay).index_select(0, layout.owner)
            mu, var = mean_acc * scale, var_acc * scale
            var_t = var_tilde(var, config.eps1, config.eps2, maxima=layout.layer_max(var))
        else:  # the paper's view σ² = v + ρ^t; σ̃² = σ² + ε1·max σ² + ε2 = v + ε1·(max v + ρ^t·(1 + ε1)/ε1 + ε2/ε1)
            # = v + ε1·(max v + d·(1 + ε1)/ε1) with d = ρ^t + ε2/(1 + ε1): the ε2 term rides in d (one op less)
            floor = layout.floor_entries(after, (1.0 + config.eps1) / config.eps1)  # max v + d·(1 + ε1)/ε1
            mu, var_t = mean_acc, torch.add(var_acc, floor, alpha=config.eps1)
    q2_out = peak
    if counts is not None:
        assert ran is not None and fan_in is not None
        per_sample = counts[:, 1].clamp_min(1.0)
        q2 = torch.maximum(fan_in / per_sample, (counts[:, 2] / per_sample).sqrt())
        q2_out = torch.where(counts[:, 0] > 0, q2, 1.0).to(mu.dtype)
        q2_flat = q2_out.index_select(0, layout.owner)
        q2s = [q2_out[i] if n == 1 else q2_out[i : i + n].view(n, 1) for i, n in config.spans]
        mu, var_t = torch.where(ran, mu, 0.0), torch.where(ran, var_t, 1.0)
        # no rank ran it (or it saw no row, e.g. an embedding fed only padding): nothing was not finite
        peak = torch.where(counts[:, 0] > 0, peak, 0.0)
    assert q2_flat is not None
    scale = var_t * q2_flat  # q²σ̃², all layers in one product
    _transform(config, kernels, mu, scale, q2s, q2_out if counts is not None else q2_layers, grads_w, grads_b)
    return mu, var_t, after, finite, peak, q2_out


def _transform(config: StepConfig, kernels: GroupedKernels | None, mu: Tensor, scale: Tensor, q2s: list[Any],
               q2_layers: Tensor | None, grads_w: list[Tensor], grads_b: list[Tensor | None]) -> None:  # fmt: skip
    """Steps 4–5 for every entry: one launch of the grouped kernel where the plan has one for these entries (it
    takes q² per layer, ``q2_layers``), else the pure-torch transform (``q2s`` per entry)."""
    if kernels is not None and kernels.transform is not None:  # (an entry without a bias gradient is only divided)
        kernels.transform(grads_w, grads_b, mu, scale, q2_layers)
        return
    mus = [m if grad_b is not None else None for m, grad_b in zip(mu.split_with_sizes(config.sizes), grads_b)]
    precondition_scaled_(
        grads_w,
        grads_b,
        mus,
        scale.split_with_sizes(config.sizes),
        q2s,
        config.groups,
        config.shapes,
        config.shares or None,
    )
