"""One BNP step over the managed layers (Alg. 2/3): which layers take part, their gradients and pooled statistics,
the plan of their set, the tensor work (eager or compiled, chosen once), and what the step leaves behind — each
layer's :class:`~lightning_bnp.core.layers.StepTransform` and the running-statistics update to store.

Pooled over ranks (:mod:`~lightning_bnp.core.pooling`) or token-masked (:mod:`~lightning_bnp.core.token_masks`),
a layer's counts are device tensors: the step then builds q² on the device (and a layer no rank ran gets M = I)
instead of on the host, and runs eager. That is the one branch of a step; the rest is the same for both.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from lightning_bnp.core.bounded_cache import BoundedCache
from lightning_bnp.core.gradients import bias_grad, weight_grad, whole_bias_grad
from lightning_bnp.core.layers import NO_LEAF, ManagedLayer, StepTransform
from lightning_bnp.core.pending import PendingUpdate
from lightning_bnp.core.pooling import local_moments, pool_over_ranks, pools_over_ranks
from lightning_bnp.core.step_math import step_math
from lightning_bnp.core.step_plan import Ready, StepPlan, row_block_spans
from lightning_bnp.core.step_warnings import (
    FOREIGN_WEIGHT,
    NEVER_RAN,
    NO_GRADIENTS,
    REPARAMETRIZED,
    TWICE,
    StepWarnings,
)
from lightning_bnp.core.transform import q_squared

__all__ = ["PreconditionerStep", "transforms_of"]

# why a step runs the pure-torch ops where the grouped kernels were chosen
GROUPED_FAILED = (
    "BNP's grouped GPU kernels could not run here, so these layers' steps take the pure-torch path (the same "
    "result, more kernel launches); without `grouped_kernels=True` it is taken without trying"
)
_MAX_PLANS = 16  # sets of layers stepped together whose plan is kept (the earliest built is dropped first)


class PreconditionerStep:
    """The step of a preconditioner with the given settings.

    Args:
        rho, eps1, eps2, statistics, bias_correction: as :class:`~lightning_bnp.core.preconditioner.BNPPreconditioner`.
        sync_statistics, process_group: pool the statistics over ranks (:mod:`~lightning_bnp.core.pooling`).
        decay_offset: κ of the running statistics' ``decay`` = ρ^t + κ.
        warnings: where the step's warnings go.
        grouped_kernels: let plans on a CUDA device take the grouped kernels (:mod:`~lightning_bnp.core.step_path`).
    """

    grouped_kernels = False  # (class default: a step pickled before the grouped kernel existed)

    def __init__(
        self,
        *,
        rho: float,
        eps1: float,
        eps2: float,
        statistics: str,
        bias_correction: bool,
        sync_statistics: bool,
        process_group: Any,
        decay_offset: float,
        warnings: StepWarnings,
        grouped_kernels: bool = False,
    ) -> None:
        self.grouped_kernels = grouped_kernels
        self.running = statistics == "running"
        self.settings = (self.running, bias_correction, rho, eps1, eps2)
        self.sync_statistics, self.process_group = sync_statistics, process_group
        self.decay_offset = decay_offset
        self.warnings = warnings
        self.plans: BoundedCache[tuple[Any, ...], StepPlan] = BoundedCache(_MAX_PLANS)
        self.math: Callable[..., Any] = step_math  # step_math, or its compiled copy (compile)
        self.compile_options: dict[str, Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # a compiled function does not copy (a copy compiles its own step), and plans are rebuilt
        return {**self.__dict__, "plans": BoundedCache(_MAX_PLANS), "math": step_math}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.compile_options is not None:
            self.compile(**self.compile_options)

    @property
    def pools(self) -> bool:
        return pools_over_ranks(self.sync_statistics, self.process_group)

    def compile(self, **options: Any) -> None:
        """Run the tensor work of every later step with host counts as one ``torch.compile(fullgraph=True)`` graph
        per set of layers (``options`` go to ``torch.compile``)."""
        # a copy of the function with its own code object: Dynamo keeps its compiled graphs (and counts
        # recompilations) per code object, so every preconditioner gets its own
        # (defaults and closure too: the same function when `step_math` is wrapped, e.g. by mutmut's trampoline)
        own = types.FunctionType(
            step_math.__code__.replace(),
            step_math.__globals__,
            "step_math",
            step_math.__defaults__,
            step_math.__closure__,
        )
        self.math = torch.compile(own, fullgraph=True, **options)
        self.compile_options = dict(options)

    @property
    def compiled(self) -> bool:
        return self.compile_options is not None

    def precondition(
        self, layers: list[ManagedLayer], params: Iterable[Tensor] | None, *, commit: bool = True
    ) -> PendingUpdate:
        """Transform the current gradients of those ``layers`` whose weight is in ``params`` (all when ``None``)
        and consume their statistics; the running-statistics update is stored now (``commit``) or returned."""
        self.warnings.report()
        for layer in layers:  # recorded from a forward with other tensors (functional_call), no gradient on its own
            if layer.foreign_weight and layer.moments is not None and weight_grad(layer) is None:
                self.warnings.warn(layer, "foreign weight", FOREIGN_WEIGHT)
        if params is not None:
            ids = {id(p) for p in params}
            layers = [layer for layer in layers if id(layer.weight) in ids or self._left_alone(layer)]
        # a layer with no gradient this step did not contribute to it: its statistics are dropped
        active: list[ManagedLayer] = []
        grads: list[Tensor] = []
        gradless: list[str] = []  # counted forwards, no gradient (a foreign weight has had its own warning)
        with_grad = False
        for layer in layers:
            grad = weight_grad(layer)
            if grad is None:
                self._left_alone(layer)
                if layer.moments is not None and not layer.foreign_weight:
                    gradless.append(layer.name)
                continue
            with_grad = True
            if not self._transformed_already(layer, grad):
                active.append(layer)
                grads.append(grad)
        if gradless and not with_grad:  # (host facts only: which `.grad` is None)
            shown = gradless if len(gradless) <= 4 else [*gradless[:4], f"… ({len(gradless)} layers)"]
            self.warnings.warn_once("no gradients", NO_GRADIENTS.format(layers=shown))
        local = local_moments(active)
        not_run_here = {layer.name for layer, m in zip(active, local) if m.is_empty()}
        # a forward on 0 rows (an empty batch, an expert no token was routed to) ran and was reached: its gradient
        # is 0 from those rows, M·0 = 0, and no row updates the running statistics, so nothing is left to do or to
        # say (as for a step whose every token is padding); a layer whose forward never ran gets the warning
        never_ran = {layer.name for layer in active if layer.moments is None}
        pooled = pool_over_ranks(active, local, self.process_group) if self.pools else local
        for layer in layers:
            layer.moments = None
            layer.transform = None
            layer.foreign_weight = False
        pending = PendingUpdate()
        groups: dict[tuple[torch.device, torch.dtype], list[Ready]] = {}
        for layer, m, grad in zip(active, pooled, grads):
            # pooled over ranks, the count is on the device: a layer no rank ran gets M = I there
            if not m.is_empty():  # one flat layout per device and dtype (usually one)
                groups.setdefault((m.mean.device, m.mean.dtype), []).append((layer, m, grad))
            if layer.name in never_ran:
                self.warnings.warn(layer, "never ran", NEVER_RAN)
        for group in groups.values():
            self.transform(group, pending, not_run_here)
        if commit:
            pending.commit()
        return pending

    def repeated(self, layers: list[ManagedLayer], params: Iterable[Tensor]) -> bool:
        """Whether a step of ``params`` would repeat the latest one: every layer among them with a gradient holds the
        very gradient tensor that step transformed (in place since or not: a clipping scales it) and has counted no
        forward since (a backward since would have). Identity and counts only: no tensor value is read."""
        ids, seen = {id(p) for p in params}, False
        for layer in layers:
            if id(layer.weight) not in ids or (grad := weight_grad(layer)) is None:
                continue
            done = layer.transformed_grad
            if layer.moments is not None or done is None or done[0]() is not grad:
                return False
            seen = True
        return seen

    def _left_alone(self, layer: ManagedLayer) -> bool:
        """False; names (once) a layer reparametrized since setup in a way BNP cannot follow (README
        'Reparametrized layers'): its weight leaf is then ``NO_LEAF`` and it is skipped like a frozen layer."""
        if layer.weight is NO_LEAF:
            self.warnings.warn(layer, "reparametrized", f"{REPARAMETRIZED}: {layer.kind.reparametrized(layer.module)}.")
        return False

    def _transformed_already(self, layer: ManagedLayer, grad: Tensor) -> bool:
        """Whether the weight's gradient is the one the previous step transformed, unchanged since."""
        done = layer.transformed_grad
        if done is None or done[0]() is not grad or grad._version != done[1]:
            return False
        self.warnings.warn(layer, "twice", TWICE)
        return True

    def _grouped(self, plan: StepPlan, math: Callable[..., Any], args: tuple[Any, ...], q2_layers: Tensor | None,
                 entry_w: list[Tensor], entry_b: list[Tensor | None]) -> Any:  # fmt: skip
        """``math(*args)`` with the plan's grouped kernels for these gradients (q² per layer: ``q2_layers``, or the
        pooled ones). Until they have run once, a failure to build or launch them (a Triton that cannot compile them
        for this device) leaves the plan on the pure-torch step for good, with a warning; the step is then that one
        (the kernels change nothing in place before they launch)."""
        grouped = plan.grouped
        assert grouped is not None
        try:
            result = math(*args, plan.grouped_kernels(args[1], entry_w, entry_b), q2_layers)
        except Exception as error:
            if grouped.proven:
                raise
            plan.grouped = None
            self.warnings.warn_once("grouped kernels", f"{GROUPED_FAILED} ({type(error).__name__}: {error})")
            return math(*args, None, None)
        grouped.proven = True
        return result

    def plan(self, layers: list[ManagedLayer], like: Tensor) -> StepPlan:
        """The plan of ``layers`` (statistics on ``like``'s device and dtype), built once."""
        key = (tuple(layer.name for layer in layers), like.device, like.dtype)
        return self.plans.get_or_make(
            key,
            lambda: StepPlan(layers, like.device, like.dtype, self.decay_offset, grouped_kernels=self.grouped_kernels),
        )

    def transform(self, ready: list[Ready], pending: PendingUpdate, not_run_here: set[str]) -> None:
        """Steps 2–4 for every layer of ``ready`` at once (one device and dtype): the gathering here, the tensor
        work in :func:`~lightning_bnp.core.step_math.step_math`."""
        moments = [m for _, m, _ in ready]
        plan = self.plan([layer for layer, _, _ in ready], moments[0].mean)
        layout, running = plan.layout, self.running
        # pooled over ranks or token-masked: the counts are device tensors, and q² is built on the device
        counts_on_device = any(m.counted_on_device for m in moments)
        single = tuple(i for i, m in enumerate(moments) if not m.counted_on_device and m.rows == 1)
        if single and not running:
            raise ValueError(
                f"statistics='batch' needs more than one row of input per step, but layer "
                f"{ready[single[0]][0].name!r} saw 1; use statistics='running' for batch size 1"
            )
        runnings = [layer.running for layer, _, _ in ready]
        # N = 1 (σ²_H = (h − μ)² with the running μ before the update): where a count is 1, or may be (on the device)
        one_row = tuple(
            i
            for i, (layer, _, _) in enumerate(ready)
            if layer.has_bias and running and (i in single or counts_on_device)
        )
        before = steps_before = None
        if running:  # (first: it moves the statistics to the batch's device and dtype when the model moved)
            before, steps_before = plan.state_before(runnings, moments[0].mean)
        running_mus = [runnings[i].device_mu() for i in one_row]
        grads_w = [grad if layer.kind.same_rows else layer.rows(grad) for layer, _, grad in ready]
        grads_b = [bias_grad(layer) for layer, _, _ in ready]
        counts = fan_in = q2_flat = None
        entry_q2s: list[Any] = []
        host_q2s: list[Any] = []
        math = step_math  # with counts on the device the step runs eager
        if counts_on_device:
            spans = row_block_spans(plan.row_runs, ready, grads_b, None)
            counts, fan_in = plan.device_counts(moments), plan.fan_in
        else:
            q2s: list[Any] = [
                q_squared(layer.fan_in, int(m.samples), int(m.out_positions) / int(m.samples)) for layer, m, _ in ready
            ]
            spans = row_block_spans(plan.row_runs, ready, grads_b, None if self.compiled else q2s)
            q2_flat, math, host_q2s = layout.per_layer_cached(q2s), self.math, q2s
            if self.compiled:  # tensors, so that a new q² is new data, not a recompilation
                values = layout.per_layer_values(q2s)
                q2s = list(values.unbind(0))
                entry_q2s = [q2s[i] if n == 1 else values[i : i + n].view(n, 1) for i, n in spans]
            else:  # (the blocks of one entry have one q²: row_block_spans)
                entry_q2s = [q2s[i] for i, _ in spans]
        entry_w, entry_b = grads_w, grads_b
        if len(spans) < len(ready):  # a run of row blocks: its whole gradient and bias gradient
            entry_w = [grads_w[i] if n == 1 else ready[i][2] for i, n in spans]
            entry_b = [grads_b[i] if n == 1 else whole_bias_grad(ready[i][0]) for i, n in spans]
        config = plan.config(self.settings, one_row, spans, ready, entry_w)
        means, variances = [m.mean for m in moments], [m.var for m in moments]
        args = (
            layout, config, means, variances, running_mus, before, counts, fan_in, q2_flat, entry_q2s, entry_w, entry_b,
        )  # fmt: skip
        # the grouped kernels' path (chosen with the plan). A compiled step keeps the torch ops, which inductor fuses
        # into kernels of its own
        if plan.grouped is not None and not self.compiled:
            q2_layers = None if counts_on_device else layout.per_layer_values(host_q2s)
            result = self._grouped(plan, math, args, q2_layers, entry_w, entry_b)
        else:
            result = math(*args, None, None)
        mu, var_t, after, finite, peak, q2_out = result
        if counts_on_device:
            q2s = list(q2_out.unbind(0))
        # (a layer this rank never ran has had its own warning: a NaN there is not reported again; one that saw no
        # row — every token padding — has a peak of 0: nothing to report)
        named = [layer if layer.name not in not_run_here else None for layer, _, _ in ready]
        self.warnings.owe(named, peak, plan.alarm)
        if running:
            assert steps_before is not None
            writes, views = plan.state_after(after, finite, steps_before)
            pending.writes.extend(writes)
            pending.items.extend(zip(runnings, views))
        for (layer, _, grad_w), mu_l, var_t_l, q2, grad_b, share in zip(
            ready, layout.split(mu), layout.split(var_t), q2s, grads_b, plan.shares
        ):
            mu_used = mu_l if grad_b is not None else None
            layer.transform = StepTransform(mu_used, var_t_l, q2, layer.groups, layer.rows, layer.bias_rows, share)
            layer.transformed_grad = (weakref.ref(grad_w), grad_w._version)


def transforms_of(
    layers: dict[str, ManagedLayer], params: Iterable[Tensor]
) -> dict[str, tuple[ManagedLayer, StepTransform]]:
    """``{layer name: (layer, transform)}`` for those of ``layers`` whose weight is among ``params`` and that the
    latest step transformed (:meth:`~lightning_bnp.core.preconditioner.BNPPreconditioner.step_transforms`)."""
    ids = {id(p) for p in params}
    return {
        name: (layer, layer.transform)
        for name, layer in layers.items()
        if layer.transform is not None and id(layer.weight) in ids
    }
