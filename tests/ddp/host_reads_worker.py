"""2 gloo processes on CPU: BNP with its statistics pooled over ranks reads nothing back to the host (issue 28
item 1). Each rank trains a DDP model on its own share of the batch (rank 1 has more rows) and counts host
reads over forward, backward and the BNP step; rank 0 also runs the same steps in one process on the whole
batch. Writes ``rank{r}.pt``: the read counts, the BNP state, the parameters and the single-process reference.

Run: ``python -m tests.ddp.host_reads_worker --out DIR`` (every configuration of ``CONFIGS`` in one process group).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from lightning_bnp.core import BNPPreconditioner
from tests.core.test_host_reads import make
from tests.ddp.launch import spawn_two_gloo_ranks
from tests.host_reads import HostReads

STEPS, ROWS = 4, (3, 5)  # rows of rank 0 and rank 1


def batch(kind: str, step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(step)
    n = sum(ROWS)
    x = torch.randn(n, 6, generator=g) if kind == "linear" else torch.randn(n, 2, 8, 8, generator=g)
    if step == 2:
        x[4].flatten()[0] = float("nan")  # a NaN sample on rank 1 (statistics of both ranks keep their state)
    return x + 1.0, torch.arange(n) % 3


def train(kind: str, give_optimizer: bool, rank: int | None) -> dict[str, object]:
    net, options = make(kind)
    pre = BNPPreconditioner(net, sync_statistics=rank is not None, **options)  # type: ignore[arg-type]
    model: nn.Module = DistributedDataParallel(net) if rank is not None else net
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    reads = []
    for step in range(STEPS):
        x, y = batch(kind, step)
        if rank is not None:
            part = slice(0, ROWS[0]) if rank == 0 else slice(ROWS[0], None)
            x, y = x[part], y[part]
        with HostReads() as counted:
            opt.zero_grad()
            # a sum over rows, divided by the global batch: DDP's mean over 2 ranks gives the full-batch gradient
            (F.cross_entropy(model(x), y, reduction="sum") / sum(ROWS) * (2 if rank is not None else 1)).backward()
            pre.step(opt) if give_optimizer else pre.step()
            opt.step()
        reads.append(dict(counted.reads))
        if step == 2:  # the NaN step: the gradients are NaN; the test compares the statistics and the steps
            with torch.no_grad():
                for p in net.parameters():
                    p.nan_to_num_(0.0)
    pre.detach()
    params = {k: v.detach().clone() for k, v in net.state_dict().items()}
    return {"reads": reads, "bnp": pre.state_dict(), "params": params}


CONFIGS = [("linear", False), ("linear", True), ("conv-channel", False), ("conv-column", True)]


def run(rank: int) -> dict[str, object]:
    """One rank: every configuration, with the one-process reference on rank 0."""
    states: dict[str, object] = {"world_size": dist.get_world_size()}
    for kind, give_optimizer in CONFIGS:
        state = train(kind, give_optimizer, rank)
        if rank == 0:
            state["reference"] = train(kind, give_optimizer, None)
        states[f"{kind} {give_optimizer}"] = state
    return states


if __name__ == "__main__":
    spawn_two_gloo_ranks(run)
