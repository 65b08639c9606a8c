"""2 gloo processes on CPU: BNP on a model sharded by FSDP2's plain ``fully_shard`` (issue 26 item 2). Each rank
holds some rows of every weight and bias (uneven shards, and a layer with one output row, none on rank 1),
transforms its local shard with the full-width statistics pooled over both ranks and trains on its own share of
the batch (rank 1 has more rows); rank 0 also runs the same steps in one process on the whole batch, unsharded.
Collectives made inside ``BNPPreconditioner.step`` are counted. Writes ``rank{r}.pt``: per configuration the full
parameters, the BNP state, the collective counts and (rank 0) the single-process reference.

Run: ``python -m tests.ddp.fsdp_worker --out DIR`` (every configuration of ``CONFIGS`` in one process group).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard

from lightning_bnp.core import BNPPreconditioner
from tests.ddp.launch import spawn_two_gloo_ranks

STEPS, ROWS = 3, (3, 5)  # rows of rank 0 and rank 1 per micro-batch
CONFIGS = [("linear", "channel", 1), ("linear", "channel", 2), ("conv", "channel", 1), ("conv", "column", 2)]
COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_reduce", "reduce_scatter_tensor", "broadcast", "barrier")


def make(kind: str) -> nn.Sequential:
    torch.manual_seed(0)
    if kind == "linear":  # 5 rows: 3 + 2; 3 rows: 2 + 1
        return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    # 3 channels: 2 + 1; one output channel: 1 + 0 (rank 1 holds no row of it)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Conv2d(3, 1, 3), nn.ReLU(), nn.Flatten(), nn.Linear(36, 3)
    )


def batch(kind: str, step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(step)
    n = sum(ROWS)
    x = torch.randn(n, 6, generator=g) if kind == "linear" else torch.randn(n, 2, 8, 8, generator=g)
    return x * torch.linspace(0.5, 2.0, x.shape[1]).view(-1, *[1] * (x.dim() - 2)) + 1.0, torch.arange(n) % 3


@contextmanager
def counting(counts: Counter[str]) -> Iterator[None]:
    """Count the calls of ``torch.distributed`` collectives in the block."""
    saved = {name: getattr(dist, name) for name in COLLECTIVES}

    def wrap(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return saved[name](*args, **kwargs)

        return call

    for name in COLLECTIVES:
        setattr(dist, name, wrap(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def train(kind: str, conv_statistics: str, accumulate: int, rank: int | None) -> dict[str, Any]:
    net = make(kind)
    if rank is not None:
        for module in net:
            if any(True for _ in module.parameters()):
                fully_shard(module)
        fully_shard(net)
    pre = BNPPreconditioner(net, sync_statistics=rank is not None, conv_statistics=conv_statistics)  # type: ignore[arg-type]
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    counts: list[dict[str, int]] = []
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(accumulate):
            x, y = batch(kind, step * accumulate + micro)
            if rank is not None:
                part = slice(0, ROWS[0]) if rank == 0 else slice(ROWS[0], None)
                x, y = x[part], y[part]
            # a sum over rows, divided by the global batch: FSDP2's mean over 2 ranks gives the full-batch gradient
            scale = (2 if rank is not None else 1) / (sum(ROWS) * accumulate)
            (F.cross_entropy(net(x), y, reduction="sum") * scale).backward()
        counted: Counter[str] = Counter()
        with counting(counted):
            pre.step()
        counts.append(dict(counted))
        opt.step()
    pre.detach()
    params = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in net.state_dict().items()
    }
    return {"collectives": counts, "bnp": pre.state_dict(), "params": params}


def run(rank: int) -> dict[str, object]:
    """One rank: every configuration, with the one-process reference on rank 0."""
    states: dict[str, object] = {"world_size": dist.get_world_size()}
    for config in CONFIGS:
        state = train(*config, rank=rank)
        if rank == 0:
            state["reference"] = train(*config, rank=None)
        states[" ".join(map(str, config))] = state
    return states


if __name__ == "__main__":
    spawn_two_gloo_ranks(run)
