"""One output neuron's Hessian block, original and in BNP's variable z (paper 000, Prop. 2, Theorem 3, §5.1 Fig. 8).

For output neuron i of a Linear/ConvNd layer, ŵ = [b_i; w_i] and ∇²_ŵ L is the exact Hessian of the step's
loss (:class:`._probes.StepLoss`, :func:`lightning_bnp.core.metrics.neuron_hessians`); in z (ŵ = P z) it is
Pᵀ ∇²_ŵ L P with the P of BNP's latest step. :func:`hessian_metrics` turns both into the monitor's tags:

* ``bnp/hessian_kappa/<layer>/original|preconditioned`` — κ = max|λ| / min nonzero |λ|, where |λ| ≤ τ·max|λ|
  counts as zero (τ = ``hessian_rtol``, default n·eps of the Hessian's dtype, so κ ≤ 1/τ). Both κ of a BNP layer
  count the same number of eigenvalues, the smaller of the two ranks: Pᵀ ∇²L P has the rank of ∇²L (P is
  invertible), so an eigenvalue counted on one side only sits at the threshold — near-null eigenvalues of a
  block late in training (samples the network fits with p ≈ 1 add curvature p(1 − p) ≈ 0) would otherwise
  count on one side and make the gain the distance of that eigenvalue to the threshold;
* ``bnp/hessian_log10_kappa/<layer>/original|preconditioned|gain`` — the same in decades, and log10 of the gain
  κ original / κ preconditioned (κ spans many decades from record to record, so a linear chart of it shows
  all but its largest values as 0; in decades every curve is readable and the gain is the gap between two);
* ``bnp/hessian_kappa_gain/<layer>`` — the gain κ original / κ preconditioned of the same block at the same step,
  what §5.1 compares with κ(D)²;
* ``bnp/hessian_min_ratio/<layer>/…`` (λ_min / max|λ|, signed) and ``bnp/hessian_rank/<layer>`` (the number
  of eigenvalues both κ count).

The log10 and gain tags exist only where their κ are finite, so a block whose κ cannot be computed warns once,
through its ``hessian_kappa`` tag.

.. math::
    κ(∇^2_{\\hat w} L) = \\frac{\\max|λ|}{\\min_{|λ| > τ \\max|λ|} |λ|}, \\qquad
    ∇^2_z L = P^T ∇^2_{\\hat w} L\\, P
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor, nn

from lightning_bnp.callbacks import _probes as probes
from lightning_bnp.core import metrics as M
from lightning_bnp.core.preconditioner import BNPPreconditioner

__all__ = ["hessian_metrics"]


def hessian_metrics(
    step: probes.ProbeStep,
    pre: BNPPreconditioner | None,
    layers: dict[str, nn.Module],
    *,
    neuron: int,
    max_size: int,
    precision: Literal["float64", "model"],
    rtol: float | None,
    warn_once: Callable[[str, str], None],
) -> tuple[dict[str, float], dict[str, Tensor]]:
    """The Hessian-block tags of the ``layers`` (name → module) on the step's captured batches, and
    log10|λ| of each block's nonzero eigenvalues (``bnp/hessian_spectrum/<layer>/original|preconditioned``),
    for the histograms. Layers whose neuron has more than ``max_size`` parameters are skipped (one warning)."""
    names = {id(p): n for n, p in step.pl_module.named_parameters()}
    blocks, used = [], []
    for name, module in layers.items():
        out, fan_in = int(module.weight.shape[0]), int(module.weight[0].numel())  # type: ignore[index]
        bias = module.bias if isinstance(module.bias, Tensor) and module.bias.requires_grad else None
        if fan_in + (bias is not None) > max_size:
            warn_once(
                f"size:{name}",
                f"layer {name!r}: Hessian block skipped, its neuron has {fan_in + (bias is not None)} "
                f"parameters > `max_hessian_size`={max_size}",
            )
            continue
        if neuron >= out:
            warn_once(f"neuron:{name}", f"`neuron`={neuron} >= {out} outputs of {name!r}: modulo")
        key_b = names[id(bias)] if bias is not None else None
        blocks.append((names[id(probes.trainable_weight(module))], key_b, neuron % out))
        used.append(name)

    def hessians(dtype: torch.dtype | None) -> list[Tensor]:
        loss = step.loss(dtype)
        return M.neuron_hessians(
            loss,
            [
                M.NeuronBlock(kw, loss.params[kw], kb, loss.params[kb] if kb is not None else None, i)
                for kw, kb, i in blocks
            ],
        )

    metrics: dict[str, float] = {}
    spectra: dict[str, Tensor] = {}
    dtype = torch.float64 if precision == "float64" else None
    for name, (_, key_b, index), h in zip(used, blocks, step.in_dtype(dtype, hessians)):
        original = M.spectrum(h, rtol)
        conditioned = None
        if pre is not None and name in pre.layers:
            p = probes.neuron_p(pre, pre.layers[name], index, centred=key_b is not None).to(h.device)
            conditioned = M.spectrum(p.T @ h.double() @ p, rtol or h.shape[0] * torch.finfo(h.dtype).eps)
            # one rank for both (P is invertible): a near-null eigenvalue counted on one side only would make
            # the gain the distance of that eigenvalue to the threshold
            original, conditioned = M.common_rank(original, conditioned)
        _keep(spectra, f"bnp/hessian_spectrum/{name}/original", original)
        metrics[f"bnp/hessian_kappa/{name}/original"] = original.kappa
        metrics[f"bnp/hessian_min_ratio/{name}/original"] = probes.min_ratio(original)
        metrics[f"bnp/hessian_rank/{name}"] = float(original.rank)
        metrics.update(_readable(name, "original", original.kappa))
        if conditioned is not None:
            _keep(spectra, f"bnp/hessian_spectrum/{name}/preconditioned", conditioned)
            metrics[f"bnp/hessian_kappa/{name}/preconditioned"] = conditioned.kappa
            metrics[f"bnp/hessian_min_ratio/{name}/preconditioned"] = probes.min_ratio(conditioned)
            metrics.update(_readable(name, "preconditioned", conditioned.kappa))
            if _positive(original.kappa) and _positive(conditioned.kappa):
                metrics[f"bnp/hessian_kappa_gain/{name}"] = original.kappa / conditioned.kappa
                # the difference of the logs, not log10 of the ratio: the chart's gap between the two curves
                gain = math.log10(original.kappa) - math.log10(conditioned.kappa)
                metrics[f"bnp/hessian_log10_kappa/{name}/gain"] = gain
    return metrics, spectra


def _positive(kappa: float) -> bool:
    """A κ whose log is defined (κ ≥ 1 whenever it is finite; inf/NaN for a zero block)."""
    return math.isfinite(kappa) and kappa > 0


def _readable(name: str, variant: str, kappa: float) -> dict[str, float]:
    """``bnp/hessian_log10_kappa/<layer>/<variant>`` where κ is finite (else nothing: the raw tag warns)."""
    return {f"bnp/hessian_log10_kappa/{name}/{variant}": math.log10(kappa)} if _positive(kappa) else {}


def _keep(spectra: dict[str, Tensor], tag: str, spectrum: M.Spectrum) -> None:
    if spectrum.rank > 0:
        spectra[tag] = spectrum.nonzero.log10()
