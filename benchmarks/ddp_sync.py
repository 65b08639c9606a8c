"""Cost of synchronising BNP statistics across DDP ranks (sync on vs off), and of BNP under FSDP2 (with vs without).

Two CPU processes (gloo) train the paper's FC network and 5-layer CNN under plain-torch
``DistributedDataParallel`` with :class:`BNPPreconditioner`, alternating ``sync_statistics=True``
and ``False`` round by round in the same processes so that drift affects both equally. (Without
syncing, each rank builds P from its own shard and the replicas drift apart — see the README; this
measures only what the correct setting costs.) Then, in the same process group, the same networks
sharded with FSDP2's ``fully_shard`` (every layer with weights, then the root; README "Large models")
train with BNP (each rank transforms the rows it holds, statistics pooled over both ranks) and
without it, again alternating round by round. Rank 0 writes ``benchmarks/out/ddp_sync.md`` (one
table each) and prints the on/off and with/without ratios per model and batch size.

Run: ``python -m benchmarks.ddp_sync [--steps 30] [--rounds 5]``
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from example_projects.models import cnn5, fc_network
from lightning_bnp.core import BNPPreconditioner

OUT = Path(__file__).parent / "out"
CASES = [("FC 3×100", 16), ("FC 3×100", 256), ("CNN 5-layer", 2), ("CNN 5-layer", 128)]


def time_steps(model: nn.Module, pre: BNPPreconditioner | None, batch: int, steps: int) -> float:
    """Median seconds per training step (forward, backward with its collectives, BNP unless ``pre`` is None, SGD)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.rand(batch, 1, 28, 28), torch.randint(0, 10, (batch,))  # MNIST-sized
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if pre is not None:
            pre.step()
        opt.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def make_net(name: str) -> nn.Module:
    torch.manual_seed(0)
    return fc_network(28 * 28) if name.startswith("FC") else cnn5(1, 28)


def fsdp2_rows(steps: int, rounds: int) -> list[tuple[str, int, float, float]]:
    """Per case: median seconds per step of the ``fully_shard`` model with BNP and without it, interleaved."""
    rows = []
    for name, batch in CASES:
        net = make_net(name)
        for module in net.modules():
            if module is not net and any(True for _ in module.parameters(recurse=False)):
                fully_shard(module)  # every layer with weights (rows split over the ranks), then the root
        fully_shard(net)
        pre = BNPPreconditioner(net)
        with_bnp, without = [], []
        for _ in range(rounds):  # interleave: drift hits both variants alike
            pre.attach()
            with_bnp.append(time_steps(net, pre, batch, steps))
            pre.detach()  # no statistics hooks, no BNP step: the plain FSDP2 step
            without.append(time_steps(net, None, batch, steps))
        rows.append((name, batch, statistics.median(with_bnp), statistics.median(without)))
    return rows


def worker(rank: int, world: int, steps: int, rounds: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    rows = []
    for name, batch in CASES:
        net = make_net(name)
        model = DistributedDataParallel(net)
        pre_on = BNPPreconditioner(net, sync_statistics=True)
        pre_on.detach()  # one attached preconditioner per model at a time
        pre_off = BNPPreconditioner(net, sync_statistics=False)
        on, off = [], []
        for _ in range(rounds):  # interleave: drift hits both variants alike
            pre_off.detach()
            pre_on.attach()
            on.append(time_steps(model, pre_on, batch, steps))
            pre_on.detach()
            pre_off.attach()
            off.append(time_steps(model, pre_off, batch, steps))
        rows.append((name, batch, statistics.median(on), statistics.median(off)))
    sharded = fsdp2_rows(steps, rounds)
    if rank == 0:
        lines = [
            f"# BNP statistics sync under DDP: 2 CPU processes (gloo), 1 thread each, median of {rounds} rounds "
            f"× {steps} steps\n",
            "| model | per-rank batch | sync on (ms/step) | sync off (ms/step) | on / off |",
            "|---|---|---|---|---|",
        ]
        for name, batch, t_on, t_off in rows:
            lines.append(f"| {name} | {batch} | {1e3 * t_on:.2f} | {1e3 * t_off:.2f} | {t_on / t_off:.3f} |")
        lines += [
            "",
            f"# BNP under FSDP2 (`fully_shard` per layer and root): the same 2 processes, median of {rounds} rounds "
            f"× {steps} steps\n",
            "| model | per-rank batch | with BNP (ms/step) | without BNP (ms/step) | with / without |",
            "|---|---|---|---|---|",
        ]
        for name, batch, t_with, t_without in sharded:
            lines.append(
                f"| {name} | {batch} | {1e3 * t_with:.2f} | {1e3 * t_without:.2f} | {t_with / t_without:.3f} |"
            )
        OUT.mkdir(exist_ok=True)
        (OUT / "ddp_sync.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--port", type=int, default=29533)
    args = parser.parse_args()
    mp.spawn(worker, args=(2, args.steps, args.rounds, args.port), nprocs=2, join=True)


if __name__ == "__main__":
    main()
