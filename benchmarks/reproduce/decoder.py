"""Experiment 9 (issue 44): a decoder of transposed convolutions, the setting where BatchNorm's batch coupling bites.

An autoencoder on the 28×28 digits (784 → 64 → 32·7·7, then two stride-2 ``ConvTranspose2d`` back to 1×28×28,
squared reconstruction error) trained with plain SGD and momentum 0.9 (``vanilla``), with BatchNorm after the
decoder's reshape and after its first transposed convolution (``BN``), with BNP (``BNP``: per-channel statistics of
the transposed convolutions, ``BNP-col``: exact per-column ones; BNP manages every layer), and with Adam (``Adam``),
at a small and a moderate batch. Every method at the rate of its own grid with the best validation error (averaged
over the last three evaluations and the seeds; a diverged run scores +∞); the test error of the chosen rate reported
over the seeds. BN is evaluated in eval mode (running statistics), as it would be deployed.

It runs alone: ``python -m benchmarks.reproduce --sections decoder`` writes only this section of ``RESULTS.md``
(``--quick``: a few steps, two rates per method).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import Tensor, nn

from benchmarks import worker_processes
from benchmarks.reproduce.sections import extract_section, splice_section
from benchmarks.reproduce.selection import mean
from example_projects.decoders import conv_autoencoder
from example_projects.mnist5k import load_mnist5k_splits
from lightning_bnp.core import BNPPreconditioner

NAME = "decoder"
HEADER = "## 9. A transposed-convolution decoder: SGD, BatchNorm, BNP and Adam"
METHODS = ("vanilla", "BN", "BNP", "BNP-col", "Adam")
SGD_RATES = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 4.0)
ADAM_RATES = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2)
QUICK_STEPS, QUICK_EVAL_SAMPLES = 12, 100
FIGURE = "decoder.png"  # in <out>/results/, drawn by ``plot``
COLORS = ("tab:gray", "tab:green", "tab:blue", "tab:red", "tab:orange")  # one per method, in METHODS' order


@dataclass(frozen=True)
class DecoderSetting:
    batch: int
    epochs: int
    seeds: int = 3
    evals: int = 10
    max_steps: int = 0  # > 0: stop after this many steps (--quick)
    eval_samples: int = 0  # > 0: errors on the first this many validation / test images (--quick)
    quick_rates: bool = False  # two rates per method (--quick)

    @property
    def steps(self) -> int:
        total = self.epochs * -(-len(data()["train"][0]) // self.batch)
        return min(total, self.max_steps) if self.max_steps else total

    @property
    def eval_steps(self) -> list[int]:
        """The steps after which ``train`` evaluates a run that does not diverge: 0, every ``steps // evals`` steps
        before the last, and the last."""
        every = max(1, self.steps // self.evals)
        return [*range(0, self.steps, every), self.steps]

    def rates(self, method: str) -> tuple[float, ...]:
        rates = ADAM_RATES if method == "Adam" else SGD_RATES
        return rates[2:4] if self.quick_rates else rates


SETTINGS = (DecoderSetting(batch=4, epochs=1), DecoderSetting(batch=64, epochs=6))


def quick(s: DecoderSetting, seeds: int | None) -> DecoderSetting:
    return replace(
        s, seeds=seeds or 2, evals=3, max_steps=QUICK_STEPS, eval_samples=QUICK_EVAL_SAMPLES, quick_rates=True
    )


@dataclass(frozen=True)
class DecoderJob:
    setting: DecoderSetting
    method: str
    lr: float
    seed: int


@dataclass
class DecoderRun:
    val: list[float] = field(default_factory=list)  # validation MSE at each evaluation (step 0 first)
    test: list[float] = field(default_factory=list)
    diverged: bool = False
    seconds: float = 0.0


@functools.cache
def data() -> dict[str, tuple[Tensor, Tensor]]:
    return load_mnist5k_splits()


def autoencoder(method: str) -> nn.Sequential:
    """The network (the ``autoencoder`` example's); ``BN`` puts BatchNorm2d after the decoder's reshape and its first
    transposed convolution."""
    return conv_autoencoder(norm="bn" if method == "BN" else "none")


def error(net: nn.Module, split: str, samples: int) -> float:
    x = data()[split][0]
    x = x[:samples] if samples else x
    net.eval()
    with torch.no_grad():
        value = float((net(x) - x).square().mean())
    net.train()
    return value


def train(job: DecoderJob) -> DecoderRun:
    """``job.setting.steps`` steps on the training digits (reshuffled every epoch); a loss that is not finite or
    above 1e3 stops the run, marked diverged."""
    s = job.setting
    torch.manual_seed(job.seed)  # the same initial weights for every method and rate of a seed
    net = autoencoder(job.method)
    pre = None
    if job.method.startswith("BNP"):
        pre = BNPPreconditioner(net, conv_statistics="column" if job.method.endswith("-col") else "channel")
    if job.method == "Adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(net.parameters(), lr=job.lr)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=job.lr, momentum=0.9)
    x = data()["train"][0]
    gen = torch.Generator().manual_seed(job.seed)
    every = max(1, s.steps // s.evals)  # evaluations at s.eval_steps
    run, step, start = DecoderRun(), 0, time.perf_counter()
    run.val.append(error(net, "val", s.eval_samples))
    run.test.append(error(net, "test", s.eval_samples))
    while step < s.steps and not run.diverged:
        for idx in torch.randperm(len(x), generator=gen).split(s.batch):
            loss = (net(x[idx]) - x[idx]).square().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if pre is not None:
                pre.step()
            opt.step()
            value = loss.item()
            run.diverged = not math.isfinite(value) or value > 1e3
            step += 1
            if run.diverged or step == s.steps:
                break
            if step % every == 0:
                run.val.append(error(net, "val", s.eval_samples))
                run.test.append(error(net, "test", s.eval_samples))
    if not run.diverged:
        run.val.append(error(net, "val", s.eval_samples))
        run.test.append(error(net, "test", s.eval_samples))
    run.seconds = time.perf_counter() - start
    return run


def task(job: DecoderJob) -> tuple[DecoderJob, DecoderRun]:
    torch.set_num_threads(1)
    return job, train(job)


def jobs(settings: tuple[DecoderSetting, ...]) -> list[DecoderJob]:
    return [
        DecoderJob(s, m, lr, seed) for s in settings for m in METHODS for lr in s.rates(m) for seed in range(s.seeds)
    ]


def settings_of(results: dict[DecoderJob, DecoderRun]) -> tuple[DecoderSetting, ...]:
    """The settings ``results`` were trained at, by batch (``--rerender`` draws the section from them)."""
    return tuple(sorted({job.setting for job in results}, key=lambda s: s.batch))


def train_all(settings: tuple[DecoderSetting, ...], workers: int) -> dict[DecoderJob, DecoderRun]:
    """Every run, the small-batch (longest) ones first."""
    ordered = sorted(jobs(settings), key=lambda j: j.setting.batch)
    with ProcessPoolExecutor(max_workers=workers, mp_context=worker_processes("benchmarks.reproduce.decoder")) as pool:
        return dict(pool.map(task, ordered, chunksize=1))


def score(runs: list[DecoderRun]) -> float:
    """Validation error over the last three evaluations and the seeds; +∞ if a seed diverged."""
    return math.inf if any(r.diverged for r in runs) else mean([mean(r.val[-3:]) for r in runs])


@dataclass
class DecoderChoice:
    method: str
    lr: float
    runs: list[DecoderRun]
    diverged: dict[float, int]  # rate -> diverged seeds

    @property
    def test(self) -> list[float]:
        return [r.test[-1] for r in self.runs]


def choose(s: DecoderSetting, method: str, results: dict[DecoderJob, DecoderRun]) -> DecoderChoice:
    grid = {lr: [results[DecoderJob(s, method, lr, seed)] for seed in range(s.seeds)] for lr in s.rates(method)}
    best = min(grid, key=lambda lr: (score(grid[lr]), lr))
    return DecoderChoice(method, best, grid[best], {lr: sum(r.diverged for r in runs) for lr, runs in grid.items()})


def fmt(values: list[float]) -> str:
    finite = [v * 1e3 for v in values if math.isfinite(v)]
    return f"{mean(finite):.2f} [{min(finite):.2f}–{max(finite):.2f}]" if finite else "diverged"


def section(settings: tuple[DecoderSetting, ...], results: dict[DecoderJob, DecoderRun], note: str) -> list[str]:
    lines = [
        f"{HEADER}\n",
        "An autoencoder whose decoder upsamples with two stride-2 `ConvTranspose2d` (784 → 64 → 32·7·7 → 16·14·14 → "
        "1·28·28), squared reconstruction error, on the 4,000 training digits; SGD with momentum 0.9 (`vanilla`), "
        "with BatchNorm in the decoder (`BN`, evaluated with its running statistics), with BNP on every layer "
        '(`BNP`: per-channel statistics of the transposed convolutions, `BNP-col`: `conv_statistics="column"`, '
        "exact), and Adam. Each method at the rate of its grid with the best validation error (SGD "
        f"{', '.join(f'{r:g}' for r in SGD_RATES)}; Adam {', '.join(f'{r:g}' for r in ADAM_RATES)}; a rate where "
        "a seed diverged is not chosen); test MSE ×10³ at the end, mean [min–max] over the seeds. " + note + "\n",
        f"![decoder](results/{FIGURE})\n",
        "| batch, steps | method | chosen rate | test MSE ×10³ | rates with a diverged seed |",
        "|---|---|---|---|---|",
    ]
    best: dict[int, tuple[str, float]] = {}
    for s in settings:
        for method in METHODS:
            c = choose(s, method, results)
            diverged = ", ".join(f"{lr:g} ({n}/{s.seeds})" for lr, n in c.diverged.items() if n) or "none"
            edge = " (grid edge)" if c.lr in (s.rates(method)[0], s.rates(method)[-1]) else ""
            lines.append(f"| {s.batch}, {s.steps} | {method} | {c.lr:g}{edge} | {fmt(c.test)} | {diverged} |")
            value = mean(c.test) if not any(r.diverged for r in c.runs) else math.inf
            if value < best.get(s.batch, ("", math.inf))[1]:
                best[s.batch] = (method, value)
    lines.append("")
    for s in settings:
        bnp = min(mean(choose(s, m, results).test) for m in ("BNP", "BNP-col"))
        vanilla, bn = (mean(choose(s, m, results).test) for m in ("vanilla", "BN"))
        winner = best.get(s.batch, ("none", math.nan))[0]
        lines.append(
            f"- Batch {s.batch}: lowest test error {winner}; BNP's best form "
            f"{'below' if bnp < vanilla else 'not below'} vanilla SGD ({bnp * 1e3:.2f} vs {vanilla * 1e3:.2f}) and "
            f"{'below' if bnp < bn else 'not below'} BatchNorm ({bn * 1e3:.2f})."
        )
    return lines


def plot(settings: Sequence[DecoderSetting], results: dict[DecoderJob, DecoderRun], path: Path) -> None:
    """One panel per setting: each method's validation MSE over the training steps at its chosen rate (mean over the
    seeds, min–max band; a diverged seed counts until it diverged), log scale where the errors span decades."""
    from benchmarks.reproduce.plotting import curves, plt_module, save_png

    plt = plt_module()
    fig, grid = plt.subplots(1, len(settings), figsize=(4.5 * len(settings), 3.6), squeeze=False)
    for ax, s in zip(grid[0], settings):
        steps, finite = s.eval_steps, []
        for color, method in zip(COLORS, METHODS):
            c = choose(s, method, results)
            values = [(r.val + [math.nan] * len(steps))[: len(steps)] for r in c.runs]
            style = "--" if method == "BNP-col" else "-"  # visible where it lies on BNP's curve
            curves(ax, steps, values, f"{method} (lr {c.lr:g})", color, ls=style)
            finite += [v for row in values for v in row if math.isfinite(v) and v > 0]
        if finite and max(finite) > 10 * min(finite):
            ax.set_yscale("log")
        ax.set_title(f"batch {s.batch}, {s.steps} steps, {s.seeds} seed{'s' * (s.seeds > 1)}")
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    grid[0][0].set_ylabel("validation MSE (chosen rate)")
    fig.tight_layout()
    save_png(fig, path)


def splice(report: str, lines: list[str]) -> str:
    """``report`` with this section replaced by ``lines`` (or inserted before the closing run summary)."""
    return splice_section(report, HEADER, lines)


def extract(report: str) -> list[str]:
    """This section's lines in ``report`` (empty if none): a full ``benchmarks.reproduce`` run keeps them."""
    return extract_section(report, HEADER)
