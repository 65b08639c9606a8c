"""The warnings BNP's steps owe: once per layer and cause, those about a step's statistics raised later from a
host copy that never makes the host wait.

A step finds a layer's input statistics not finite (a NaN or Inf sample) or overflowing (finite inputs whose
squares the dtype cannot hold) on the device, as its per-layer max σ²_H: the step itself never reads it back.
:meth:`StepWarnings.owe` keeps a host copy of that vector (non-blocking on CUDA, with an event that says when it
has arrived), and :meth:`StepWarnings.report` — called by the next step — warns about the copies that have
arrived; :meth:`StepWarnings.flush` waits for the device and warns about all of them.

A step captured in a CUDA graph (``torch.cuda.graph``) runs its Python once, at capture: a host copy made then would
be refreshed by every replay but read by no later step. So while a stream is capturing, :meth:`StepWarnings.owe`
folds the step's per-layer max σ²_H into a device vector of the step's plan instead (an elementwise maximum, which
keeps a NaN and an Inf once seen): every replay adds its step to it, and :meth:`StepWarnings.flush` reads it,
warns, and clears it. :meth:`StepWarnings.report` does nothing while capturing (it would query events).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import Tensor

from lightning_bnp.core.layers import BNPWarning, ManagedLayer
from lightning_bnp.core.layout import variance_ceiling
from lightning_bnp.core.stack import user_stacklevel

__all__ = ["StepWarnings"]

NEVER_RAN = (
    "has a gradient but its forward never ran in training mode, or no backward that accumulated its weight's "
    "gradient reached its output, since the last step (e.g. its parent uses its weight through F.linear: teach "
    "BNP with lightning_bnp.core.attention.register_functional_linear; or the gradient came from "
    "torch.autograd.grad, which accumulates nothing, and was assigned to `.grad`: use backward(); or "
    "torch.compile reused a graph compiled without BNP's hooks: README 'Cost'); its gradient is left "
    "untransformed (with statistics pooled over ranks, `sync_statistics`: transformed with the statistics of the "
    "ranks that ran it, untransformed only if none did). Exclude it with `exclude` to silence this warning."
)
DETACHED = (
    "BNPPreconditioner.{method}() on a detached preconditioner: detach() removed its forward hooks, so it has "
    "recorded no statistics since and leaves every gradient untransformed. Call `attach()` before the next forward "
    "pass to precondition again, or build a new BNPPreconditioner."
)
FOREIGN_WEIGHT = (
    "its statistics were recorded from a forward that ran with another tensor as its weight than the module's own "
    "(e.g. torch.func.functional_call(model, params, x)), and the backward put the gradient on that tensor: the "
    "module's weight got none in this step, so BNP transformed nothing and dropped the statistics. Call the module "
    "itself (model(x)) so that its own weight gets the gradient, or precondition the gradients of the tensors the "
    "forward used: copy them to the module's parameters' `.grad` before step()."
)
NO_GRADIENTS = (
    "BNP: the forwards of {layers} were counted since the last step, but none of the layers stepped has a gradient "
    "in `.grad`, so this step transformed nothing (the optimizer's step is a plain one) and their statistics are "
    "dropped. Likely causes: `zero_grad()` ran between the backward and `step()` (call step() after the backward "
    "and before zero_grad), the gradients were taken with torch.autograd.grad (which does not fill `.grad`), or an "
    "engine keeps them elsewhere than `param.grad` (DeepSpeed ZeRO, which BNP does not support: use DDP or FSDP2's "
    "fully_shard)."
)
TWICE = (
    "its gradient was already preconditioned by the previous step() and no backward has changed it "
    "since; it is left as it is (one transform per gradient). Call step() once per backward."
)
REPARAMETRIZED = (
    "was reparametrized after BNP was set up, and BNP leaves it alone from this step on (its gradient is "
    "not transformed and its statistics are not updated)"
)
NON_FINITE = (
    "a step's input statistics were not finite (a NaN or Inf in the batch); its running statistics "
    "are not updated in such a step and P uses the ones stored before it."
)
NON_FINITE_BATCH = (
    "a step's input statistics were not finite (a NaN or Inf in the batch); with statistics='batch' that "
    "step's P, and so the layer's gradient, is not finite."
)
OVERFLOW = (
    "the step's input variance σ²_H overflows {dtype} (finite inputs of magnitude above ~{root:.1e}, whose "
    "squares are not representable); it is saturated at {ceiling:.1e} for that step, so σ² and P of this layer "
    "are not exact while inputs stay that large. Rescale the layer's input (normalize the data), or use float64."
)


def _host_copy(flat: Tensor) -> tuple[Tensor, torch.cuda.Event | None]:
    """A host copy of a small device vector that never makes the host wait: on CUDA a non-blocking copy
    into pinned memory and an event that says when it has arrived; on the CPU the vector itself."""
    if flat.device.type != "cuda":
        return flat, None
    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done


def _captured(peak: Tensor) -> bool:
    """Whether the step that computed ``peak`` is being captured in a CUDA graph."""
    return peak.is_cuda and torch.cuda.is_current_stream_capturing()


class StepWarnings:
    """:class:`~lightning_bnp.core.layers.BNPWarning` s of a preconditioner, each once per layer and cause.

    Args:
        running: the preconditioner's ``statistics == "running"`` (what a non-finite step means for P).
    """

    def __init__(self, *, running: bool) -> None:
        self.running = running
        self.warned: set[tuple[str | None, str]] = set()  # (layer name, or None for the whole preconditioner; cause)
        # per step: the layers (None: not to be named) and a host copy of their per-layer max σ²_H
        self.owed: list[tuple[list[ManagedLayer | None], tuple[Tensor, Any]]] = []
        # per device vector a captured step folds its maxima into: the layers it names (None: not to be named)
        self.captured: dict[int, tuple[list[ManagedLayer | None], Tensor]] = {}

    def __getstate__(self) -> dict[str, Any]:
        # CUDA events do not copy, and the warnings still owed for past steps are the original's to raise (so are
        # those of the steps the original's CUDA graphs replay)
        return {**self.__dict__, "owed": [], "captured": {}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({"captured": {}, **state})

    def warn(self, layer: ManagedLayer, cause: str, message: str) -> None:
        """Warn about ``layer`` unless it was already warned about for ``cause``."""
        if (layer.name, cause) not in self.warned:
            self._warn((layer.name, cause), f"BNP layer {layer.name!r} ({type(layer.module).__name__}): {message}")

    def warn_once(self, cause: str, message: str) -> None:
        """Warn about the preconditioner as a whole (no layer named) unless it was already warned about for
        ``cause``."""
        if (None, cause) not in self.warned:
            self._warn((None, cause), message)

    def warn_detached(self, generation: int, method: str) -> None:
        """Say that ``BNPPreconditioner.<method>()`` ran detached: once per detach (``generation``, the collection's
        count of detaches), so that a loop that keeps stepping hears it once."""
        self.warn_once(f"detached {generation}", DETACHED.format(method=method))

    def _warn(self, key: tuple[str | None, str], message: str) -> None:
        self.warned.add(key)
        warnings.warn(message, BNPWarning, stacklevel=user_stacklevel())

    def owe(self, layers: list[ManagedLayer | None], peak: Tensor, alarm: Tensor) -> None:
        """Keep a host copy of a step's per-layer max σ²_H (``peak``: NaN where not finite, +Inf where it
        overflowed, 0 where a layer saw no row); a ``None`` layer is not named. While a CUDA graph captures the
        step, fold ``peak`` into ``alarm`` (zeros of its shape, made before the capture) on the device instead."""
        if _captured(peak):
            torch.maximum(alarm, peak, out=alarm)  # (NaN wins over any number, +Inf over any finite one)
            self.captured[id(alarm)] = (layers, alarm)
            return
        self.owed.append((layers, _host_copy(peak)))

    def report(self) -> None:
        """Warn about the layers whose statistics a past step found not finite or out of range — only those whose
        host copy has arrived (a step never waits)."""
        if self.owed and isinstance(self.owed[0][1][1], torch.cuda.Event) and torch.cuda.is_current_stream_capturing():
            return  # (an event query would end the capture)
        while self.owed:
            layers, (host, done) = self.owed[0]
            if done is not None and not done.query():
                return
            self.owed.pop(0)
            self._warn_about(layers, host)

    def _warn_about(self, layers: list[ManagedLayer | None], host: Tensor) -> None:
        # a host vector, read as Python floats (less than a NumPy reduction, ~10 µs a step; no aten call either)
        peaks = host.numpy().tolist()
        if math.isfinite(sum(peaks)):  # the usual case: nothing to report (an inf sum falls through)
            return
        for layer, peak in zip(layers, peaks):
            if layer is None:
                continue
            if math.isnan(peak):
                self.warn(layer, "non-finite", NON_FINITE if self.running else NON_FINITE_BATCH)
            elif math.isinf(peak):
                root, name = math.sqrt(torch.finfo(host.dtype).max), str(host.dtype).removeprefix("torch.")
                message = OVERFLOW.format(dtype=name, root=root, ceiling=variance_ceiling(host.dtype))
                self.warn(layer, "overflow", message)

    def flush(self) -> None:
        """:meth:`report` every copy owed, waiting for the device, and the maxima that replays of captured steps
        folded in since the last flush (which it clears)."""
        for _, (_, done) in self.owed:
            if done is not None:
                done.synchronize()
        self.report()
        for layers, alarm in self.captured.values():
            host = alarm.to("cpu", copy=True)  # (a copy also on the CPU: the vector is cleared next)
            alarm.zero_()
            self._warn_about(layers, host)
