"""All managed layers' per-feature statistics as one flat vector per quantity (issue 16).

A step of :class:`~lightning_bnp.core.preconditioner.BNPPreconditioner` works on μ, σ², σ̃² of every
layer at once: layer l's c_in features occupy entries ``[offset_l, offset_l + c_in)`` of one vector,
so that each step of Alg. 2/3 (the running update, the floor ε1·max σ², the N = 1 rule …) is one
kernel launch for all layers instead of one per layer — on a GPU each launch costs host time that
the small vectors themselves do not. Per-layer maxima are one ``segment_reduce``; a per-layer
scalar (q², the floor) reaches its layer's entries through one ``index_select``.

The index tensors are built once per set of layers stepped together and reused every step.
:func:`variance_ceiling` is the largest σ²_H a step stores (where an overflowed one saturates).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_bnp.core.bounded_cache import BoundedCache

__all__ = ["FeatureLayout", "variance_ceiling"]


def variance_ceiling(dtype: torch.dtype) -> float:
    """The largest σ²_H a step stores in ``dtype``: far enough below the dtype's maximum that σ̃² and q²·σ̃² stay
    finite (q² up to 2^24). A larger (overflowed) σ²_H saturates there."""
    return torch.finfo(dtype).max * 2.0**-24


class FeatureLayout:
    """Where each layer's features sit in the flat vectors of one step.

    Args:
        sizes: features (c_in or in_features) per layer, in step order.
        centred: per layer, whether it has the centring block of P (a bias).
        device: where the statistics live.
        dtype: the statistics' dtype (float32, or float64 for float64 models).
        decay_offset: κ of the running statistics' ``decay`` = ρ^t + κ
            (:class:`~lightning_bnp.core.statistics.RunningStatistics`): its batch value in the running update.
        floor_runs: runs (first layer, n) of consecutive layers that are the column blocks of one linear layer
            (:meth:`~lightning_bnp.core.kinds.LayerKind.column_block`): σ̃²'s floor ε1·max σ² is the run's.
    """

    def __init__(
        self,
        sizes: Sequence[int],
        centred: Sequence[bool],
        device: torch.device,
        dtype: torch.dtype,
        decay_offset: float = 0.0,
        floor_runs: Sequence[tuple[int, int]] = (),
    ) -> None:
        self.sizes = list(sizes)
        self.total = sum(self.sizes)
        self.lengths = torch.tensor(self.sizes, device=device)
        # owner[k]: the layer of entry k (the size given: no read of the lengths back from the device, and a
        # layout can be built on `meta`)
        self.owner = torch.repeat_interleave(
            torch.arange(len(self.sizes), device=device), self.lengths, output_size=self.total
        )
        self.device, self.dtype = device, dtype
        # 1 on the entries of layers without a bias, 0 elsewhere; None when every layer has one
        self.uncentred_mask = None if all(centred) else self.per_layer([float(not c) for c in centred])
        self._cache: BoundedCache[tuple[Any, ...], Tensor] = BoundedCache(8)  # per_layer_cached / per_layer_values
        # the running state of a step is one vector [m ; v ; d] (d = ρ^t per layer): the layer of each entry
        layers = torch.arange(len(self.sizes), device=device)
        self.state_owner = torch.cat([self.owner, self.owner, layers])
        self.state_sizes = [self.total, self.total, len(self.sizes)]  # [m ; v ; d] (one call splits it)
        # the batch value of d = ρ^t + κ in the running update: d ← ρ·d + (1 − ρ)·κ
        self.decay_target = torch.full((len(self.sizes),), decay_offset, dtype=dtype, device=device)
        self.ceiling = variance_ceiling(dtype)
        self._ones = [1] * len(self.sizes)
        # the floor's segments: one per layer, or one per run of column blocks (their features are consecutive)
        self.floor_lengths: Tensor | None = None
        self.floor_owner: Tensor | None = None
        self._floor_tail_lengths: Tensor | None = None
        self._floor_gather: Tensor | None = None
        if floor_runs:
            inside = {i for first, n in floor_runs for i in range(first + 1, first + n)}  # not a run's first
            floor_of_layer: list[int] = []
            lengths: list[int] = []
            for i, size in enumerate(self.sizes):
                if i not in inside:  # a segment of its own, or the first of a run
                    lengths.append(0)
                floor_of_layer.append(len(lengths) - 1)
                lengths[-1] += size
            self.floor_lengths = torch.tensor(lengths, device=device)
            self.floor_owner = torch.tensor(floor_of_layer, device=device).index_select(0, self.owner)
            # floor_entries: the segments of [v ; d] (each run's v, then each layer's d alone), and where each
            # entry's run max and layer's d sit in the reduced vector
            self._floor_tail_lengths = torch.cat([self.floor_lengths, torch.ones_like(self.lengths)])
            self._floor_gather = torch.cat([self.floor_owner, self.owner + len(lengths)])

    def per_layer(self, values: Sequence[float]) -> Tensor:
        """A vector holding ``values[l]`` on every entry of layer l."""
        return torch.tensor(values, dtype=self.dtype, device=self.device).index_select(0, self.owner)

    def per_layer_cached(self, values: Sequence[float]) -> Tensor:
        """:meth:`per_layer` for values that rarely change from step to step (q², the view's scale):
        built once per distinct tuple (the last 8 kept)."""
        key = tuple(values)
        return self._cache.get_or_make(key, lambda: self.per_layer(key))

    def per_layer_values(self, values: Sequence[float]) -> Tensor:
        """``values`` as one tensor of one entry per layer, built once per distinct tuple (the last 8 kept)."""
        key = ("layers", *values)
        return self._cache.get_or_make(key, lambda: torch.tensor(values, dtype=self.dtype, device=self.device))

    def layer_max(self, flat: Tensor) -> Tensor:
        """max over each layer's entries (over its run's, for column blocks: ``floor_runs``), broadcast onto them."""
        if self.floor_lengths is None:
            return self.segment_max(flat).index_select(0, self.owner)
        runs = torch.segment_reduce(flat, "max", lengths=self.floor_lengths, unsafe=True)
        return runs.index_select(0, self.floor_owner)  # type: ignore[arg-type]

    def floor_entries(self, state: Tensor, alpha: float) -> Tensor:
        """Per entry, max v + alpha·d of its layer, v and d the last two parts of a running state [m ; v ; d]
        (``state_sizes``): the max over the layer's entries, or over its run's (``floor_runs``: the column blocks
        of one layer share the floor), d its layer's own. Four launches with runs or without: with runs one
        ``segment_reduce`` of [v ; d] gives each run's max and (segments of one entry) each layer's d, one
        ``index_select`` brings both onto the entries."""
        var_acc = state.narrow(0, self.total, self.total)
        decay = state.narrow(0, 2 * self.total, len(self.sizes))
        if self._floor_tail_lengths is None or self._floor_gather is None:
            return torch.add(self.segment_max(var_acc), decay, alpha=alpha).index_select(0, self.owner)
        tail = state.narrow(0, self.total, self.total + len(self.sizes))  # [v ; d], one view
        reduced = torch.segment_reduce(tail, "max", lengths=self._floor_tail_lengths, unsafe=True)
        run_max, layer_decay = reduced.index_select(0, self._floor_gather).view(2, self.total)
        return torch.add(run_max, layer_decay, alpha=alpha)

    def segment_max(self, flat: Tensor) -> Tensor:
        """max over each layer's entries, one per layer (NaN where a layer has a NaN entry)."""
        # unsafe: no check of the lengths against the vector (two reads back to the host); they are the layout's
        return torch.segment_reduce(flat, "max", lengths=self.lengths, unsafe=True)

    def split(self, flat: Tensor) -> tuple[Tensor, ...]:
        """Per-layer views of a flat vector (no copy)."""
        return flat.split_with_sizes(self.sizes)

    def split_layers(self, flat: Tensor) -> tuple[Tensor, ...]:
        """Per-layer (1,) views of a vector with one entry per layer (no copy)."""
        return flat.split_with_sizes(self._ones)

    def slice(self, layer: int) -> slice:
        start = sum(self.sizes[:layer])
        return slice(start, start + self.sizes[layer])
