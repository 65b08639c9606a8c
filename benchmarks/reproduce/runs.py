"""Training runs: the networks, one SGD run on the digits, and the jobs the worker processes take."""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from benchmarks.reproduce.hessian import hessian_kappa
from benchmarks.reproduce.settings import Setting
from example_projects.digits import load_digits_splits
from example_projects.models import Norm, cnn5, fc_network
from lightning_bnp.core import BNPPreconditioner
from lightning_bnp.core.conditioning import apply_weight_conditioning

CHANCE = 0.1
NORMS: dict[str, Norm] = {"BN": "bn", "BN+WC": "bn", "LN": "ln", "GN": "gn", "BNP+GN": "gn"}


@functools.cache
def digits() -> dict[str, tuple[Tensor, Tensor]]:
    return load_digits_splits()


def build(model: str, method: str) -> tuple[nn.Module, bool]:
    """The network for ``method`` (``vanilla``, ``BN``, ``LN``, ``GN``, ``BNP``, ``BNP+GN``, ``BN+WC``) and
    whether BNP preconditions it."""
    norm = NORMS.get(method, "none")
    if model == "FC":
        net: nn.Module = fc_network(norm=norm)
    elif model == "FC2":
        net = fc_network(depth=2, norm=norm)
    else:
        net = cnn5(norm=norm)
    if method == "BN+WC":
        apply_weight_conditioning(net, layers="first_and_last")
    return net, method.startswith("BNP")


@dataclass(frozen=True)
class Job:
    """One training run's arguments (picklable; also the key of its result)."""

    model: str
    method: str
    batch: int
    lr: float
    seed: int
    steps: int
    evals: int
    kappa: bool

    @classmethod
    def of(cls, s: Setting, method: str, lr: float, seed: int) -> Job:
        return cls(s.model, method, s.batch, lr, seed, s.steps, s.evals, s.kappa)

    @property
    def cost(self) -> float:
        """Rough relative run time, to start the longest runs first."""
        return self.steps * self.batch**0.5 * (8 if self.model == "CNN" else 1) * (2 if "BNP" in self.method else 1)


@dataclass
class Run:
    """What one training run recorded, at ``evals`` evaluation points (and step 0)."""

    steps: list[int] = field(default_factory=list)
    val: list[float] = field(default_factory=list)
    test: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)  # mean training loss since the previous point
    diverged: bool = False
    seconds: float = 0.0
    kappa: dict[str, list[float]] = field(default_factory=dict)  # experiment 2 only

    @property
    def final(self) -> float:
        return self.test[-1]


def runs_of(results: dict[Job, Run], s: Setting, method: str, lr: float, seeds: int) -> list[Run]:
    return [results[Job.of(s, method, lr, seed)] for seed in range(seeds)]


def accuracy(net: nn.Module, split: str) -> float:
    x, y = digits()[split]
    net.eval()
    with torch.no_grad():
        acc = float((net(x).argmax(1) == y).float().mean())
    net.train()
    return acc


def train(job: Job) -> Run:
    """Plain SGD on the digits for ``job.steps`` steps; a run whose loss is not finite or exceeds 1e3 stops
    updating and is marked diverged."""
    torch.manual_seed(job.seed)  # same initial weights for every method and learning rate of a seed
    net, use_bnp = build(job.model, job.method)
    pre = BNPPreconditioner(net) if use_bnp else None
    opt = torch.optim.SGD(net.parameters(), lr=job.lr)
    loss_fn = nn.CrossEntropyLoss()
    x, y = digits()["train"]
    gen = torch.Generator().manual_seed(job.seed)  # same data order too
    every = max(1, job.steps // job.evals)
    run, step, start = Run(), 0, time.perf_counter()
    pending: list[float] = []  # training losses since the last evaluation

    def record() -> None:
        run.steps.append(step)
        run.val.append(accuracy(net, "val"))
        run.test.append(accuracy(net, "test"))
        run.loss.append(sum(pending) / len(pending) if pending else math.nan)
        pending.clear()

    record()
    while step < job.steps:  # epochs; the last one may be cut short
        for idx in torch.randperm(len(y), generator=gen).split(job.batch):
            if not run.diverged:
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(net(x[idx]), y[idx])
                loss.backward()
                if pre is not None:
                    pre.step()
                    if job.kappa and step % every == 0:
                        for key, value in hessian_kappa(net, pre, loss_fn, x[idx], y[idx]).items():
                            run.kappa.setdefault(key, []).append(value)
                opt.step()
                value = loss.item()
                run.diverged = not math.isfinite(value) or value > 1e3
                pending.append(value)
            step += 1
            if step % every == 0 or step == job.steps:
                record()
            if step == job.steps:
                break
    run.seconds = time.perf_counter() - start
    return run


def task(job: Job) -> tuple[Job, Run]:
    """A worker process's unit of work, with one torch thread."""
    torch.set_num_threads(1)
    return job, train(job)
