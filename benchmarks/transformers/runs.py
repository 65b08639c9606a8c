"""What §7 trains: the settings (variants, learning-rate grids, lengths, seeds) and one training run.

ViT variants: ``LN`` (LayerNorm), ``none`` (no normalization), ``none+BNP``, ``LN+BNP``; plain SGD. LM variants
(LayerNorm in every one): ``SGD``, ``SGD+BNP``, ``Adam``, ``Adam+BNP``. BNP is :class:`BNPPreconditioner` with its
defaults: every projection (patch embedding or nothing on the LM's token embedding, q, k, v, ``out_proj``, the MLP
layers, the head).
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn

from benchmarks.transformers.data import load
from example_projects.transformers import VOCAB, CharLM, ViT
from lightning_bnp.core import BNPPreconditioner, BNPWarning

VIT_VARIANTS = ("LN", "none", "none+BNP", "LN+BNP")
LM_VARIANTS = ("SGD", "SGD+BNP", "Adam", "Adam+BNP")
VIT_TRAIN = 4000  # training digits
DIVERGED = 1e3  # a training loss above this (or not finite) stops the run
CHANCE = {"vit": 0.1, "lm": math.log(VOCAB)}  # accuracy of a guess; loss (nats/char) of the uniform guess


@dataclass(frozen=True)
class Setting:
    """One panel: a task at a batch size, its variants and each variant's learning-rate grid."""

    task: str  # "vit" or "lm"
    batch: int
    steps: int
    grids: tuple[tuple[str, tuple[float, ...]], ...]  # (variant, learning rates)
    seeds: int = 3
    evals: int = 10  # evaluation points over the run (and step 0)
    eval_items: int = 0  # > 0: evaluate on the first this many images / windows of each split

    @property
    def name(self) -> str:
        return f"ViT, batch {self.batch}" if self.task == "vit" else f"char-LM, batch {self.batch}"

    @property
    def variants(self) -> tuple[str, ...]:
        return tuple(v for v, _ in self.grids)

    def lrs(self, variant: str) -> tuple[float, ...]:
        return dict(self.grids)[variant]


SGD_LM = (0.03, 0.1, 0.3, 0.5, 1.0)  # a CPU pilot (200 steps, seed 0): 1.0 diverged without BNP, broke with it
ADAM_LM = (3e-4, 1e-3, 3e-3, 1e-2)
# ViT: 600 steps at batch 60 (9 epochs' worth of images), 1,000 at batch 6 (1.5); LM: 800 steps of 32×64 bytes
# (the issue measured at 400). 174 runs, 139k steps, sized for about 5 minutes on one H200 with 10–12 processes
# if a step takes 3–8 ms there (an estimate); on a CPU about 7,000 thread-seconds (measured per step on one
# thread: ViT ≈ 12 / 39 ms at batch 6 / 60, LM ≈ 105 ms).
SETTINGS = (
    Setting("vit", 60, 600, tuple((v, (0.01, 0.03, 0.1, 0.3, 1.0)) for v in VIT_VARIANTS)),
    Setting("vit", 6, 1000, tuple((v, (0.003, 0.01, 0.03, 0.1, 0.3)) for v in VIT_VARIANTS)),
    Setting("lm", 32, 800, (("SGD", SGD_LM), ("SGD+BNP", SGD_LM), ("Adam", ADAM_LM), ("Adam+BNP", ADAM_LM))),
)


def quick(s: Setting) -> Setting:
    """``--quick``: a few steps, two rates per variant, 2 seeds, 2 evaluations on a few items (LM at batch 8)."""
    return replace(
        s,
        batch=8 if s.task == "lm" else s.batch,
        steps=6,
        grids=tuple((v, lrs[1:3]) for v, lrs in s.grids),
        seeds=2,
        evals=2,
        eval_items=50 if s.task == "vit" else 4,
    )


def scaled(s: Setting, length: float) -> Setting:
    """``--length``: every run ``length`` times as long (at least one step)."""
    return replace(s, steps=max(1, round(s.steps * length)))


@dataclass(frozen=True)
class Job:
    """One training run (picklable; the key of its result)."""

    task: str
    variant: str
    batch: int
    lr: float
    seed: int
    steps: int
    evals: int
    eval_items: int
    device: str
    cache: str | None

    @classmethod
    def of(cls, s: Setting, variant: str, lr: float, seed: int, device: str, cache: str | None) -> Job:
        return cls(s.task, variant, s.batch, lr, seed, s.steps, s.evals, s.eval_items, device, cache)

    @property
    def cost(self) -> float:
        """Rough relative run time (ms per step of one CPU thread), to start the longest runs first."""
        return self.steps * (105.0 if self.task == "lm" else 8.0 + 0.5 * self.batch)


@dataclass
class Run:
    """What one run recorded at its evaluation points (step 0 included): validation and test metric (ViT:
    accuracy; LM: loss in nats/char), the mean training loss since the previous point."""

    steps: list[int] = field(default_factory=list)
    val: list[float] = field(default_factory=list)
    test: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    diverged: bool = False
    seconds: float = 0.0  # training steps only, evaluations excluded (the steps after a divergence count too)

    @property
    def final(self) -> float:
        return self.test[-1]


