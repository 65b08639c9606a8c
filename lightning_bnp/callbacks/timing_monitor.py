"""Step time, BNP's own cost and throughput in the Trainer's logger (paper 000, Table 1 measures the same cost).

Every ``every_n_steps`` optimizer steps (default: the Trainer's ``log_every_n_steps``, as Lightning's
``LearningRateMonitor`` and ``ThroughputMonitor``) the averages over the steps since the last record go to
every logger of the Trainer (rank zero; the values are rank zero's own timings):

* ``timing/step_ms`` — from this callback's ``on_train_batch_start`` to its ``on_train_batch_end``
  (summed over the micro-batches of an accumulated step): forward, backward, optimizer step, and
  the hooks of callbacks that run inside that window, less the measurement work of
  ``ConditionNumberMonitor`` in it (its probes on a record step are not training);
* ``timing/bnp_transform_ms`` — ``BatchNormPreconditioning.on_before_optimizer_step`` (the transform,
  and ZSpaceRegularization's terms, which BNP calls from there);
* ``timing/bnp_statistics_ms`` — BNP's forward hooks on the managed layers (the statistics), measured
  by hooks registered just before and just after BNP's own — only during the step a record is written
  (a sample: extra forward hooks on every step would cost about 1% on a small network);
* ``timing/bnp_ms`` — the sum of the two, and ``timing/bnp_share`` = bnp_ms / step_ms;
* ``timing/weight_conditioning_ms`` — the forward of this package's weight parametrizations
  (``WeightConditioning``'s E·W, paper 004), sampled on the record step like the statistics;
* ``timing/callbacks/<Class>_ms`` — every per-step hook of each other ``lightning_bnp`` callback
  (e.g. ``ConditionNumberMonitor``, whose probes cost nothing on the steps it does not log), timed
  through the Trainer's profiler hooks: Lightning runs each callback hook inside
  ``trainer.profiler.profile("[Callback]<state_key>.<hook>")``, so during ``fit`` this callback puts a
  forwarding profiler in front of the Trainer's own (which still sees every action) and reads those;
* ``timing/samples_per_sec`` — samples (first dimension of the batch) / step time (the name Lightning's
  ``ThroughputMonitor`` uses).

Clocks: on CPU ``time.perf_counter``; on CUDA, pairs of CUDA events recorded on the current stream,
resolved (``Event.synchronize``) only when a record is written, so the timed steps run unsynchronized —
never a bare host clock, which would time kernel launches rather than kernels. On other accelerators
(e.g. MPS) the device is synchronized before each host-clock reading.

Probe passes of ``ConditionNumberMonitor`` (which pause BNP's statistics) are not counted as BNP time.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.profilers import Profiler
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.data import extract_batch_size
from torch import Tensor, nn
from torch.nn.utils import parametrize
from typing_extensions import override

from lightning_bnp.callbacks._logging import chart, declare_layout, log_metrics
from lightning_bnp.callbacks.bnp import BatchNormPreconditioning
from lightning_bnp.callbacks.condition_monitor import ConditionNumberMonitor
from lightning_bnp.callbacks.graphed_steps import GraphedSteps
from lightning_bnp.core.arguments_repr import ArgumentsRepr
from lightning_bnp.core.copies import CopySafeHook, register_forward_hook
from lightning_bnp.core.preconditioner import BNPPreconditioner
from lightning_bnp.core.validation import check_int

__all__ = ["TimingMonitor"]

_STEP_HOOKS = (
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_batch_end",
)


class _Clock:
    """Accumulates durations per key: host ``perf_counter`` on CPU, CUDA event pairs on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        # other accelerators: synchronize, then read the host clock
        module = getattr(torch, device.type, None) if device.type not in ("cpu", "cuda") else None
        self.sync = getattr(module, "synchronize", None)
        self.totals: defaultdict[str, float] = defaultdict(float)
        self.pending: list[tuple[str, Any, Any]] = []

    def _now(self) -> float:
        if self.sync is not None:
            self.sync()
        return time.perf_counter()

    def start(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()  # on the current stream, after the work queued so far
            return event
        return self._now()

    def stop(self, token: Any, *keys: str) -> None:
        """Add the time since ``start`` returned ``token`` to every key."""
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.pending.extend((key, token, end) for key in keys)
        else:
            elapsed = self._now() - token
            for key in keys:
                self.totals[key] += elapsed

    def collect(self) -> dict[str, float]:
        """Seconds per key since the last call (on CUDA: waits for the recorded events, then reads them)."""
        if self.pending:
            for key, begin, end in self.pending:
                end.synchronize()  # a no-op once the stream has passed it; covers events on other streams
                self.totals[key] += begin.elapsed_time(end) / 1e3  # ms → s
            self.pending.clear()
        totals, self.totals = dict(self.totals), defaultdict(float)
        return totals


class _HookTimingProfiler(Profiler):
    """Stands in for ``trainer.profiler`` during ``fit``: forwards every action to the Trainer's own profiler
    and times the ``[Callback]<state_key>.<hook>`` actions listed in ``timed`` (action → keys, measurement).

    Lightning wraps each callback hook in ``trainer.profiler.profile(action)`` (``trainer/call.py``), so this
    times other callbacks' hooks without touching them. ``measurement``: time spent inside the step window is
    also added to ``"measurement"``, which ``step_ms`` leaves out.

    The Trainer's profiler keeps its own life cycle: the Trainer runs its ``describe`` (which writes the
    report, then tears it down) after :meth:`TimingMonitor.teardown` put it back. So this stand-in never
    tears down the profiler it forwards to — ``Profiler.__del__`` tears down ``self`` when the stand-in is
    collected, which would empty ``AdvancedProfiler``'s report and leave ``PyTorchProfiler`` unable to
    write one. Other attributes (``recorded_durations``, ``dirpath``, …) are read from the Trainer's profiler.
    """

    def __init__(self, inner: Profiler, monitor: TimingMonitor, timed: dict[str, tuple[tuple[str, ...], bool]]) -> None:
        # no `super().__init__()`: `dirpath`, `filename`, `_stage`, … are the Trainer's profiler's (`__getattr__`)
        self.inner, self.monitor, self.timed = inner, monitor, timed
        self._tokens: dict[str, tuple[Any, bool]] = {}

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (unpickling, a half-built instance): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    @override
    def start(self, action_name: str) -> None:
        self.inner.start(action_name)
        if action_name in self.timed:
            self._tokens[action_name] = (self.monitor._clock.start(), self.monitor._in_step)

    @override
    def stop(self, action_name: str) -> None:
        entry = self._tokens.pop(action_name, None)
        if entry is not None:
            keys, measurement = self.timed[action_name]
            token, in_step = entry
            self.monitor._clock.stop(token, *keys, *(("measurement",) if measurement and in_step else ()))
        self.inner.stop(action_name)

    @override
    def summary(self) -> str:
        return self.inner.summary()

    @override
    def describe(self) -> None:  # only if the stand-in is still in place when the Trainer reports
        self.inner.describe()

    @override
    def setup(self, stage: str, local_rank: Optional[int] = None, log_dir: Optional[str] = None) -> None:
        self.inner.setup(stage, local_rank, log_dir)  # a Trainer run that starts with the stand-in still in place

    @override
    def teardown(self, stage: Optional[str]) -> None:
        """Nothing: the Trainer's ``describe()`` tears its profiler down once the report is written."""

    @override
    def __del__(self) -> None:
        """Nothing (``Profiler.__del__`` would tear down the Trainer's profiler before its report)."""


class TimingMonitor(ArgumentsRepr, Callback):
    """Log step time, the time BNP's statistics and transform take, other ``lightning_bnp`` callbacks' hook
    time, and samples per second.

    Args:
        every_n_steps: write a record after optimizer steps 0, n, 2n, … (averages over the steps since
            the previous record); ``None`` (default): the Trainer's ``log_every_n_steps`` (Lightning's default 50).

    Raises:
        TypeError: ``every_n_steps`` is not an integer (or is a bool).
        ValueError: ``every_n_steps`` < 1.

    Example::

        Trainer(callbacks=[BatchNormPreconditioning(), TimingMonitor()], logger=TensorBoardLogger("runs"))
    """

    def __init__(self, *, every_n_steps: Optional[int] = None) -> None:
        self.every_n_steps = None if every_n_steps is None else check_int("every_n_steps", every_n_steps, low=1)
        self._every = every_n_steps or 50  # resolved against the Trainer in `on_fit_start`
        self._clock = _Clock(torch.device("cpu"))
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._profiler: _HookTimingProfiler | None = None
        self._trainer: pl.Trainer | None = None
        self._hook_tokens: dict[int, Any] = {}
        self._managed: list[nn.Module] = []
        self._parametrizations: list[nn.Module] = []
        self._pre: BNPPreconditioner | None = None
        self._sampled = 0
        self._count_samples = True
        self._in_step = False
        self._step_token: Any = None
        self._steps = 0
        self._samples = 0
        self._step_at_start = -1
        self._warned_replayed = False  # (once per monitor: the steps of a GraphedSteps fit are not split)

    def __getstate__(self) -> dict[str, Any]:
        # pickle / deepcopy: timing in flight (CUDA events, hook handles, the Trainer's profiler) stays behind
        state = dict(self.__dict__)
        clock = _Clock(torch.device("cuda" if self._clock.cuda else "cpu"))
        clock.sync, clock.totals = self._clock.sync, self._clock.totals.copy()
        state.update(_clock=clock, _handles=[], _hook_tokens={}, _step_token=None, _profiler=None, _trainer=None)
        return state

    # ------------------------------------------------------------ set-up
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after every callback's `setup`, so BNP's forward hooks exist and ours go around them
        self._restore()
        default = trainer.log_every_n_steps  # type: ignore[attr-defined]
        self._every = self.every_n_steps if self.every_n_steps is not None else default
        self._clock = _Clock(pl_module.device)
        self._steps, self._samples, self._count_samples, self._sampled = 0, 0, True, 0
        if not trainer.loggers:
            rank_zero_warn("TimingMonitor: the Trainer has no logger, so nothing will be recorded.")
        timed: dict[str, tuple[tuple[str, ...], bool]] = {}
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if callback is self or not type(callback).__module__.startswith("lightning_bnp."):
                continue
            bnp = isinstance(callback, BatchNormPreconditioning)
            for hook in _STEP_HOOKS:
                if getattr(type(callback), hook) is not getattr(Callback, hook):  # overridden
                    keys: tuple[str, ...] = (f"callbacks/{type(callback).__name__}",)
                    if bnp and hook == "on_before_optimizer_step":
                        keys += ("bnp_transform",)
                    action = f"[Callback]{callback.state_key}.{hook}"  # Lightning's name (trainer/call.py)
                    timed[action] = (keys, isinstance(callback, ConditionNumberMonitor))
            if isinstance(callback, BatchNormPreconditioning):
                pre = self._pre = callback._attach(pl_module)  # after `configure_model`, whatever the callback order
                self._managed = [layer.module for layer in pre.layers.values()]
        self._parametrizations = [
            p
            for m in pl_module.modules()
            if parametrize.is_parametrized(m)
            for plist in m.parametrizations.values()  # type: ignore[operator]
            for p in plist
            if type(p).__module__.startswith("lightning_bnp.")
        ]
        if timed:
            self._profiler = _HookTimingProfiler(trainer.profiler, self, timed)  # type: ignore[attr-defined]
            self._trainer, trainer.profiler = trainer, self._profiler  # type: ignore[attr-defined]
        bnp_charts = {
            "bnp_ms": [chart("timing", "bnp_ms")],
            "bnp parts": [r"^timing/bnp_(transform|statistics)_ms$"],
            "bnp_share": [chart("timing", "bnp_share")],
        }
        declare_layout(
            trainer,
            {
                "timing": {
                    "step_ms": [chart("timing", "step_ms")],
                    **(bnp_charts if self._managed else {}),
                    **(
                        {"weight_conditioning_ms": [chart("timing", "weight_conditioning_ms")]}
                        if self._parametrizations
                        else {}
                    ),
                    "samples_per_sec": [chart("timing", "samples_per_sec")],
                },
                "timing/callbacks": {"hook time per step": [chart("timing", "callbacks")]},
            },
        )

    def _hook_start(self, module: nn.Module, args: Any, output: Any) -> None:
        # not during a probe's re-run of `training_step`, which pauses BNP's statistics
        if self._in_step and module.training and torch.is_grad_enabled() and self._collecting():
            self._hook_tokens[id(module)] = self._clock.start()

    def _collecting(self) -> bool:
        return self._pre is None or self._pre.collecting

    def _hook_stop(self, module: nn.Module, args: Any, output: Any) -> None:
        token = self._hook_tokens.pop(id(module), None)
        if token is not None:
            self._clock.stop(token, "bnp_statistics")

    def _parametrization_start(self, module: nn.Module, args: Any) -> None:
        if self._in_step and torch.is_grad_enabled() and self._collecting():
            self._hook_tokens[id(module)] = self._clock.start()

    def _parametrization_stop(self, module: nn.Module, args: Any, output: Any) -> None:
        token = self._hook_tokens.pop(id(module), None)
        if token is not None:
            self._clock.stop(token, "weight_conditioning")

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hook_tokens.clear()

    def _restore(self) -> None:
        self._remove_hooks()
        self._managed, self._parametrizations, self._pre = [], [], None
        trainer, profiler = self._trainer, self._profiler
        if trainer is not None and profiler is not None and trainer.profiler is profiler:  # type: ignore[attr-defined]
            trainer.profiler = profiler.inner  # type: ignore[attr-defined]  # before Lightning's `describe()`
        self._profiler, self._trainer = None, None

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore()
        self._in_step = False

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore()
        self._in_step = False

    # ------------------------------------------------------------- steps
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._step_at_start = trainer.global_step
        if self._step_at_start % self._every == 0 and not self._handles:  # sample the statistics time
            for module in self._managed:  # around BNP's hook: ours first (prepended), then BNP's, then ours
                self._handles.append(register_forward_hook(module, self._hook_start, prepend=True))
                self._handles.append(register_forward_hook(module, self._hook_stop))
            for module in self._parametrizations:  # copy-safe hooks: a copy of the model does not call them
                self._handles.append(module.register_forward_pre_hook(CopySafeHook(self._parametrization_start)))
                self._handles.append(register_forward_hook(module, self._parametrization_stop))
        if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], Tensor):
            self._samples += len(batch[0]) if batch[0].dim() else 1  # the common (x, y) case, cheaply
        elif self._count_samples:
            try:
                self._samples += extract_batch_size(batch)
            except Exception:  # no tensor to count: samples/s is not logged
                self._count_samples = False
        self._in_step = True
        self._step_token = self._clock.start()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._clock.stop(self._step_token, "step")
        self._in_step = False
        if trainer.global_step == self._step_at_start:
            return  # a micro-batch without an optimizer step: keep summing into this step
        self._steps += 1
        if self._handles:
            self._remove_hooks()
            self._sampled += 1
        if self._step_at_start % self._every != 0:
            return
        totals = self._clock.collect()
        steps, samples, sampled = self._steps, self._samples, max(self._sampled, 1)
        self._steps, self._samples, self._sampled = 0, 0, 0
        step_s = totals.pop("step", 0.0) - totals.pop("measurement", 0.0)
        statistics_s = totals.pop("bnp_statistics", 0.0) / sampled  # per step, from the sampled step
        conditioning_s = totals.pop("weight_conditioning", 0.0) / sampled
        metrics = {f"timing/{key}_ms": 1e3 * value / steps for key, value in totals.items()}
        metrics["timing/step_ms"] = 1e3 * step_s / steps
        # replayed steps (GraphedSteps) run BNP and the parametrizations inside the graph: no part of them is timed
        replayed = any(isinstance(c, GraphedSteps) and c.captured for c in trainer.callbacks)  # type: ignore[attr-defined]
        if replayed:
            metrics.pop("timing/bnp_transform_ms", None)
            self._warn_replayed()
        if self._managed and not replayed:
            metrics.setdefault("timing/bnp_transform_ms", 0.0)
            metrics["timing/bnp_statistics_ms"] = 1e3 * statistics_s
            bnp_ms = metrics["timing/bnp_transform_ms"] + metrics["timing/bnp_statistics_ms"]
            metrics["timing/bnp_ms"] = bnp_ms
            metrics["timing/bnp_share"] = bnp_ms / metrics["timing/step_ms"] if step_s > 0 else 0.0
        if self._parametrizations and not replayed:
            metrics["timing/weight_conditioning_ms"] = 1e3 * conditioning_s
        if self._count_samples and samples > 0 and step_s > 0:
            metrics["timing/samples_per_sec"] = samples / step_s
        log_metrics(trainer, metrics, self._step_at_start)

    def _warn_replayed(self) -> None:
        if not self._warned_replayed:
            self._warned_replayed = True
            rank_zero_warn(
                "TimingMonitor: the steps are replayed from a CUDA graph (GraphedSteps), which runs BNP's statistics "
                "and transform and the weight parametrizations inside the graph, where they cannot be timed apart: "
                "only timing/step_ms, timing/samples_per_sec and the callbacks' hooks outside the step are logged"
            )
