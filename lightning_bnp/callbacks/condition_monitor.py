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
  latest step; what a reader can read of κ that spans decades: ``bnp/hessian_log10_kappa/<layer>/original|
  preconditioned|gain`` (log10 κ, and log10 of the gain) and ``bnp/hessian_kappa_gain/<layer>`` (κ original /
  κ preconditioned of the same block at the same step, §5.1), which the TensorBoard layout charts first;
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
Each kind of metric has its private module: :mod:`._layer_kappas` (κ(D), weight κ), :mod:`._hessian_block`,
:mod:`._scale_invariance`, :mod:`._landscape` (landscape, Lanczos), :mod:`._pictures` (histograms, heatmaps);
the loss re-evaluation in :mod:`._probes`; the loggers and the TensorBoard layout in :mod:`._logging`; the argument
checks and the layer selection in :mod:`._monitor_setup`. This module decides when they run.
"""

from __future__ import annotations

from contextlib import ExitStack, nullcontext
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.seed import isolate_rng
from torch import Tensor, nn
from typing_extensions import override

from lightning_bnp.callbacks import _probes as probes
from lightning_bnp.callbacks._hessian_block import hessian_metrics
from lightning_bnp.callbacks._landscape import lanczos_metrics, landscape_metrics
from lightning_bnp.callbacks._layer_kappas import kappa_d_metrics, weight_kappa_metrics
from lightning_bnp.callbacks._logging import (
    chart,
    declare_layout,
    finite_metrics,
    has_tensorboard,
    layer_charts,
    log_metrics,
    log_tensorboard,
)
from lightning_bnp.callbacks._monitor_setup import check_arguments, hessian_layer_names, selected_layers
from lightning_bnp.callbacks._pictures import HeatmapHistory, bnp_histograms, finite_histograms
from lightning_bnp.callbacks._scale_invariance import find_scale_invariant, scale_invariance_metrics
from lightning_bnp.callbacks._strategy import shards_rows
from lightning_bnp.callbacks.bnp import BatchNormPreconditioning
from lightning_bnp.core.arguments_repr import ArgumentsRepr
from lightning_bnp.core.preconditioner import BNPPreconditioner

__all__ = ["ConditionNumberMonitor"]


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
        hessian_block: log the Hessian-block κ of one neuron per selected layer, also as log10 κ and as the
            gain κ original / κ preconditioned (TensorBoard charts these first: κ spans decades).
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
            singular values (min(out, in·k); a float64 SVD of 2000×2000 costs ~2 s), with a one-time warning.
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
            (``bnp/heatmap/kappa_D``, ``bnp/heatmap/weight_kappa``; titled, layers and steps on the axes, a colour
            bar in decades) on every 10th record (each holds the whole history, kept across checkpoint resume).

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
        flags = dict(kappa_d=kappa_d, hessian_block=hessian_block, weight_kappa=weight_kappa, effective_lr=effective_lr)
        flags.update(lanczos=lanczos, landscape=landscape, histograms=histograms, spectra=spectra, heatmaps=heatmaps)
        layers, hessian_layers, hessian_rtol, steps = check_arguments(
            every_n_steps=every_n_steps, layers=layers, hessian_layers=hessian_layers, neuron=neuron,
            hessian_precision=hessian_precision, hessian_rtol=hessian_rtol, max_hessian_size=max_hessian_size,
            max_weight_kappa_size=max_weight_kappa_size, lanczos_iters=lanczos_iters, landscape_steps=landscape_steps,
            landscape_direction=landscape_direction, flags=flags,
        )  # fmt: skip
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
        self._heatmaps = HeatmapHistory()  # the heatmaps' columns (kept across checkpoint resume)
        self._bnp: BatchNormPreconditioning | None = None
        self._layers: dict[str, nn.Module] = {}
        self._hessian_names: list[str] = []
        self._scale_invariant: dict[str, int] | None = None  # {layer: units}; None: not checked yet
        self._captured: list[probes.Captured] = []
        self._probe_batch: list[probes.Captured] | None = None
        self._step_at_start = -1
        self._interval = every_n_steps or 0  # resolved at setup: the Trainer's cadence when None; 0 = never
        self._in_dtype = probes.DtypeFallback()  # float64 re-evaluations, or the model's dtype once they fail
        self._warned: set[str] = set()
        self._reentrant = False  # a recorded step's loss went through reentrant activation checkpointing

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if shards_rows(trainer.strategy):
            raise RuntimeError(_NOT_UNDER_FSDP2)
        # set by Lightning's logger connector at Trainer init (not a declared attribute, hence the ignore)
        cadence: int = trainer.log_every_n_steps  # type: ignore[attr-defined]
        self._interval = self.every_n_steps if self.every_n_steps is not None else cadence
        if not self._interval:
            rank_zero_warn(_NEVER_RECORDS)
        bnps = [cb for cb in trainer.callbacks if isinstance(cb, BatchNormPreconditioning)]  # type: ignore[attr-defined]
        self._bnp = bnps[0] if bnps else None
        self._probe_batch = None
        self._reentrant = False
        if not trainer.loggers:
            rank_zero_warn("ConditionNumberMonitor: the Trainer has no logger, so nothing will be recorded.")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after `configure_model`, which may build the layers (Lightning calls it after every callback's `setup`)
        self._layers = selected_layers(pl_module, self.layers, self.hessian_layers)
        pre = self._bnp._attach(pl_module) if self._bnp is not None else None  # attached whatever the callback order
        if pre is None and (self.kappa_d or self.landscape_direction == "preconditioned"):
            rank_zero_info("ConditionNumberMonitor: no BatchNormPreconditioning callback; BNP metrics are skipped.")
        bnp = pre.layers if pre is not None else None
        self._hessian_names = hessian_layer_names(self._layers, bnp, self.hessian_layers)
        self._scale_invariant = None  # found numerically on the first record's batch (measure)
        needs_loss = (self.hessian_block and self._hessian_names) or self.lanczos or self.landscape or self.effective_lr
        if needs_loss and not pl_module.automatic_optimization:
            self._scale_invariant = {}
            rank_zero_warn(_MANUAL_OPTIMIZATION)
        bnp_layers = [n for n in (pre.layers if pre is not None else ()) if n in self._layers]
        declare_layout(trainer, _layout(self, bnp_layers if pre is not None else None))

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
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self._captured and not self._reentrant:  # a step to record: does its loss go through one?
            self._reentrant = probes.reentrant_checkpoint_in(loss)

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
                metrics.update(kappa_d_metrics(pre, self._layers))
            if self.weight_kappa:
                metrics.update(weight_kappa_metrics(self._layers, self.max_weight_kappa_size, self._warn_once))
        if not self._captured:
            return finite_metrics(metrics, self._warn_once)
        if self._reentrant:  # the probes' torch.autograd.grad cannot run through it
            self._warn_once("reentrant", probes.REENTRANT_CHECKPOINT)
            return finite_metrics(metrics, self._warn_once)
        if self._probe_batch is None and self.lanczos:  # the fixed probe batch: the first one measured
            self._probe_batch = [c.cloned() for c in self._captured]
        step = probes.ProbeStep(trainer, pl_module, self._captured, self._in_dtype)
        with ExitStack() as stack:
            # torch (CPU, every CUDA device), NumPy and Python `random`, restored on exit: Lightning's utility,
            # as exact as the hand-written fork_rng + NumPy/Python save it replaces (~0.05 ms more per record)
            stack.enter_context(isolate_rng())
            stack.enter_context(pre.paused() if pre is not None else nullcontext())
            stack.enter_context(probes.silenced_logging(pl_module))
            try:
                if self.effective_lr:
                    if self._scale_invariant is None:
                        self._scale_invariant = find_scale_invariant(step, self._layers)
                    metrics.update(scale_invariance_metrics(step, self._layers, self._scale_invariant, self._warned))
                if self.hessian_block and self._hessian_names:
                    metrics.update(self._hessian_metrics(step, pre))
                if self.landscape:
                    metrics.update(landscape_metrics(step, pre, self.landscape_steps, self.landscape_direction))
                if self.lanczos and self._probe_batch is not None:
                    fixed = probes.ProbeStep(trainer, pl_module, self._probe_batch, self._in_dtype)
                    metrics.update(lanczos_metrics(fixed, self.lanczos_iters))
            except probes.NoLoss:
                self._warn_once("no_loss", "`training_step` returned no loss tensor; probes skipped this step.")
        return finite_metrics(metrics, self._warn_once)

    def _hessian_metrics(self, step: probes.ProbeStep, pre: BNPPreconditioner | None) -> dict[str, float]:
        layers = {name: self._layers[name] for name in self._hessian_names}
        metrics, spectra = hessian_metrics(
            step,
            pre,
            layers,
            neuron=self.neuron,
            max_size=self.max_hessian_size,
            precision=self.hessian_precision,
            rtol=self.hessian_rtol,
            warn_once=self._warn_once,
        )
        if self.spectra:
            self._spectra.update(spectra)
        return metrics

    # ------------------------------------------------------------ pictures
    def _log_pictures(self, trainer: pl.Trainer, metrics: dict[str, float], step: int) -> None:
        """Histograms of σ̃, μ and of the Hessian spectra, and the κ heatmaps, to the TensorBoard loggers."""
        histograms: dict[str, Tensor] = dict(self._spectra)
        pre = self._pre()
        if self.histograms and pre is not None:
            histograms.update(bnp_histograms(pre, self._layers))
        images: dict[str, Tensor] = {}
        texts: dict[str, str] = {}
        if self.heatmaps:
            self._heatmaps.add(metrics, list(self._layers), step)
            images, texts = self._heatmaps.pictures(list(self._layers))
        log_tensorboard(trainer, finite_histograms(histograms, self._warn_once), images, texts, step)

    @property
    def _heat_steps(self) -> list[int]:
        """The heatmaps' columns: record steps (thinned beyond ``_heatmaps.KEEP``)."""
        return self._heatmaps.steps

    @override
    def state_dict(self) -> dict[str, Any]:
        return self._heatmaps.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._heatmaps.load_state_dict(state_dict)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(f"ConditionNumberMonitor: {message}")


