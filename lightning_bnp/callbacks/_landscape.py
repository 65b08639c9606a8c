"""Whole-model probes of the monitor: paper 003's landscape along the step, and the Hessian's extreme eigenvalues.

* ``bnp/landscape/loss_range|grad_change|beta_smoothness`` (paper 003, §3.2, App. A.2.2, Fig. 4): at the
  parameters after the step, with d = η·∇L (or BNP's η·M·∇L), the loss and gradient at θ − k·d for the step
  multiples k;
* ``bnp/lanczos/lambda_min|lambda_max`` — Lanczos on the Hessian of all trainable parameters, on a fixed
  probe batch (signed Ritz values; no κ is formed from them).
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor

from lightning_bnp.callbacks import _probes as probes
from lightning_bnp.core import metrics as M
from lightning_bnp.core.preconditioner import BNPPreconditioner

__all__ = ["lanczos_metrics", "landscape_metrics"]


def landscape_metrics(
    step: probes.ProbeStep,
    pre: BNPPreconditioner | None,
    multiples: list[float],
    direction: Literal["gradient", "preconditioned"],
) -> dict[str, float]:
    """Paper 003's loss range, gradient change and effective β-smoothness on the step's captured batches, along
    the step ``direction`` times each of the ``multiples``; only parameters that some optimizer owns move."""
    loss = step.loss(None)
    lrs = probes.learning_rates(step.trainer)
    named = {n: p for n, p in step.pl_module.named_parameters() if p.requires_grad and id(p) in lrs}
    by_id = {id(p): n for n, p in named.items()}

    def direction_of(grads: dict[str, Tensor]) -> dict[str, Tensor]:
        if direction == "preconditioned" and pre is not None:
            for layer in pre.layers.values():  # d = M·∇L with the M of BNP's latest step
                if layer.transform is not None and id(layer.weight) in by_id:
                    vec_b = grads.get(by_id.get(id(layer.bias), "")) if layer.bias is not None else None
                    layer.transform.apply_(grads[by_id[id(layer.weight)]], vec_b)
        return {n: g * lrs[id(named[n])] for n, g in grads.items()}

    params = {n: loss.params[n] for n in named}
    result = M.landscape_probe(loss, params, direction_of, multiples)
    return {
        "bnp/landscape/loss_range": result.loss_range,
        "bnp/landscape/grad_change": result.grad_change,
        "bnp/landscape/beta_smoothness": result.beta_smoothness,
    }


def lanczos_metrics(step: probes.ProbeStep, iters: int) -> dict[str, float]:
    """The extreme Ritz values of ``iters`` Lanczos steps on the full Hessian at the step's captured batches
    (the monitor passes its fixed probe batch)."""
    loss = step.loss(None)
    params = {n: loss.params[n] for n, p in step.pl_module.named_parameters() if p.requires_grad}
    lam_min, lam_max = M.hessian_extremes(loss, params, iters)
    return {"bnp/lanczos/lambda_min": lam_min, "bnp/lanczos/lambda_max": lam_max}
