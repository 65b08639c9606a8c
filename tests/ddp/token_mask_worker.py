"""2 gloo processes on CPU: token masks under DDP pooling (issue 24 item 3). Each rank trains a DDP model (a Linear,
a self-attention with its key_padding_mask, a Linear head per token) on its own padded batch — rank 0 two
sequences padded to 10, rank 1 two padded to 7 — under ``pre.token_mask(mask)``, counting host reads; rank 0 also
runs the one-process reference: plain BNP fed every real sequence of both ranks alone, unpadded (no mask code).
Writes ``rank{r}.pt``: the read counts, the BNP state, the parameters and the reference.

Run: ``python -m tests.ddp.token_mask_worker --out DIR``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from lightning_bnp.core import BNPPreconditioner
from tests.ddp.launch import spawn_two_gloo_ranks
from tests.host_reads import HostReads

STEPS = 3
LENGTHS = ((10, 3), (7, 1))  # per rank
REAL = sum(sum(lengths) for lengths in LENGTHS)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: Tensor, pad: Tensor | None) -> Tensor:
        h = torch.tanh(self.embed(x))
        return self.head(self.attn(h, h, h, key_padding_mask=pad, need_weights=False)[0])


def batch(rank: int, step: int) -> tuple[Tensor, Tensor]:
    """Rank ``rank``'s padded (2, T, 8) batch of this step (padding: junk) and its (2, T) mask."""
    lengths = LENGTHS[rank]
    g = torch.Generator().manual_seed(10 * step + rank)
    mask = torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]
    x = torch.randn(len(lengths), max(lengths), 8, generator=g) * 2 + 1
    return x.masked_fill(~mask[..., None], 50.0), mask


def train(rank: int | None) -> dict[str, object]:
    net = Net()
    pre = BNPPreconditioner(net, rho=0.5, sync_statistics=rank is not None)
    model: nn.Module = DistributedDataParallel(net) if rank is not None else net
    opt = torch.optim.SGD(net.parameters(), lr=1e-2)
    reads = []
    for step in range(STEPS):
        with HostReads() as counted:
            opt.zero_grad()
            if rank is not None:  # DDP averages over 2 ranks: × 2 gives the sum over every real token / REAL
                x, mask = batch(rank, step)
                with pre.token_mask(mask):
                    out = model(x, ~mask).masked_fill(~mask[..., None], 0.0)
                (out.square().sum() / REAL * 2).backward()
            else:  # every real sequence of both ranks alone, unpadded
                for r in range(2):
                    x, mask = batch(r, step)
                    for row, real in zip(x, mask):
                        (model(row[real][None], None).square().sum() / REAL).backward()
            pre.step(opt)
            opt.step()
        reads.append(dict(counted.reads))
    pre.detach()
    params = {k: v.detach().clone() for k, v in net.state_dict().items()}
    return {"reads": reads, "bnp": pre.state_dict(), "params": params}


def run(rank: int) -> dict[str, object]:
    state = train(rank)
    state["world_size"] = dist.get_world_size()
    if rank == 0:
        state["reference"] = train(None)
    return state


if __name__ == "__main__":
    spawn_two_gloo_ranks(run)
