"""κ(D) and weight κ of each layer: the monitor's metrics that need no re-evaluation of the loss.

* ``bnp/kappa_D/<layer>`` — the paper's κ(D), D = diag(1, σ)⁻¹ of the *raw* input statistics of the P BNP
  applied in its latest step (paper 000, eq. 12, §5.1, Fig. 8: 1e2–1e5; §5.1 reads κ(D)² as the gain);
  ``bnp/kappa_D_floored/<layer>`` — max σ̃ / min σ̃ of the floored σ̃ BNP divides by (≤ √((1 + ε1)/ε1) ≈ 10).
  Layers BNP did not transform in that step log neither.
* ``bnp/weight_kappa/<layer>/raw`` — σ_max / σ_min of the trainable weight's (out, in·k) view, and
  ``…/conditioned`` of the weight a parametrized (e.g. Weight-Conditioned, paper 004) layer computes with.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.nn.utils import parametrize

from lightning_bnp.callbacks import _probes as probes
from lightning_bnp.core import metrics as M
from lightning_bnp.core.layers import NO_LEAF
from lightning_bnp.core.preconditioner import BNPPreconditioner

__all__ = ["kappa_d_metrics", "weight_kappa_metrics"]


def kappa_d_metrics(pre: BNPPreconditioner, layers: dict[str, nn.Module]) -> dict[str, float]:
    """κ(D) (raw statistics) and κ(D̃) (floored σ̃) of the BNP layers among ``layers`` that BNP transformed."""
    metrics: dict[str, float] = {}
    for name, layer in pre.layers.items():
        # a layer BNP did not transform in the latest step has no D (e.g. nn.MultiheadAttention's
        # out_proj, whose forward never runs): logging its initial σ² = 1 would read "κ = 1"
        if name in layers and layer.transform is not None:
            var, mu, rtol = probes.raw_statistics(pre, layer)
            metrics[f"bnp/kappa_D/{name}"] = M.kappa_d(var, mu, bias_entry=mu is not None, rtol=rtol)
            metrics[f"bnp/kappa_D_floored/{name}"] = M.sigma_ratio(layer.transform.var_t)
    return metrics


def weight_kappa_metrics(
    layers: dict[str, nn.Module], max_size: int, warn_once: Callable[[str, str], None]
) -> dict[str, float]:
    """Weight κ (raw and, when parametrized, conditioned) of the ``layers`` whose (out, in·k) view has at most
    ``max_size`` singular values; larger ones are skipped with one warning each (float64 SVD cost)."""
    metrics: dict[str, float] = {}
    for name, module in layers.items():
        weight = probes.trainable_weight(module)
        if weight is NO_LEAF:  # reparametrized in a way BNP leaves alone: κ of the weight in use
            weight = module.weight  # type: ignore[assignment]
        size = min(weight.shape[0], weight[0].numel())  # singular values of the (out, in·k) view
        if size > max_size:
            warn_once(
                f"weight_size:{name}",
                f"layer {name!r}: weight κ skipped, its (out, in·k) view has {size} singular values "
                f"> `max_weight_kappa_size`={max_size} (an SVD of that size per record "
                "is too slow; raise the limit to log it)",
            )
            continue
        metrics[f"bnp/weight_kappa/{name}/raw"] = M.matrix_kappa(weight)
        if parametrize.is_parametrized(module, "weight"):
            metrics[f"bnp/weight_kappa/{name}/conditioned"] = M.matrix_kappa(module.weight)  # type: ignore[arg-type]
    return metrics
