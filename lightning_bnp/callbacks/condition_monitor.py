"""Condition numbers and landscape probes in the Trainer's logger (paper 000 §3.3, §5.1 Fig. 8; 003 §3.2; 002 §2).

Every ``every_n_steps`` optimizer steps (steps 0, n, 2n, … counted from 0; by default n is the Trainer's
``log_every_n_steps``, as for Lightning's ``LearningRateMonitor``) this callback logs, after
the step (``on_train_batch_end``), with :mod:`lightning_bnp.core.metrics`:

* ``bnp/kappa_D/<layer>`` — the paper's κ(D), D = diag(1, σ)⁻¹ of the raw input statistics of the P
  BNP applied in its latest step (§5.1, Fig. 8), and ``bnp/kappa_D_floored/<layer>`` — max σ̃ / min σ̃
  of the floored σ̃ that BNP divides by (≤ √((1 + ε1)/ε1) ≈ 10 by construction); layers BNP did not
  transform in that step log neither;
* ``bnp/hessian_kappa/<layer>/original|preconditioned``, ``bnp/hessian_min_ratio/…`` (λ_min / max|λ|)
  and ``bnp/hessian_rank/<layer>`` — the exact Hessian of the step's loss with respect to one output
  neuron's ŵ = [b_i; w_i] (Prop. 2), and Pᵀ∇²L P with BNP's P (Theorem 3) from the σ̃, μ of BNP's
  latest step;
* ``bnp/weight_kappa/<layer>/raw`` (and ``/conditioned`` for parametrized, e.g. Weight-Conditioned, layers);
* ``bnp/effective_lr/<layer>`` — η/‖w‖² of scale-invariant weights (paper 002), found by scaling each
  layer's units on the first record's batch; ``bnp/weight_norm_sq/<layer>`` (‖w‖², which SGD only grows) and
  ``bnp/weight_grad_cosine/<layer>`` (cos∠(w, ∇w), 0 for scale-invariant w: Lemma 2.4);
* optionally ``bnp/lanczos/lambda_min|lambda_max`` (whole model, fixed probe batch) and
  ``bnp/landscape/loss_range|grad_change|beta_smoothness`` (paper 003, App. A.2.2).

Measuring never changes training: the step's loss is re-evaluated by calling ``training_step`` on the
step's batches through ``torch.func.functional_call`` on detached copies of the parameters and cloned
buffers (gradients come from ``torch.autograd.grad``, never ``.grad``), with BNP's statistics paused,
``self.log`` silenced, and the torch (CPU, CUDA), NumPy and Python random states restored afterwards
(each re-run starts from the torch state the step's forward had, so dropout masks match). Metric
objects that ``training_step`` updates (e.g. torchmetrics) are updated again by the probes.
Helpers live in :mod:`._probes`; tags and the TensorBoard layout in :mod:`._logging`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from fnmatch import fnmatchcase
from typing import Any, Literal, Optional, TypeVar, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.seed import isolate_rng
from torch import Tensor, nn
from torch.nn.utils import parametrize
from typing_extensions import override

from lightning_bnp.callbacks import _probes as probes
from lightning_bnp.callbacks._logging import (
    chart,
    declare_layout,
    has_tensorboard,
    heatmap_image,
    layer_charts,
    log_metrics,
    log_tensorboard,
)
from lightning_bnp.callbacks._strategy import shards_rows
from lightning_bnp.callbacks.bnp import BatchNormPreconditioning
from lightning_bnp.core import metrics as M
from lightning_bnp.core.arguments_repr import ArgumentsRepr
from lightning_bnp.core.layers import NO_LEAF
from lightning_bnp.core.preconditioner import BNPPreconditioner
from lightning_bnp.core.validation import check_bool, check_choice, check_float, check_int, check_patterns

__all__ = ["ConditionNumberMonitor"]

_T = TypeVar("_T")


class ConditionNumberMonitor(ArgumentsRepr, Callback):
    """Log κ(D) (raw and floored), exact Hessian-block κ (original and BNP-preconditioned), weight κ,
    effective learning rates and, optionally, Lanczos extremes and paper 003's landscape probes. A value
    that cannot be computed (inf, NaN) is not logged; a one-time warning per tag says so.

    .. math::
        κ(∇^2_{\\hat w} L) = \\frac{\\max|λ|}{\\min_{|λ| > τ \\max|λ|} |λ|}, \\qquad
        ∇^2_z L = P^T ∇^2_{\\hat w} L\\, P

    Args:
        every_n_steps: log after optimizer steps 0, n, 2n, … (≥ 1); ``None`` (default): the Trainer's
            ``log_every_n_steps`` (50 by default), like Lightning's ``LearningRateMonitor``; with
            ``Trainer(log_every_n_steps=0)`` nothing is recorded then.
        layers: glob patterns of Linear/ConvNd module names for the per-layer metrics (all when ``None``).
        kappa_d: log κ(D) (the paper's, from the raw statistics) and κ(D̃) (floored) of each BNP layer.
        hessian_block: log the Hessian-block κ of one neuron per selected layer.
        hessian_layers: glob patterns of the layers whose neuron Hessian is computed; ``None``: the
            last BNP layer (the output layer of the paper's Fig. 8), or the last Linear/ConvNd without BNP.
        neuron: which output neuron (conv: output channel); taken modulo the layer's outputs.
        hessian_precision: ``"float64"`` (the loss is re-evaluated in float64, autocast off, so κ up to
            ~1e13 is resolved) or ``"model"`` (the model's dtype and autocast; κ beyond ~1e5 is noise in float32).
        hessian_rtol: |λ| below ``hessian_rtol``·max|λ| count as zero (default: n·eps of the Hessian's dtype).
        max_hessian_size: skip layers whose neuron has more than this many parameters (1 + fan-in),
            with a one-time warning per layer.
        weight_kappa: log κ of each weight matrix (raw and, when parametrized, conditioned).
        max_weight_kappa_size: skip the weight κ of layers whose (out, in·k) view has more than this many
            singular values (min(out, in·k)), with a one-time warning per layer: a float64 SVD of a
            1000×2048 head costs ~0.6 s per record on one CPU core, 2000×2000 ~2 s.
        effective_lr: find the scale-invariant layers numerically on the first record's batch
            (``metrics.scale_invariant_units``) and log their η/‖w‖² (SGD only), ‖w‖² and cos∠(w, ∇w) (paper 002).
        lanczos: log the extreme Hessian eigenvalues of all trainable parameters on a fixed probe batch.
        lanczos_iters: Lanczos steps (one Hessian-vector product each).
        landscape: log paper 003's loss range, gradient change and effective β-smoothness.
        landscape_steps: step multiples k; the probe visits θ − k·η·d (default [0.5, 1, 2, 3, 4], the
            paper's [1/2, 4] range for VGG).
        landscape_direction: d = ∇L (``"gradient"``, paper 003) or BNP's M·∇L (``"preconditioned"``).
        histograms: TensorBoard only: histograms of σ̃ and μ of each BNP layer's latest step
            (``bnp/sigma_tilde/<layer>``, ``bnp/mu/<layer>``).
        spectra: TensorBoard only: histograms of log10|λ| of the Hessian block's nonzero eigenvalues,
            original and preconditioned (``bnp/hessian_spectrum/<layer>/original|preconditioned``).
        heatmaps: TensorBoard only: layer × record-step images of log10 κ(D) and log10 weight κ
            (``bnp/heatmap/kappa_D``, ``bnp/heatmap/weight_kappa``) on every 10th record (each holds the whole
            history, which is kept across checkpoint resume).

    Raises:
        ValueError: an argument is out of range; (at setup) a pattern matches no Linear/ConvNd layer.

    Example::

        Trainer(callbacks=[BatchNormPreconditioning(), ConditionNumberMonitor(every_n_steps=100)])
    """

    def __init__(
        self,
        *,
        every_n_steps: Optional[int] = None,
        layers: Union[list[str], str, None] = None,
        kappa_d: bool = True,
        hessian_block: bool = True,
        hessian_layers: Union[list[str], str, None] = None,
        neuron: int = 0,
        hessian_precision: Literal["float64", "model"] = "float64",
        hessian_rtol: Optional[float] = None,
        max_hessian_size: int = 1024,
        weight_kappa: bool = True,
        max_weight_kappa_size: int = 512,
        effective_lr: bool = True,
        lanczos: bool = False,
        lanczos_iters: int = 20,
        landscape: bool = False,
        landscape_steps: Optional[list[float]] = None,
        landscape_direction: Literal["gradient", "preconditioned"] = "gradient",
        histograms: bool = True,
        spectra: bool = True,
        heatmaps: bool = True,
    ) -> None:
        if every_n_steps is not None:
            check_int("every_n_steps", every_n_steps, low=1)
        for name, value, low in (
            ("neuron", neuron, 0),
            ("max_hessian_size", max_hessian_size, 1),
            ("max_weight_kappa_size", max_weight_kappa_size, 1),
            ("lanczos_iters", lanczos_iters, 1),
        ):
            check_int(name, value, low=low)
        layers, hessian_layers = check_patterns("layers", layers), check_patterns("hessian_layers", hessian_layers)
        for name, flag in (
            ("kappa_d", kappa_d),
            ("hessian_block", hessian_block),
            ("weight_kappa", weight_kappa),
            ("effective_lr", effective_lr),
            ("lanczos", lanczos),
            ("landscape", landscape),
            ("histograms", histograms),
            ("spectra", spectra),
            ("heatmaps", heatmaps),
        ):
            check_bool(name, flag)
        check_choice("hessian_precision", hessian_precision, ("float64", "model"))
        if hessian_rtol is not None:
            hessian_rtol = check_float("hessian_rtol", hessian_rtol, low=0.0, high=1.0, low_open=True, high_open=True)
        steps = [0.5, 1.0, 2.0, 3.0, 4.0] if landscape_steps is None else _step_multiples(landscape_steps)
        check_choice("landscape_direction", landscape_direction, ("gradient", "preconditioned"))
        if not (kappa_d or hessian_block or weight_kappa or effective_lr or lanczos or landscape):
            raise ValueError("every metric is switched off (`kappa_d`, `hessian_block`, ...): nothing to log")
        self.every_n_steps, self.neuron = every_n_steps, neuron
        self.layers, self.hessian_layers = layers, hessian_layers
        self.kappa_d, self.hessian_block, self.weight_kappa = kappa_d, hessian_block, weight_kappa
        self.hessian_precision, self.hessian_rtol = hessian_precision, hessian_rtol
        self.max_hessian_size, self.effective_lr = max_hessian_size, effective_lr
        self.max_weight_kappa_size = max_weight_kappa_size
        self.lanczos, self.lanczos_iters = lanczos, lanczos_iters
        self.landscape, self.landscape_steps, self.landscape_direction = landscape, steps, landscape_direction
        self.histograms, self.spectra, self.heatmaps = histograms, spectra, heatmaps
        self._spectra: dict[str, Tensor] = {}  # log10|λ| of the latest record's Hessian blocks
        self._heat_steps: list[int] = []  # the heatmaps' columns: record steps (thinned beyond _HEAT_KEEP)
        self._heat: dict[str, dict[str, list[float]]] = {}  # kind → layer → log10 value per column (NaN: none)
        self._legend_written = False
        self._heat_records = 0  # records seen by this instance (the images are written on every _HEAT_EVERY-th)
        self._bnp: BatchNormPreconditioning | None = None
        self._layers: dict[str, nn.Module] = {}
        self._hessian_names: list[str] = []
        self._scale_invariant: dict[str, int] | None = None  # {layer: units}; None: not checked yet
        self._captured: list[probes.Captured] = []
        self._probe_batch: list[probes.Captured] | None = None
        self._step_at_start = -1
        self._interval = every_n_steps or 0  # resolved at setup: the Trainer's cadence when None; 0 = never
        self._failed_dtypes: set[torch.dtype] = set()
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if shards_rows(trainer.strategy):
            raise RuntimeError(
                "ConditionNumberMonitor is not supported under FSDP2 (ModelParallelStrategy): its probes (weight "
                "κ, neuron Hessians, Lanczos, landscape) need whole weight matrices, which each rank holds only a "
                "shard of. BatchNormPreconditioning, ZSpaceRegularization's weight decay and TimingMonitor work "
                "there; monitor the condition numbers in a DDP or single-device run."
            )
        # set by Lightning's logger connector at Trainer init (not a declared attribute, hence the ignore)
        cadence: int = trainer.log_every_n_steps  # type: ignore[attr-defined]
        self._interval = self.every_n_steps if self.every_n_steps is not None else cadence
        if not self._interval:
            rank_zero_warn(
                "ConditionNumberMonitor: `Trainer(log_every_n_steps=0)` turns logging off and `every_n_steps` is "
                "None, so nothing will be recorded; pass `every_n_steps` to record anyway."
            )
        bnps = [cb for cb in trainer.callbacks if isinstance(cb, BatchNormPreconditioning)]  # type: ignore[attr-defined]
        self._bnp = bnps[0] if bnps else None
        self._probe_batch = None
        if not trainer.loggers:
            rank_zero_warn("ConditionNumberMonitor: the Trainer has no logger, so nothing will be recorded.")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after `configure_model`, which may build the layers (Lightning calls it after every callback's `setup`)
        candidates = {name: m for name, m in pl_module.named_modules() if probes.is_neuron_layer(m)}
        for arg, patterns in (("layers", self.layers), ("hessian_layers", self.hessian_layers)):
            for pattern in patterns or ():
                if not any(fnmatchcase(name, pattern) for name in candidates):
                    raise ValueError(
                        f"`{arg}` pattern {pattern!r} matches no Linear/ConvNd layer; "
                        f"candidates are {sorted(candidates)}"
                    )
        self._layers = {n: m for n, m in candidates.items() if _matches(n, self.layers)}
        pre = self._bnp._attach(pl_module) if self._bnp is not None else None  # attached whatever the callback order
        if pre is None and (self.kappa_d or self.landscape_direction == "preconditioned"):
            rank_zero_info("ConditionNumberMonitor: no BatchNormPreconditioning callback; BNP metrics are skipped.")
        base = [n for n in (pre.layers if pre is not None else self._layers) if n in self._layers]
        if self.hessian_layers is None:
            self._hessian_names = base[-1:]
        else:
            self._hessian_names = [n for n in base if _matches(n, self.hessian_layers)]
        self._scale_invariant = None  # found numerically on the first record's batch (measure)
        needs_loss = (self.hessian_block and self._hessian_names) or self.lanczos or self.landscape or self.effective_lr
        if needs_loss and not pl_module.automatic_optimization:
            self._scale_invariant = {}
            rank_zero_warn(
                "ConditionNumberMonitor: the Hessian, Lanczos and landscape probes and the scale-invariance check of "
                "the effective learning rate re-run `training_step`, which manual optimization does not allow; "
                "only κ(D) and weight κ are logged."
            )
        declare_layout(trainer, self._layout(pre))

    def _layout(self, pre: BNPPreconditioner | None) -> dict[str, dict[str, list[str]]]:
        """Custom Scalars charts: a category per kind; in it a chart per layer overlaying its variants, or one
        chart of all layers for one-value kinds, and at most ``MAX_CHARTS`` charts of consecutive layers for a
        deep model (:func:`layer_charts`)."""
        layout: dict[str, dict[str, list[str]]] = {}
        bnp_layers = [n for n in (pre.layers if pre is not None else ()) if n in self._layers]
        if self.kappa_d and pre is not None:
            layout["bnp/kappa_D"] = layer_charts("bnp", "kappa_D", bnp_layers, title="κ(D), raw statistics")
            layout["bnp/kappa_D_floored"] = layer_charts("bnp", "kappa_D_floored", bnp_layers, title="κ(D̃), floored σ̃")
        if self.hessian_block:
            for kind in ("hessian_kappa", "hessian_min_ratio"):
                layout[f"bnp/{kind}"] = layer_charts("bnp", kind, self._hessian_names)
            layout["bnp/hessian_rank"] = layer_charts("bnp", "hessian_rank", self._hessian_names, title="rank")
        if self.weight_kappa:
            layout["bnp/weight_kappa"] = layer_charts("bnp", "weight_kappa", list(self._layers))
        if self.effective_lr:  # the layers are found at the first record: charts for every candidate
            layout["bnp/effective_lr"] = {
                **layer_charts("bnp", "effective_lr", list(self._layers), title="η/‖w‖²"),
                **layer_charts("bnp", "weight_norm_sq", list(self._layers), title="‖w‖²"),
                **layer_charts("bnp", "weight_grad_cosine", list(self._layers), title="cos∠(w, ∇w)"),
            }
        if self.lanczos:
            layout["bnp/lanczos"] = {"λ_min, λ_max": [chart("bnp", "lanczos")]}
        if self.landscape:
            keys = ("loss_range", "grad_change", "beta_smoothness")
            layout["bnp/landscape"] = {k: [chart("bnp", "landscape", k, variants=False)] for k in keys}
        return {category: charts for category, charts in layout.items() if charts}

    def _records(self, step: int) -> bool:
        """Whether optimizer step ``step`` (counted from 0) is a record step: 0, n, 2n, …"""
        return self._interval > 0 and step % self._interval == 0

    def _pre(self) -> BNPPreconditioner | None:
        return self._bnp.preconditioner if self._bnp is not None else None

    def _needs_batch(self, pl_module: pl.LightningModule) -> bool:
        scale_invariance = self.effective_lr and (self._scale_invariant is None or bool(self._scale_invariant))
        wanted = (self.hessian_block and bool(self._hessian_names)) or self.lanczos or self.landscape
        return (wanted or scale_invariance) and pl_module.automatic_optimization

    # ------------------------------------------------------------- the batch
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step != self._step_at_start:
            self._captured.clear()
        self._step_at_start = step
        if self._records(step) and self._needs_batch(pl_module):
            cuda = torch.cuda.get_rng_state(pl_module.device) if pl_module.device.type == "cuda" else None
            self._captured.append(probes.Captured(batch, batch_idx, torch.get_rng_state(), cuda))

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = self._step_at_start
        if trainer.global_step == step or not self._records(step):
            return  # no optimizer step in this batch (accumulation), or not a logging step
        if trainer.loggers:
            self._spectra = {}
            metrics = self.measure(trainer, pl_module)
            log_metrics(trainer, metrics, step)
            if has_tensorboard(trainer):
                self._log_pictures(trainer, metrics, step)
        self._captured.clear()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._captured.clear()

    # ------------------------------------------------------------ measuring
    def measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, float]:
        """All enabled metrics for the current state (and the captured batches), without side effects."""
        metrics: dict[str, float] = {}
        pre = self._pre()
        with torch.no_grad():
            if self.kappa_d and pre is not None:
                for name, layer in pre.layers.items():
                    # a layer BNP did not transform in the latest step has no D (e.g. nn.MultiheadAttention's
                    # out_proj, whose forward never runs): logging its initial σ² = 1 would read "κ = 1"
                    if name in self._layers and layer.transform is not None:
                        var, mu, rtol = probes.raw_statistics(pre, layer)
                        metrics[f"bnp/kappa_D/{name}"] = M.kappa_d(var, mu, bias_entry=mu is not None, rtol=rtol)
                        metrics[f"bnp/kappa_D_floored/{name}"] = M.sigma_ratio(layer.transform.var_t)
            if self.weight_kappa:
                for name, module in self._layers.items():
                    weight = probes.trainable_weight(module)
                    if weight is NO_LEAF:  # reparametrized in a way BNP leaves alone: κ of the weight in use
                        weight = module.weight  # type: ignore[assignment]
                    size = min(weight.shape[0], weight[0].numel())  # singular values of the (out, in·k) view
                    if size > self.max_weight_kappa_size:
                        self._warn_once(
                            f"weight_size:{name}",
                            f"layer {name!r}: weight κ skipped, its (out, in·k) view has {size} singular values "
                            f"> `max_weight_kappa_size`={self.max_weight_kappa_size} (an SVD of that size per record "
                            "is too slow; raise the limit to log it)",
                        )
                        continue
                    metrics[f"bnp/weight_kappa/{name}/raw"] = M.matrix_kappa(weight)
                    if parametrize.is_parametrized(module, "weight"):
                        metrics[f"bnp/weight_kappa/{name}/conditioned"] = M.matrix_kappa(module.weight)  # type: ignore[arg-type]
        if not self._captured:
            return self._finite(metrics)
        if self._probe_batch is None and self.lanczos:  # the fixed probe batch: the first one measured
            self._probe_batch = [c.cloned() for c in self._captured]
        with ExitStack() as stack:
            # torch (CPU, every CUDA device), NumPy and Python `random`, restored on exit: Lightning's utility,
            # as exact as the hand-written fork_rng + NumPy/Python save it replaces (~0.05 ms more per record)
            stack.enter_context(isolate_rng())
            stack.enter_context(pre.paused() if pre is not None else nullcontext())
            stack.enter_context(probes.silenced_logging(pl_module))
            try:
                if self.effective_lr:
                    metrics.update(self._scale_invariance_metrics(trainer, pl_module))
                if self.hessian_block and self._hessian_names:
                    metrics.update(self._hessian_metrics(trainer, pl_module, pre))
                if self.landscape:
                    metrics.update(self._landscape_metrics(trainer, pl_module, pre))
                if self.lanczos and self._probe_batch is not None:
                    metrics.update(self._lanczos_metrics(trainer, pl_module))
            except probes.NoLoss:
                self._warn_once("no_loss", "`training_step` returned no loss tensor; probes skipped this step.")
        return self._finite(metrics)

    def _finite(self, metrics: dict[str, float]) -> dict[str, float]:
        """Drop values that could not be computed (inf, NaN: e.g. the κ of a zero Hessian block, κ(D) with no
        live unit, the κ of a singular weight), with a one-time warning per tag; loggers never see them."""
        for tag, value in metrics.items():
            if not math.isfinite(value):
                self._warn_once(f"finite:{tag}", f"{tag} = {value} cannot be computed at this step; not logged.")
        return {tag: value for tag, value in metrics.items() if math.isfinite(value)}

    def _in_dtype(self, dtype: torch.dtype | None, compute: Callable[[torch.dtype | None], _T]) -> _T:
        """``compute(dtype)`` (parameters, buffers and batch cast to ``dtype``, autocast off), or ``compute(None)``
        (the model's dtype and autocast) when ``dtype`` is ``None`` or a re-evaluation in it has failed."""
        if dtype is not None and dtype not in self._failed_dtypes:
            try:
                return compute(dtype)
            except RuntimeError as err:  # e.g. `training_step` builds float32 tensors: use the model's dtype
                self._failed_dtypes.add(dtype)
                rank_zero_warn(
                    f"ConditionNumberMonitor: {dtype} re-evaluation failed ({err}); using the model's dtype."
                )
        return compute(None)

    def _scale_invariance_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, float]:
        """Paper 002: η/‖w‖² (SGD only), ‖w‖² and cos∠(w, ∇w) of the scale-invariant layers, which are found
        numerically on the first record's batch (:func:`M.scale_invariant_units`). Both re-evaluations run in
        float32 without autocast: the check's tolerance (1e-3) and a cosine near 0 need no more, and float64
        convolutions are ~20× slower on CPU."""
        names = {id(p): n for n, p in pl_module.named_parameters()}

        def keys(module: nn.Module) -> tuple[str, str | None]:
            bias = module.bias if isinstance(module.bias, Tensor) and module.bias.requires_grad else None
            return names[id(probes.trainable_weight(module))], names[id(bias)] if bias is not None else None

        candidates = {n: keys(m) for n, m in self._layers.items() if probes.trainable_weight(m).requires_grad}
        if self._scale_invariant is None:

            def find(dtype: torch.dtype | None) -> dict[str, int]:
                loss = probes.StepLoss(trainer, pl_module, self._captured, dtype)
                layers = {
                    n: (kw, loss.params[kw], kb, loss.params[kb] if kb is not None else None)
                    for n, (kw, kb) in candidates.items()
                }
                return M.scale_invariant_units(loss.outputs, layers, agree=lambda ok: _everywhere(trainer, ok))

            self._scale_invariant = self._in_dtype(torch.float32, find)
            rank_zero_info(
                f"ConditionNumberMonitor: scale-invariant layers (paper 002), checked on step "
                f"{trainer.global_step - 1}'s batch: {sorted(self._scale_invariant) or 'none'}"
            )
        if not self._scale_invariant:
            return {}

        def gradients(dtype: torch.dtype | None) -> dict[str, Tensor]:
            loss = probes.StepLoss(trainer, pl_module, self._captured, dtype)
            wanted = {k for n in self._scale_invariant or () for k in candidates[n] if k is not None}
            return M.loss_and_grad(loss, {k: loss.params[k] for k in wanted})[1]

        grads = self._in_dtype(torch.float32, gradients)
        lrs = probes.learning_rates(trainer, sgd_only=True)  # η/‖w‖² is (S)GD's effective rate (paper 002)
        metrics: dict[str, float] = {}
        for name, units in self._scale_invariant.items():
            module, (key_w, key_b) = self._layers[name], candidates[name]
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
                metrics[f"bnp/effective_lr/{name}"] = M.effective_learning_rate(weight, bias, lrs[id(weight)], units)
            elif "effective_lr_sgd" not in self._warned:
                self._warned.add("effective_lr_sgd")
                rank_zero_info(
                    "ConditionNumberMonitor: η/‖w‖² is the effective learning rate of (S)GD (paper 002); it is not "
                    "logged for scale-invariant layers that a non-SGD optimizer (e.g. Adam) trains (their ‖w‖² and "
                    "cos∠(w, ∇w) are)."
                )
        return metrics

    def _hessian_metrics(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, pre: BNPPreconditioner | None
    ) -> dict[str, float]:
        names = {id(p): n for n, p in pl_module.named_parameters()}
        blocks, used = [], []
        for name in self._hessian_names:
            module = self._layers[name]
            out, fan_in = int(module.weight.shape[0]), int(module.weight[0].numel())  # type: ignore[index]
            bias = module.bias if isinstance(module.bias, Tensor) and module.bias.requires_grad else None
            if fan_in + (bias is not None) > self.max_hessian_size:
                self._warn_once(
                    f"size:{name}",
                    f"layer {name!r}: Hessian block skipped, its neuron has {fan_in + (bias is not None)} "
                    f"parameters > `max_hessian_size`={self.max_hessian_size}",
                )
                continue
            if self.neuron >= out:
                self._warn_once(f"neuron:{name}", f"`neuron`={self.neuron} >= {out} outputs of {name!r}: modulo")
            key_b = names[id(bias)] if bias is not None else None
            blocks.append((names[id(probes.trainable_weight(module))], key_b, self.neuron % out))
            used.append(name)

        def hessians(dtype: torch.dtype | None) -> list[Tensor]:
            loss = probes.StepLoss(trainer, pl_module, self._captured, dtype)
            return M.neuron_hessians(
                loss,
                [
                    M.NeuronBlock(kw, loss.params[kw], kb, loss.params[kb] if kb is not None else None, i)
                    for kw, kb, i in blocks
                ],
            )

        metrics: dict[str, float] = {}
        dtype = torch.float64 if self.hessian_precision == "float64" else None
        for name, (_, key_b, index), h in zip(used, blocks, self._in_dtype(dtype, hessians)):
            original = M.spectrum(h, self.hessian_rtol)
            self._keep_spectrum(f"bnp/hessian_spectrum/{name}/original", original)
            metrics[f"bnp/hessian_kappa/{name}/original"] = original.kappa
            metrics[f"bnp/hessian_min_ratio/{name}/original"] = probes.min_ratio(original)
            metrics[f"bnp/hessian_rank/{name}"] = float(original.rank)
            if pre is not None and name in pre.layers:
                p = probes.neuron_p(pre, pre.layers[name], index, centred=key_b is not None).to(h.device)
                conditioned = M.spectrum(
                    p.T @ h.double() @ p, self.hessian_rtol or h.shape[0] * torch.finfo(h.dtype).eps
                )
                self._keep_spectrum(f"bnp/hessian_spectrum/{name}/preconditioned", conditioned)
                metrics[f"bnp/hessian_kappa/{name}/preconditioned"] = conditioned.kappa
                metrics[f"bnp/hessian_min_ratio/{name}/preconditioned"] = probes.min_ratio(conditioned)
        return metrics

    def _keep_spectrum(self, tag: str, spectrum: M.Spectrum) -> None:
        if self.spectra and spectrum.rank > 0:
            self._spectra[tag] = spectrum.nonzero.log10()

    # ------------------------------------------------------------ pictures
    def _log_pictures(self, trainer: pl.Trainer, metrics: dict[str, float], step: int) -> None:
        """Histograms of σ̃, μ and of the Hessian spectra, and the κ heatmaps, to the TensorBoard loggers."""
        histograms: dict[str, Tensor] = dict(self._spectra)
        pre = self._pre()
        if self.histograms and pre is not None:
            for name, layer in pre.layers.items():
                if name in self._layers and layer.transform is not None:  # as κ(D): layers BNP transformed
                    histograms[f"bnp/sigma_tilde/{name}"] = layer.transform.var_t.sqrt()
                    if layer.transform.mu is not None:
                        histograms[f"bnp/mu/{name}"] = layer.transform.mu
        for tag in [t for t, values in histograms.items() if not bool(values.isfinite().all())]:
            self._warn_once(f"finite:{tag}", f"{tag} has non-finite values at this step; histogram not logged.")
            del histograms[tag]
        images: dict[str, Tensor] = {}
        texts: dict[str, str] = {}
        if self.heatmaps:
            self._record_heat(metrics, step)
            self._heat_records += 1
            # the image holds the whole history, so writing it on every 10th record (and the first) loses nothing
            # but latency; rendering and PNG-encoding both on every record cost ~5 ms (digits FC, CPU)
            heat = self._heat.items() if (self._heat_records - 1) % _HEAT_EVERY == 0 else ()
            for kind, rows in heat:
                names = [name for name in self._layers if name in rows]
                if not names:
                    continue
                images[f"bnp/heatmap/{kind}"] = heatmap_image(torch.tensor([rows[n] for n in names]))
                if not self._legend_written:
                    texts[f"bnp/heatmap/{kind}"] = _legend(kind, names)
            self._legend_written = self._legend_written or bool(texts)
        log_tensorboard(trainer, histograms, images, texts, step)

    def _record_heat(self, metrics: dict[str, float], step: int) -> None:
        """Add this record's column (log10 κ(D), log10 raw weight κ per layer) to the heatmaps' history."""
        column = {
            kind: {name: math.log10(metrics[tag]) for name in self._layers if (tag := pattern.format(name)) in metrics}
            for kind, pattern in (("kappa_D", "bnp/kappa_D/{}"), ("weight_kappa", "bnp/weight_kappa/{}/raw"))
        }
        self._heat_steps.append(step)
        for kind, values in column.items():
            rows = self._heat.setdefault(kind, {}) if values else self._heat.get(kind, {})
            for name in values.keys() - rows.keys():
                rows[name] = [math.nan] * (len(self._heat_steps) - 1)
            for name, row in rows.items():
                row.append(values.get(name, math.nan))
        if len(self._heat_steps) > _HEAT_KEEP:  # keep every other column (and the newest): bounded memory
            keep = [*range(0, len(self._heat_steps) - 1, 2), len(self._heat_steps) - 1]
            self._heat_steps = [self._heat_steps[i] for i in keep]
            for rows in self._heat.values():
                for name, row in rows.items():
                    rows[name] = [row[i] for i in keep]

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"heat_steps": list(self._heat_steps), "heat": {k: dict(v) for k, v in self._heat.items()}}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._heat_steps = list(state_dict.get("heat_steps", []))
        self._heat = {k: dict(v) for k, v in state_dict.get("heat", {}).items()}

    def _landscape_metrics(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, pre: BNPPreconditioner | None
    ) -> dict[str, float]:
        loss = probes.StepLoss(trainer, pl_module, self._captured, None)
        lrs = probes.learning_rates(trainer)
        named = {n: p for n, p in pl_module.named_parameters() if p.requires_grad and id(p) in lrs}
        by_id = {id(p): n for n, p in named.items()}

        def direction_of(grads: dict[str, Tensor]) -> dict[str, Tensor]:
            if self.landscape_direction == "preconditioned" and pre is not None:
                for layer in pre.layers.values():  # d = M·∇L with the M of BNP's latest step
                    if layer.transform is not None and id(layer.weight) in by_id:
                        vec_b = grads.get(by_id.get(id(layer.bias), "")) if layer.bias is not None else None
                        layer.transform.apply_(grads[by_id[id(layer.weight)]], vec_b)
            return {n: g * lrs[id(named[n])] for n, g in grads.items()}

        params = {n: loss.params[n] for n in named}
        result = M.landscape_probe(loss, params, direction_of, self.landscape_steps)
        return {
            "bnp/landscape/loss_range": result.loss_range,
            "bnp/landscape/grad_change": result.grad_change,
            "bnp/landscape/beta_smoothness": result.beta_smoothness,
        }

    def _lanczos_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, float]:
        assert self._probe_batch is not None
        loss = probes.StepLoss(trainer, pl_module, self._probe_batch, None)
        params = {n: loss.params[n] for n, p in pl_module.named_parameters() if p.requires_grad}
        lam_min, lam_max = M.hessian_extremes(loss, params, self.lanczos_iters)
        return {"bnp/lanczos/lambda_min": lam_min, "bnp/lanczos/lambda_max": lam_max}

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(f"ConditionNumberMonitor: {message}")


# ----------------------------------------------------------------------------- helpers
def _step_multiples(value: Any) -> list[float]:
    """``landscape_steps`` as floats: a non-empty list of finite numbers > 0."""
    message = f"`landscape_steps` must be a non-empty list of finite numbers > 0, got {value!r}"
    if not isinstance(value, (list, tuple)):
        raise TypeError(message)
    if not value:
        raise ValueError(message)
    try:
        return [check_float("landscape_steps", k, low=0.0, low_open=True) for k in value]
    except (TypeError, ValueError) as err:
        raise type(err)(message) from None


_HEAT_EVERY = 10  # heatmap images are written on records 1, 11, 21, … of a fit
_HEAT_KEEP = 512  # heatmap columns kept; the image shows at most 256 of them, evenly spaced

_HEAT_TITLES = {"kappa_D": "log10 κ(D) (raw input statistics, paper 000 §5.1)", "weight_kappa": "log10 weight κ (raw)"}


def _legend(kind: str, rows: list[str]) -> str:
    """The text next to a heatmap in TensorBoard: what its rows, columns and colours are."""
    names = ", ".join(f"`{name}`" for name in rows)
    return (
        f"**{_HEAT_TITLES[kind]}**: one row per layer, top to bottom: {names}. One column per record step, left to "
        "right (at most 256, evenly spaced). Colour: viridis over whole decades, the exponent on the bar at the "
        "right; grey: no value."
    )


def _everywhere(trainer: pl.Trainer, ok: bool) -> bool:
    """``ok`` on every process (one all-reduce under DDP), so that every rank takes the same branch."""
    if trainer.world_size == 1:
        return ok
    failed = trainer.strategy.reduce(torch.tensor(float(not ok), device=trainer.strategy.root_device), reduce_op="sum")
    return float(failed) == 0.0


def _matches(name: str, patterns: list[str] | None) -> bool:
    return patterns is None or any(fnmatchcase(name, p) for p in patterns)
