"""Statistics pooled over ranks: every rank applies the same P (DESIGN §3, DDP), so a step merges the moments of
every rank's forward calls — one ``all_gather`` of all layers' (count, μ, σ²) parts per step, merged in rank order
(bitwise alike on every rank). The pooled counts stay on the device: nothing is read back to the host."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_bnp.core.layers import ManagedLayer
from lightning_bnp.core.statistics import Moments

__all__ = ["local_moments", "pool_over_ranks", "pools_over_ranks"]


def pools_over_ranks(sync_statistics: bool, process_group: Any) -> bool:
    """Whether a step pools: ``sync_statistics`` under an initialised ``torch.distributed`` whose group
    (``process_group``, ``None`` for the world) has more than one rank."""
    return sync_statistics and dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1


def local_moments(layers: list[ManagedLayer]) -> list[Moments]:
    """This rank's moments of each layer since the last step (an empty part where its forward did not run)."""
    return [
        layer.moments if layer.moments is not None else Moments.empty(layer.features, layer.weight.device, layer.dtype)
        for layer in layers
    ]


def pool_over_ranks(layers: list[ManagedLayer], local: list[Moments], process_group: Any) -> list[Moments]:
    """The moments of every rank of ``process_group`` merged per layer, in one collective (counts on the device)."""
    if not layers:
        return local
    world = dist.get_world_size(process_group)
    flat = torch.cat([m.pack() for m in local])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat, group=process_group)
    sizes = [3 + 2 * layer.features for layer in layers]
    per_rank = [g.split(sizes) for g in gathered]
    pooled = []
    for i, layer in enumerate(layers):
        merged = Moments.unpack(per_rank[0][i], layer.features, layer.dtype)
        for rank in range(1, world):  # same order on every rank: bitwise-identical results
            merged = merged.merge(Moments.unpack(per_rank[rank][i], layer.features, layer.dtype))
        pooled.append(merged)
    return pooled
