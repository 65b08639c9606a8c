"""The plan of a BNP step for one set of layers, built once and reused: their flat layout, the running state the
previous step left, the row-block entries of the transform, and the step's constants per N = 1 pattern and entries.

A step's layers — the managed layers with a gradient and statistics, on one device in one dtype — are usually the
same from step to step, so everything that depends on them alone is computed once here (the torch.optim
``_init_group`` / pure-kernel split): the step itself (:mod:`~lightning_bnp.core.step`) gathers the tensors and
calls :func:`~lightning_bnp.core.step_math.step_math`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_bnp.core.gradients import whole_bias_grad
from lightning_bnp.core.layers import ManagedLayer
from lightning_bnp.core.layout import FeatureLayout
from lightning_bnp.core.statistics import Moments, RunningStatistics, count_on_device
from lightning_bnp.core.step_math import StepConfig
from lightning_bnp.core.step_path import GroupedKernels, GroupedPath, uses_grouped_kernels
from lightning_bnp.core.transform import broadcast_shapes

__all__ = ["StepPlan", "column_block_runs", "row_block_runs", "row_block_spans"]

# one layer of a step: the layer, its pooled moments and the gradient of its weight leaf (this rank's rows)
Ready = tuple[ManagedLayer, Moments, Tensor]


def _follow(running: RunningStatistics, like: Tensor) -> None:
    """Move ``running`` to ``like``'s device and dtype. Cast before its first step, its ρ⁰ + κ = 1 + κ is made anew
    in the new dtype: statistics made while the model was float32 (the callback's, at ``setup``, before Lightning
    casts the model for ``precision="64-true"``) would otherwise carry a float32 rounding of 1 + κ, ~1e-8 off, into
    every float64 step (issue 37, item 8). After a step, ρ^t + κ widens as the steps computed it (as a checkpoint of
    it loads); the accumulators widen exactly."""
    cast = running.decay.dtype != like.dtype
    running.to(like.device, like.dtype)
    if cast and isinstance(running._steps, int) and running._steps == 0:
        running.steps = 0  # (the setter builds ρ⁰ + κ in the statistics' new dtype)


class StepPlan:
    """What a step of ``layers`` needs besides this step's tensors.

    Args:
        layers: the step's layers, in step order.
        device: where their statistics live.
        dtype: the statistics' dtype.
        decay_offset: κ of the running statistics' ``decay`` = ρ^t + κ.
        grouped_kernels: take the grouped kernels where the plan's device has them (:mod:`~lightning_bnp.core.
            step_path`); else the pure-torch step.
    """

    def __init__(self, layers: list[ManagedLayer], device: torch.device, dtype: torch.dtype, decay_offset: float,
                 *, grouped_kernels: bool = False) -> None:  # fmt: skip
        # the column blocks of one linear layer (LayerKind.column_block): one floor, and their biases share G_b/q²
        self.column_runs = column_block_runs(layers)
        self.layout = FeatureLayout(
            [layer.features for layer in layers],
            [layer.has_bias for layer in layers],
            device,
            dtype,
            decay_offset,
            self.column_runs,
        )
        shares = [1] * len(layers)
        for first, n in self.column_runs:
            shares[first : first + n] = [n] * n
        self.shares = tuple(shares)
        # the q, k, v row blocks of one weight: one entry of the transform (LayerKind.row_block)
        self.row_runs = row_block_runs(layers)
        self.fan_in = torch.tensor([layer.fan_in for layer in layers], dtype=torch.float64, device=device)
        self.configs: dict[Any, StepConfig] = {}  # per N = 1 pattern and entries of the transform
        # the running state of these layers as two flat buffers that every committed step overwrites in place
        # ([m ; v ; d] and the step counts) and the per-layer views of them the statistics hold: a step starts
        # from them without concatenating the layers' tensors, and their addresses never change (what a CUDA
        # graph that captured the step reads and writes on every replay)
        self.state: Tensor | None = None
        self.steps: Tensor | None = None
        self.views: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []
        # where a step captured in a CUDA graph keeps its per-layer max σ²_H for the warnings (StepWarnings.owe)
        self.alarm = torch.zeros(len(layers), dtype=dtype, device=device)
        # the step's path, chosen once: the grouped kernels (their tables per configuration) or None (pure torch);
        # column blocks (one floor over the run, biases sharing G_b) are not the kernels' layout: pure torch
        grouped = uses_grouped_kernels(device, dtype, requested=grouped_kernels) and not self.column_runs
        self.grouped = GroupedPath(self.layout.sizes, [layer.has_bias for layer in layers], device) if grouped else None

    def config(self, settings: tuple[bool, bool, float, float, float], one_row: tuple[int, ...], spans: Any,
               ready: list[Ready], entry_w: list[Tensor]) -> StepConfig:  # fmt: skip
        """The step's constants (``settings``: running, bias correction, ρ, ε1, ε2), built once per N = 1 pattern
        and entries (``entry_w``: each entry's weight gradient, whose shape is its layer's)."""
        config = self.configs.get((one_row, spans))
        if config is None:
            sizes = tuple(sum(self.layout.sizes[i : i + n]) for i, n in spans)
            groups = tuple(ready[i][0].groups if n == 1 else n for i, n in spans)
            shapes = tuple(broadcast_shapes(w, k, size) for w, k, size in zip(entry_w, groups, sizes))
            shares = tuple(self.shares[i] for i, _ in spans) if self.column_runs else ()
            config = self.configs[(one_row, spans)] = StepConfig(
                *settings, one_row, spans, sizes, groups, shapes, shares
            )
        return config

    def grouped_kernels(
        self, config: StepConfig, entry_w: list[Tensor], entry_b: list[Tensor | None]
    ) -> GroupedKernels | None:
        """The grouped kernels of ``config`` and these gradients (``None``: the plan takes the pure-torch path)."""
        if self.grouped is None:
            return None
        return self.grouped.kernels(config.one_row, config.spans, config.groups, config.sizes, entry_w, entry_b)

    def state_before(self, runnings: list[RunningStatistics], like: Tensor) -> tuple[Tensor, Tensor]:
        """The committed ``[m ; v ; d]`` of every layer and their step counts, as flat vectors: the plan's buffers
        when every layer still holds the views of them it was given (no copy), else gathered."""
        if self.state is not None and all(
            r.mean_acc is m and r.var_acc is v and r._steps is t and r.decay is d
            for r, (m, v, t, d) in zip(runnings, self.views)
        ):
            return self.state, self.steps  # type: ignore[return-value]
        for running in runnings:  # the model was moved or cast
            _follow(running, like)
        before = torch.cat([r.mean_acc for r in runnings] + [r.var_acc for r in runnings] + [r.decay for r in runnings])
        steps = torch.cat(
            [
                r._steps if isinstance(r._steps, Tensor) else torch.tensor([r._steps], device=like.device)
                for r in runnings
            ]
        )
        return before, steps

    def state_after(
        self, after: Tensor, finite: Tensor, steps_before: Tensor
    ) -> tuple[list[tuple[Tensor, Tensor, bool]], list[tuple[Tensor, Tensor, Tensor, Tensor]]]:
        """What storing the state a step computed takes: the in-place writes ``(buffer, value, add)`` of the plan's
        buffers (the state ``after`` copied, the step counts grown by ``finite``) and the per-layer views
        ``(m, v, t, d)`` of them that the statistics are then to hold."""
        if steps_before is self.steps:  # the step started from the buffers: the counts grow in place
            assert self.state is not None
            return [(self.state, after, False), (self.steps, finite, True)], self.views
        state = self.state
        if state is None:  # (made once: a plan's layers, device and dtype are fixed, so they always fit)
            layout, total = self.layout, self.layout.total
            state = self.state = torch.empty_like(after)
            self.steps = torch.empty_like(steps_before)
            self.views = list(
                zip(
                    layout.split(state[:total]),
                    layout.split(state[total : 2 * total]),
                    layout.split_layers(self.steps),
                    layout.split_layers(state[2 * total :]),
                )
            )
        assert self.steps is not None
        return [(state, after, False), (self.steps, steps_before + finite, False)], self.views

    def device_counts(self, moments: list[Moments]) -> Tensor:
        """(rows, samples, out positions) per layer as one float64 tensor on the statistics' device."""
        return torch.stack(
            [
                torch.stack([count_on_device(c, self.fan_in).to(self.fan_in.device, torch.float64) for c in counts])
                for counts in ((m.rows, m.samples, m.out_positions) for m in moments)
            ]
        )


def row_block_runs(layers: list[ManagedLayer]) -> tuple[tuple[int, int], ...]:
    """Runs (first layer, n) of ``layers`` that are the n row blocks of one weight in order
    (:meth:`LayerKind.row_block`, the q, k, v of a MultiheadAttention): fixed for a set of layers."""
    return _block_runs(layers, lambda layer: None if layer.kind.same_rows else layer.kind.row_block(layer.module))


def column_block_runs(layers: list[ManagedLayer]) -> tuple[tuple[int, int], ...]:
    """Runs (first layer, n) of ``layers`` that are the n column blocks of one linear layer in order
    (:meth:`LayerKind.column_block`, a recurrent layer's ``weight_ih`` and ``weight_hh``): fixed for a set of layers.
    Blocks whose siblings are not all in ``layers`` (one excluded, or frozen) are layers on their own."""
    return _block_runs(layers, lambda layer: layer.kind.column_block(layer.module))


def _block_runs(
    layers: list[ManagedLayer], block_of: Callable[[ManagedLayer], tuple[int, int] | None]
) -> tuple[tuple[int, int], ...]:
    """Runs (first layer, n) of consecutive layers of one module whose ``block_of`` are (0, n), (1, n) … (n − 1, n)."""
    runs, i = [], 0
    while i < len(layers):
        layer = layers[i]
        block = block_of(layer)
        n = block[1] if block is not None and block[0] == 0 else 1
        run = layers[i : i + n]
        if (
            n > 1
            and len(run) == n
            and all(other.module is layer.module and block_of(other) == (j, n) for j, other in enumerate(run))
        ):
            runs.append((i, n))
            i += n
            continue
        i += 1
    return tuple(runs)


def row_block_spans(
    runs: tuple[tuple[int, int], ...], ready: list[Ready], grads_b: list[Tensor | None], q2s: list[float] | None
) -> tuple[tuple[int, int], ...]:
    """The transform's entries as (first layer, layers): one per layer, except a run of n row blocks of one weight
    (``runs``, :func:`row_block_runs`), which the step transforms as one grouped matrix, each block with its own μ
    and σ̃² (exact whatever their statistics are). Such a run needs one plain gradient tensor for its blocks, bias
    gradients for all blocks or none (then one plain tensor of n·out rows), and, where q² is a host float
    (``q2s``), one q² for the n blocks (the bias update's scalar)."""
    if not runs:
        return tuple((i, 1) for i in range(len(ready)))
    spans: list[tuple[int, int]] = []
    i = 0
    for first, n in runs:
        spans.extend((j, 1) for j in range(i, first))
        i = first + n
        if _row_blocks_fit(ready[first:i], grads_b[first:i], None if q2s is None else q2s[first:i]):
            spans.append((first, n))
        else:
            spans.extend((j, 1) for j in range(first, i))
    spans.extend((j, 1) for j in range(i, len(ready)))
    return tuple(spans)


def _row_blocks_fit(run: list[Ready], grads_b: list[Tensor | None], q2s: list[float] | None) -> bool:
    first, _, grad = run[0]
    if type(grad) is not Tensor or grad.dim() != 2 or any(g is not grad for _, _, g in run):
        return False
    if q2s is not None and any(q2 != q2s[0] for q2 in q2s):
        return False
    if all(grad_b is None for grad_b in grads_b):
        return True
    whole = whole_bias_grad(first)
    return (
        all(grad_b is not None for grad_b in grads_b)
        and type(whole) is Tensor
        and tuple(whole.shape) == (grad.shape[0],)
        and all(whole_bias_grad(layer) is whole for layer, _, _ in run)
    )
