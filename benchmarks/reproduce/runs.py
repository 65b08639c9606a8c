"""Training runs: the networks, one SGD run on the 28×28 MNIST digits, and the jobs the worker processes take."""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from benchmarks.reproduce.hessian import hessian_kappa
from benchmarks.reproduce.settings import Setting
from example_projects.mnist5k import load_mnist5k_splits
from example_projects.models import Norm, cifar_resnet, cnn5, fc_network
from lightning_bnp.core import BNPPreconditioner
from lightning_bnp.core.conditioning import apply_weight_conditioning
from lightning_bnp.core.preconditioner import ConvStatistics

CHANCE = 0.1
NORMS: dict[str, Norm] = {
    "BN": "bn",
    "BN+WC": "bn",
    "LN": "ln",
    "GN": "gn",
    "BNP+GN": "gn",
    "BNP+GN-bc": "gn",
    "BNP+GN-col": "gn",
}
IN_FEATURES = 28 * 28


@functools.cache
def data() -> dict[str, tuple[Tensor, Tensor]]:
    return load_mnist5k_splits()


def build(model: str, method: str) -> tuple[nn.Module, BNPPreconditioner | None]:
    """The network for ``method`` (module docstring of ``settings``) and BNP's preconditioner for it, if any:
    ``BNP``/``BNP+GN`` start from the paper's μ = 0, σ² = 1, ``-bc`` variants are bias-corrected, ``-col``
    variants keep exact per-column convolution statistics (``conv_statistics="column"``)."""
    norm = NORMS.get(method, "none")
    if model == "FC":
        net: nn.Module = fc_network(IN_FEATURES, norm=norm)
    elif model == "FC2":
        net = fc_network(IN_FEATURES, depth=2, norm=norm)
    elif model == "R20":  # Appendix B's BNP+GN: GN with 4 groups, He-normal weights ×0.1
        net = cifar_resnet(20, in_channels=1, norm=norm, groups=4, init_scale=0.1)
    else:
        net = cnn5(1, 28, norm=norm)
    if method == "BN+WC":
        apply_weight_conditioning(net, layers="first_and_last")
    if not method.startswith("BNP"):
        return net, None
    columns: ConvStatistics = "column" if method.endswith("-col") else "channel"
    return net, BNPPreconditioner(net, bias_correction=method.endswith("-bc"), conv_statistics=columns)


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
    momentum: float = 0.0
    weight_decay: float = 0.0
    warmup_steps: int = 0
    eval_samples: int = 0  # > 0: accuracy on the first this many images of each split

    @classmethod
    def of(cls, s: Setting, method: str, lr: float, seed: int) -> Job:
        warmup = min(s.warmup_epochs * s.steps_per_epoch, s.steps)
        return cls(
            s.model,
            method,
            s.batch,
            lr,
            seed,
            s.steps,
            s.evals,
            s.kappa,
            s.momentum,
            s.weight_decay,
            warmup,
            s.eval_samples,
        )

    @property
    def cost(self) -> float:
        """Rough relative run time (ms on one 2020s CPU thread), to start the longest runs first."""
        per_step = {"FC": 1.0, "FC2": 1.0, "CNN": 1.5 + 0.35 * self.batch, "R20": 2.1 * self.batch}[self.model]
        return self.steps * per_step


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


def runs_of(results: dict[Job, Run], s: Setting, method: str, lr: float) -> list[Run]:
    return [results[Job.of(s, method, lr, seed)] for seed in range(s.seeds)]


def accuracy(net: nn.Module, split: str, samples: int = 0) -> float:
    """Accuracy on ``split`` (its first ``samples`` images when > 0)."""
    x, y = data()[split]
    if samples > 0:
        x, y = x[:samples], y[:samples]
    net.eval()
    with torch.no_grad():
        acc = float((net(x).argmax(1) == y).float().mean())
    net.train()
    return acc


def train(job: Job) -> Run:
    """SGD on the 28×28 digits for ``job.steps`` steps; a run whose loss is not finite or exceeds 1e3 stops
    updating and is marked diverged. SGD's weight decay acts after BNP's transform (decay in z, paper 001)."""
    torch.manual_seed(job.seed)  # same initial weights for every method and learning rate of a seed
    net, pre = build(job.model, job.method)
    opt = torch.optim.SGD(net.parameters(), lr=job.lr, momentum=job.momentum, weight_decay=job.weight_decay)
    loss_fn = nn.CrossEntropyLoss()
    x, y = data()["train"]
    gen = torch.Generator().manual_seed(job.seed)  # same data order too
    every = max(1, job.steps // job.evals)
    run, step, start = Run(), 0, time.perf_counter()
    pending: list[float] = []  # training losses since the last evaluation

    def record() -> None:
        run.steps.append(step)
        run.val.append(accuracy(net, "val", job.eval_samples))
        run.test.append(accuracy(net, "test", job.eval_samples))
        run.loss.append(sum(pending) / len(pending) if pending else math.nan)
        pending.clear()

    record()
    while step < job.steps:  # epochs; the last one may be cut short
        for idx in torch.randperm(len(y), generator=gen).split(job.batch):
            if not run.diverged:
                if job.warmup_steps:  # linear from lr/10 to lr (Appendix B: 0.01 → 0.1)
                    opt.param_groups[0]["lr"] = job.lr * (0.1 + 0.9 * min(1.0, step / job.warmup_steps))
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
