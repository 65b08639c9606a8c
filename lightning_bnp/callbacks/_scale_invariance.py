"""Effective learning rate of scale-invariant weights (paper 002, Definition 2.1, Lemma 2.4).

For weights w that the loss does not see the scale of, ⟨w, ∇_w L⟩ = 0, so (S)GD only grows ‖w‖² and steps
as if its rate were η/‖w‖². :func:`find_scale_invariant` finds such layers numerically on the first
record's batch (:func:`lightning_bnp.core.metrics.scale_invariant_units`: scale each layer's units, compare
the loss and the outputs); :func:`scale_invariance_metrics` gives, for each of them,

* ``bnp/effective_lr/<layer>`` — η/‖w‖² (SGD only; mean squared norm over the layer's units);
* ``bnp/weight_norm_sq/<layer>`` — ‖(W, b)‖², which SGD without weight decay only grows;
* ``bnp/weight_grad_cosine/<layer>`` — cos∠(w, ∇w), ≈ 0 for scale-invariant w.

Both re-evaluations run in float32 without autocast: the check's tolerance (1e-3) and a cosine near 0 need
no more, and float64 convolutions are ~20× slower on CPU.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

from lightning_bnp.callbacks import _probes as probes
from lightning_bnp.core import metrics as M

__all__ = ["everywhere", "find_scale_invariant", "scale_invariance_metrics"]


def find_scale_invariant(step: probes.ProbeStep, layers: dict[str, nn.Module]) -> dict[str, int]:
    """The scale-invariant ones of the ``layers`` ({layer: units}), checked on the step's captured batches."""
    trainer = step.trainer
    candidates = _candidates(step.pl_module, layers)

    def find(dtype: torch.dtype | None) -> dict[str, int]:
        loss = step.loss(dtype)
        found = {
            n: (kw, loss.params[kw], kb, loss.params[kb] if kb is not None else None)
            for n, (kw, kb) in candidates.items()
        }
        return M.scale_invariant_units(loss.outputs, found, agree=lambda ok: everywhere(trainer, ok))

    units = step.in_dtype(torch.float32, find)
    rank_zero_info(
        f"ConditionNumberMonitor: scale-invariant layers (paper 002), checked on step "
        f"{trainer.global_step - 1}'s batch: {sorted(units) or 'none'}"
    )
    return units


def scale_invariance_metrics(
    step: probes.ProbeStep, layers: dict[str, nn.Module], units: dict[str, int], warned: set[str]
) -> dict[str, float]:
    """The tags of the scale-invariant layers ``units`` ({layer: units}) on the step's captured batches;
    ``warned`` holds the one-time messages already given."""
    if not units:
        return {}
    candidates = _candidates(step.pl_module, layers)

    def gradients(dtype: torch.dtype | None) -> dict[str, Tensor]:
        loss = step.loss(dtype)
        wanted = {k for n in units for k in candidates[n] if k is not None}
        return M.loss_and_grad(loss, {k: loss.params[k] for k in wanted})[1]

    grads = step.in_dtype(torch.float32, gradients)
    lrs = probes.learning_rates(step.trainer, sgd_only=True)  # η/‖w‖² is (S)GD's effective rate (paper 002)
    metrics: dict[str, float] = {}
    for name, count in units.items():
        module, (key_w, key_b) = layers[name], candidates[name]
        weight = probes.trainable_weight(module)
        bias = module.bias if key_b is not None and isinstance(module.bias, Tensor) else None
        norm_sq, cosine = M.weight_norm_and_grad_cosine(
            weight,
            bias,
            grads[key_w],
            grads[key_b] if key_b is not None else None,
        )
        metrics[f"bnp/weight_norm_sq/{name}"] = norm_sq
        metrics[f"bnp/weight_grad_cosine/{name}"] = cosine
        if id(weight) in lrs:
            metrics[f"bnp/effective_lr/{name}"] = M.effective_learning_rate(weight, bias, lrs[id(weight)], count)
        elif "effective_lr_sgd" not in warned:
            warned.add("effective_lr_sgd")
            rank_zero_info(
                "ConditionNumberMonitor: η/‖w‖² is the effective learning rate of (S)GD (paper 002); it is not "
                "logged for scale-invariant layers that a non-SGD optimizer (e.g. Adam) trains (their ‖w‖² and "
                "cos∠(w, ∇w) are)."
            )
    return metrics


def _candidates(pl_module: pl.LightningModule, layers: dict[str, nn.Module]) -> dict[str, tuple[str, str | None]]:
    """{layer: (weight key, bias key or None)} of the layers with a trainable weight (``named_parameters`` keys)."""
    names = {id(p): n for n, p in pl_module.named_parameters()}

    def keys(module: nn.Module) -> tuple[str, str | None]:
        bias = module.bias if isinstance(module.bias, Tensor) and module.bias.requires_grad else None
        return names[id(probes.trainable_weight(module))], names[id(bias)] if bias is not None else None

    return {n: keys(m) for n, m in layers.items() if probes.trainable_weight(m).requires_grad}


def everywhere(trainer: pl.Trainer, ok: bool) -> bool:
    """``ok`` on every process (one all-reduce under DDP), so that every rank takes the same branch."""
    if trainer.world_size == 1:
        return ok
    failed = trainer.strategy.reduce(torch.tensor(float(not ok), device=trainer.strategy.root_device), reduce_op="sum")
    return float(failed) == 0.0