# ----------------------------------------------------------------------------- helpers
_NOT_UNDER_FSDP2 = (
    "ConditionNumberMonitor is not supported under FSDP2 (ModelParallelStrategy): its probes (weight κ, neuron "
    "Hessians, Lanczos, landscape) need whole weight matrices, which each rank holds only a shard of. "
    "BatchNormPreconditioning, ZSpaceRegularization's weight decay and TimingMonitor work there; monitor the "
    "condition numbers in a DDP or single-device run."
)
_NEVER_RECORDS = (
    "ConditionNumberMonitor: `Trainer(log_every_n_steps=0)` turns logging off and `every_n_steps` is None, so nothing "
    "will be recorded; pass `every_n_steps` to record anyway."
)
_MANUAL_OPTIMIZATION = (
    "ConditionNumberMonitor: the Hessian, Lanczos and landscape probes and the scale-invariance check of the "
    "effective learning rate re-run `training_step`, which manual optimization does not allow; only κ(D) and weight "
    "κ are logged."
)


def _layout(monitor: ConditionNumberMonitor, bnp_layers: list[str] | None) -> dict[str, dict[str, list[str]]]:
    """Custom Scalars charts: a category per kind; in it a chart per layer overlaying its variants, or one chart of
    all layers for one-value kinds, and at most ``MAX_CHARTS`` charts of consecutive layers for a deep model
    (:func:`layer_charts`). The readable Hessian charts (log10 κ and the gain, κ spanning decades) come first; the
    raw κ charts stay for completeness. ``bnp_layers``: the selected BNP layers, ``None`` without BNP."""
    layout: dict[str, dict[str, list[str]]] = {}
    hessian = monitor._hessian_names
    if monitor.hessian_block:
        layout["bnp/hessian_log10_kappa"] = layer_charts("bnp", "hessian_log10_kappa", hessian)
        if bnp_layers is not None:
            gain = "κ original / κ preconditioned"
            layout["bnp/hessian_kappa_gain"] = layer_charts("bnp", "hessian_kappa_gain", hessian, title=gain)
    if monitor.kappa_d and bnp_layers is not None:
        layout["bnp/kappa_D"] = layer_charts("bnp", "kappa_D", bnp_layers, title="κ(D), raw statistics")
        layout["bnp/kappa_D_floored"] = layer_charts("bnp", "kappa_D_floored", bnp_layers, title="κ(D̃), floored σ̃")
    if monitor.hessian_block:
        for kind in ("hessian_kappa", "hessian_min_ratio"):
            layout[f"bnp/{kind}"] = layer_charts("bnp", kind, hessian)
        layout["bnp/hessian_rank"] = layer_charts("bnp", "hessian_rank", hessian, title="rank")
    layers = list(monitor._layers)
    if monitor.weight_kappa:
        layout["bnp/weight_kappa"] = layer_charts("bnp", "weight_kappa", layers)
    if monitor.effective_lr:  # the layers are found at the first record: charts for every candidate
        layout["bnp/effective_lr"] = {
            **layer_charts("bnp", "effective_lr", layers, title="η/‖w‖²"),
            **layer_charts("bnp", "weight_norm_sq", layers, title="‖w‖²"),
            **layer_charts("bnp", "weight_grad_cosine", layers, title="cos∠(w, ∇w)"),
        }
    if monitor.lanczos:
        layout["bnp/lanczos"] = {"λ_min, λ_max": [chart("bnp", "lanczos")]}
    if monitor.landscape:
        keys = ("loss_range", "grad_change", "beta_smoothness")
        layout["bnp/landscape"] = {k: [chart("bnp", "landscape", k, variants=False)] for k in keys}
    return {category: charts for category, charts in layout.items() if charts}
