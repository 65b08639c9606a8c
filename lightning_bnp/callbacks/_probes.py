"""Re-evaluating a training step's loss without side effects (helpers of :mod:`.condition_monitor`).

The probes of :class:`~lightning_bnp.callbacks.condition_monitor.ConditionNumberMonitor` need the
step's loss L as a function of some of the parameters (paper 000, Prop. 2: ∇²_ŵ L of one neuron;
paper 003, App. A.2.2: L and ∇L along the step direction). :class:`StepLoss` calls the
LightningModule's ``training_step`` on the captured batches through ``torch.func.functional_call``
on detached parameters and cloned buffers, so nothing the Trainer owns is written: no ``.grad``, no
BatchNorm running statistics, no BNP statistics (paused by the caller), no ``self.log`` (silenced)
and no random state (the caller restores torch's CPU/CUDA, NumPy's and Python's with Lightning's
``isolate_rng``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, TypeVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.utils.checkpoint import CheckpointFunction

from lightning_bnp.core import metrics as M
from lightning_bnp.core.layers import ManagedLayer
from lightning_bnp.core.layers import weight_leaf as trainable_weight
from lightning_bnp.core.preconditioner import BNPPreconditioner
from lightning_bnp.core.transform import var_tilde

__all__ = [
    "Captured",
    "DtypeFallback",
    "NoLoss",
    "ProbeStep",
    "StepLoss",
    "is_neuron_layer",
    "learning_rates",
    "neuron_p",
    "raw_statistics",
    "reentrant_checkpoint_in",
    "silenced_logging",
    "statistics",
    "trainable_weight",
]


@dataclass
class Captured:
    """A micro-batch of the measured step and the torch RNG state its forward started from."""

    batch: Any
    batch_idx: int
    cpu_rng: Tensor
    cuda_rng: Tensor | None

    def cloned(self) -> Captured:
        """A copy whose tensors do not alias the DataLoader's (for the fixed Lanczos probe batch)."""
        batch = apply_to_collection(self.batch, Tensor, lambda t: t.detach().clone())
        return Captured(batch, self.batch_idx, self.cpu_rng, self.cuda_rng)


_T = TypeVar("_T")


class DtypeFallback:
    """Runs a re-evaluation in a dtype (float64 for the Hessian's κ up to ~1e13), or in the model's dtype and
    autocast once that has failed (e.g. ``training_step`` builds float32 tensors): one warning per dtype."""

    def __init__(self) -> None:
        self.failed: set[torch.dtype] = set()

    def __call__(self, dtype: torch.dtype | None, compute: Callable[[torch.dtype | None], _T]) -> _T:
        """``compute(dtype)`` (parameters, buffers and batch cast to ``dtype``, autocast off), or ``compute(None)``
        (the model's dtype and autocast) when ``dtype`` is ``None`` or a re-evaluation in it has failed."""
        if dtype is not None and dtype not in self.failed:
            try:
                return compute(dtype)
            except RuntimeError as err:  # e.g. `training_step` builds float32 tensors: use the model's dtype
                self.failed.add(dtype)
                rank_zero_warn(
                    f"ConditionNumberMonitor: {dtype} re-evaluation failed ({err}); using the model's dtype."
                )
        return compute(None)


@dataclass
class ProbeStep:
    """What a probe re-evaluates: the step's ``training_step`` on its ``captured`` micro-batches, in a dtype."""

    trainer: pl.Trainer
    pl_module: pl.LightningModule
    captured: list[Captured]
    in_dtype: DtypeFallback

    def loss(self, dtype: torch.dtype | None) -> StepLoss:
        return StepLoss(self.trainer, self.pl_module, self.captured, dtype)


class NoLoss(Exception):
    """``training_step`` returned no loss tensor (e.g. ``None`` to skip the batch)."""