def build(task: str, variant: str) -> tuple[nn.Module, BNPPreconditioner | None]:
    """The network of ``variant`` and BNP's preconditioner for it, if the variant names BNP."""
    net: nn.Module = ViT(norm="none" if variant.startswith("none") else "ln") if task == "vit" else CharLM()
    return net, BNPPreconditioner(net) if variant.endswith("+BNP") else None


def optimizer(task: str, variant: str, net: nn.Module, lr: float) -> torch.optim.Optimizer:
    if task == "lm" and variant.startswith("Adam"):
        return torch.optim.Adam(net.parameters(), lr=lr)
    return torch.optim.SGD(net.parameters(), lr=lr)


def lm_windows(ids: Tensor, context: int, limit: int) -> Tensor:
    """Non-overlapping (context + 1)-byte windows of ``ids`` (the first ``limit`` when > 0)."""
    n = (len(ids) - 1) // context
    idx = torch.arange(n * context).view(n, context)
    w = ids[torch.cat([idx, idx[:, -1:] + 1], 1)]
    return w[:limit] if limit > 0 else w


def evaluate(net: nn.Module, task: str, x: Tensor, y: Tensor | None, chunk: int = 512) -> float:
    """ViT: accuracy on images ``x`` with labels ``y``; LM: mean next-byte loss (nats) over windows ``x``."""
    net.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(x), chunk):
            xb = x[i : i + chunk]
            if task == "vit":
                assert y is not None
                total += float((net(xb).argmax(1) == y[i : i + chunk]).sum())
                count += len(xb)
            else:
                logits = net(xb[:, :-1])
                total += float(nn.functional.cross_entropy(logits.flatten(0, 1), xb[:, 1:].flatten(), reduction="sum"))
                count += xb[:, 1:].numel()
    net.train()
    return total / count


def train(job: Job) -> Run:
    """SGD or Adam for ``job.steps`` steps; a run whose training loss is not finite or exceeds 1e3 stops
    updating and is marked diverged. Same initial weights for every variant and rate of a seed (LayerNorm
    draws nothing), same batches too."""
    device = torch.device(job.device)
    data = load(job.cache)
    torch.manual_seed(job.seed)
    net, pre = build(job.task, job.variant)
    net.to(device)
    opt = optimizer(job.task, job.variant, net, job.lr)
    gen = torch.Generator().manual_seed(job.seed)
    if job.task == "vit":
        splits = {s: (x.to(device), y.to(device)) for s, (x, y) in data["digits"].items()}
        lim = job.eval_items or None
        evals = {s: (splits[s][0][:lim], splits[s][1][:lim]) for s in ("val", "test")}
        train_x, train_y = splits["train"]
    else:
        corpus = data["corpus"]
        context = 64
        evals = {s: (lm_windows(corpus[s], context, job.eval_items).to(device), None) for s in ("val", "test")}
        train_ids = corpus["train"].to(device)
        offsets = torch.arange(context + 1, device=device)

    def batch() -> tuple[Tensor, Tensor]:
        if job.task == "vit":
            idx = torch.randint(len(train_y), (job.batch,), generator=gen).to(device)
            return train_x[idx], train_y[idx]
        starts = torch.randint(len(train_ids) - context - 1, (job.batch, 1), generator=gen).to(device)
        w = train_ids[starts + offsets]
        return w[:, :-1], w[:, 1:]

    def loss_of(x: Tensor, y: Tensor) -> Tensor:
        out = net(x)
        return nn.functional.cross_entropy(out.flatten(0, 1) if job.task == "lm" else out, y.flatten())

    every = max(1, job.steps // job.evals)
    run = Run()
    pending: list[Tensor] = []  # losses since the last evaluation, read once per evaluation (no per-step sync)

    def record(step: int) -> None:
        run.steps.append(step)
        run.val.append(evaluate(net, job.task, *evals["val"]))
        run.test.append(evaluate(net, job.task, *evals["test"]))
        values = torch.stack(pending).tolist() if pending else []
        pending.clear()
        finite = all(math.isfinite(v) and v <= DIVERGED for v in values)
        run.diverged = run.diverged or not finite
        run.loss.append(sum(values) / len(values) if values and finite else math.nan)

    def sync() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    record(0)
    t0 = sync()
    for step in range(1, job.steps + 1):
        if not run.diverged:
            x, y = batch()
            opt.zero_grad(set_to_none=True)
            loss = loss_of(x, y)
            loss.backward()
            if pre is not None:
                pre.step()
            opt.step()
            pending.append(loss.detach())
        if step % every == 0 or step == job.steps:
            run.seconds += sync() - t0
            record(step)
            t0 = sync()
    if run.diverged:  # from the point that saw the divergence on, the metrics are those of a broken network
        first = next(i for i, v in enumerate(run.loss) if i > 0 and not math.isfinite(v))
        for i in range(first, len(run.steps)):
            run.val[i] = run.test[i] = CHANCE[job.task]
    return run


def task(job: Job) -> tuple[Job, Run]:
    """A worker process's unit of work, with one torch thread. A diverging run is recorded as such (``Run.diverged``);
    BNP's per-layer warning about its non-finite statistics would only fill the log, and is not shown."""
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*statistics were not finite", category=BNPWarning)
        return job, train(job)