def reentrant_checkpoint_in(loss: Tensor) -> bool:
    """Whether ``loss``'s autograd graph holds a reentrant ``torch.utils.checkpoint`` (whose backward
    ``torch.autograd.grad`` cannot run: it back-propagates only under ``.backward()``, and on the probes' detached
    parameters its output has no graph at all)."""
    seen: set[Any] = set()  # (the nodes themselves: an id could be reused once a node's wrapper is freed)
    todo = [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if getattr(node, "_forward_cls", None) is CheckpointFunction:
            return True
        todo.extend(next_node for next_node, _ in node.next_functions)
    return False


REENTRANT_CHECKPOINT = (
    "the model uses reentrant activation checkpointing (torch.utils.checkpoint.checkpoint(..., "
    "use_reentrant=True), or Hugging Face's gradient_checkpointing_enable() with reentrant checkpointing), which "
    "torch.autograd.grad cannot differentiate: the probes that differentiate the re-evaluated loss (Hessian "
    "blocks, effective learning rate, landscape, Lanczos) are skipped. Use non-reentrant checkpointing "
    "(use_reentrant=False; gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})) "
    "to measure them."
)


class _TrainingStep(nn.Module):
    """``training_step`` as a forward, so that ``functional_call`` can substitute the module's tensors."""

    def __init__(self, module: pl.LightningModule) -> None:
        super().__init__()
        self.module = module

    def forward(self, batch: Any, batch_idx: int) -> Any:
        return self.module.training_step(batch, batch_idx)


class StepLoss:
    """The step's loss as a function of replaced tensors (keys: ``named_parameters`` names).

    Micro-batches of an accumulated step are summed with Lightning's 1/accumulate factor. With a
    ``dtype`` every floating parameter, buffer and batch tensor is cast to it and autocast is off;
    without, the Trainer's precision context (autocast) is used. Each micro-batch runs with the
    torch RNG state its training forward had, so dropout masks match the step's.
    """

    def __init__(
        self, trainer: pl.Trainer, module: pl.LightningModule, batches: list[Captured], dtype: torch.dtype | None
    ) -> None:
        def cast(t: Tensor) -> Tensor:
            return t.to(dtype) if dtype is not None and t.is_floating_point() else t

        self.wrapper = _TrainingStep(module)
        self.params = {name: cast(p.detach()) for name, p in module.named_parameters()}
        self.buffers = {name: cast(b.detach()) for name, b in module.named_buffers()}
        self.batches = [(apply_to_collection(c.batch, Tensor, cast), c) for c in batches]
        self.accumulate = trainer.accumulate_grad_batches
        self.context = trainer.precision_plugin.train_step_context if dtype is None else nullcontext
        self.device = module.device

    def __call__(self, replaced: dict[str, Tensor]) -> Tensor:
        # buffers are cloned per call: a BatchNorm in training mode updates them in place
        values = {**self.params, **{k: b.clone() for k, b in self.buffers.items()}, **replaced}
        values = {f"module.{k}": v for k, v in values.items()}
        total: Tensor | None = None
        for batch, captured in self.batches:
            torch.set_rng_state(captured.cpu_rng)  # the caller restores the RNG (isolate_rng)
            if captured.cuda_rng is not None:
                torch.cuda.set_rng_state(captured.cuda_rng, self.device)
            with self.context():
                out = torch.func.functional_call(self.wrapper, values, (batch, captured.batch_idx), strict=False)
            loss = out["loss"] if isinstance(out, dict) else out
            if not isinstance(loss, Tensor):
                raise NoLoss
            total = loss / self.accumulate if total is None else total + loss / self.accumulate
        assert total is not None
        return total

    def outputs(self, replaced: dict[str, Tensor]) -> Tensor:
        """The loss followed by every floating tensor the LightningModule's ``forward`` returned during it,
        flattened (float64, detached): what the scale-invariance check compares (:func:`M.scale_invariant_units`)."""
        seen: list[Tensor] = []

        def keep(t: Tensor) -> None:
            if t.is_floating_point():
                seen.append(t.detach().double().reshape(-1))

        handle = self.wrapper.module.register_forward_hook(lambda m, a, out: apply_to_collection(out, Tensor, keep))
        try:
            loss = self(replaced)
        finally:
            handle.remove()
        return torch.cat([loss.detach().double().reshape(1), *seen])


@contextmanager
def silenced_logging(pl_module: pl.LightningModule) -> Iterator[None]:
    """``self.log``/``self.log_dict`` do nothing while ``training_step`` is re-run by a probe."""
    saved = {name: pl_module.__dict__[name] for name in ("log", "log_dict") if name in pl_module.__dict__}
    pl_module.log = _no_log  # type: ignore[method-assign]
    pl_module.log_dict = _no_log  # type: ignore[method-assign]
    try:
        yield
    finally:
        for name in ("log", "log_dict"):
            if name in saved:
                setattr(pl_module, name, saved[name])
            else:
                delattr(pl_module, name)


def _no_log(*args: Any, **kwargs: Any) -> None:
    return None


def is_neuron_layer(module: nn.Module) -> bool:
    """Linear or a (non-transposed) ConvNd: ``weight[i]`` is output neuron i's incoming weights."""
    if isinstance(module, nn.Linear):
        return True
    return isinstance(module, nn.modules.conv._ConvNd) and not module.transposed


def learning_rates(trainer: pl.Trainer, *, sgd_only: bool = False) -> dict[int, float]:
    """``{id(parameter): lr}`` over the Trainer's optimizers (only ``torch.optim.SGD`` ones if ``sgd_only``)."""
    return {
        id(p): float(g["lr"])
        for opt in trainer.optimizers
        if not sgd_only or isinstance(opt, torch.optim.SGD)
        for g in opt.param_groups
        for p in g["params"]
    }


def statistics(pre: BNPPreconditioner, layer: ManagedLayer) -> tuple[Tensor, Tensor]:
    """(μ, σ̃²) of BNP's latest step for this layer; from the running statistics if it has not stepped."""
    if layer.transform is not None:
        mu = layer.transform.mu if layer.transform.mu is not None else layer.running.mu
        return mu, layer.transform.var_t
    return layer.running.mu, var_tilde(layer.running.var, pre.eps1, pre.eps2)


def raw_statistics(pre: BNPPreconditioner, layer: ManagedLayer) -> tuple[Tensor, Tensor | None, float | None]:
    """(σ², μ, rtol) of ``layer``'s input as BNP's latest step saw it, *before* the ε floors (for the
    paper's κ(D)); μ is ``None`` without a centring block. Call only when ``layer.transform`` is set.

    ``statistics="running"``: the running averages of the batch statistics, bias-corrected whatever
    ``bias_correction`` is (:meth:`RunningStatistics.data_view`): with the paper's start, the σ² that P
    uses carries the initial σ² = 1 with weight ρ^t, which is not a variance of the activations.
    ``statistics="batch"``: the batch σ²_H is not stored, so it is recovered from σ̃² by undoing step 3,
    σ² = σ̃² − ε1·max σ² − ε2 with max σ² = (max σ̃² − ε2)/(1 + ε1), in float64. σ̃² is float32, so
    σ_j below ≈ √(eps₃₂·(1 + ε1))·σ_max ≈ 3.5e-4·σ_max is not resolved: the returned ``rtol`` makes
    such units count as dead rather than report rounding noise.
    """
    transform = layer.transform
    assert transform is not None
    if pre.statistics == "running":
        mu, var = layer.running.data_view()
        return var, mu if transform.mu is not None else None, None
    var_t = transform.var_t.double()
    top = (var_t.max() - pre.eps2) / (1.0 + pre.eps1)
    var = (var_t - pre.eps1 * top - pre.eps2).clamp_min(0.0)
    rtol = math.sqrt(torch.finfo(transform.var_t.dtype).eps * (1.0 + pre.eps1))
    return var, transform.mu, rtol


def neuron_p(pre: BNPPreconditioner, layer: ManagedLayer, index: int, *, centred: bool) -> Tensor:
    """BNP's P for output neuron ``index`` of ``layer`` (float64).

    A grouped convolution's neuron sees only its group's c_in/groups input channels, each repeated
    over the kernel volume (§4), or with ``conv_statistics="column"`` its group's c_in/groups·k im2col
    columns, one entry each (kernel volume 1 below). ``centred`` is false when the neuron has no (trainable) bias: then
    P = diag(1/σ̃), the block the transform applies to such a layer.
    """
    mu, var_t = statistics(pre, layer)
    out = layer.rows(layer.weight).shape[0]
    per_group = layer.features // layer.groups
    group = index // (out // layer.groups)
    sl = slice(group * per_group, (group + 1) * per_group)
    return M.neuron_preconditioner(mu[sl] if centred else None, var_t[sl], layer.fan_in // per_group)


def min_ratio(s: M.Spectrum) -> float:
    """λ_min / max|λ|, signed (NaN for the zero matrix)."""
    scale = max(abs(s.lambda_min), abs(s.lambda_max))
    return s.lambda_min / scale if scale > 0 else math.nan
