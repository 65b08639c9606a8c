"""``python -m benchmarks.recurrent``: a character-level LSTM and GRU trained with vanilla SGD, BNP (+ SGD) and Adam,
at batch 32 and at batch 1 (online), on a text that ships with Python; writes the section "8. Recurrent layers" into
``<out>/RESULTS.md`` (``--quick``: a smoke run into ``benchmarks/out/quick/``).

The text is the docstrings of a fixed list of standard-library modules and of their public members
(:func:`corpus`): English prose with code, the same on every machine with the same Python. It is split in order into
train / validation / test (80 / 10 / 10 %). A model is an embedding, one one-layer recurrent module and a linear
read-out; each step trains on randomly drawn windows of ``WINDOW`` characters (the recurrent state starts at zero),
the loss is the mean cross-entropy of the next character. Every method clips the gradient's norm at ``CLIP`` (after
BNP's transform), as character models usually are. Each method runs at every rate of its grid; the rate is chosen on
the validation split, and the test split reports bits per character (bpc), mean [min–max] over seeds, a diverged seed
counted apart. Rule of the verdict: a method is ahead of another where its mean test bpc is lower by more than the
larger of the two spreads (max − min over seeds), behind where higher by as much, level otherwise.
"""

from __future__ import annotations

import argparse
import math
import os
import pickle
import platform
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from benchmarks import worker_processes
from benchmarks.reproduce.sections import extract_section, splice_section
from example_projects.char_text import EMBED, HIDDEN, MODULES, CharRNN, corpus, text_splits
from lightning_bnp.core import BNPPreconditioner

__all__ = ["CharRNN", "corpus", "extract", "main", "section"]

ROOT = Path(__file__).parent
HEADER = "## 8. Recurrent layers: a character-level LSTM and GRU"
WINDOW, CLIP = 32, 5.0
LRS = {"vanilla": (0.1, 0.3, 1.0, 3.0), "BNP": (0.1, 0.3, 1.0, 3.0), "Adam": (1e-3, 3e-3, 1e-2)}
SETTINGS = (("LSTM", 32, 1500), ("GRU", 32, 1500), ("LSTM", 1, 3000), ("GRU", 1, 3000))  # (cell, batch, steps)


@dataclass(frozen=True)
class Job:
    cell: str
    batch: int
    steps: int
    method: str
    lr: float
    seed: int
    quick: bool


def _splits() -> tuple[Tensor, Tensor, Tensor, int]:
    splits, vocabulary = text_splits()
    return splits["train"], splits["val"], splits["test"], vocabulary


def _bpc(model: nn.Module, data: Tensor, limit: int) -> float:
    """Bits per character of ``data`` in non-overlapping windows (the first ``limit`` characters when > 0)."""
    data = data[:limit] if limit > 0 else data
    windows = (len(data) - 1) // WINDOW
    x = data[: windows * WINDOW].view(windows, WINDOW)
    y = data[1 : windows * WINDOW + 1].view(windows, WINDOW)
    model.eval()
    with torch.no_grad():
        total = sum(
            nn.functional.cross_entropy(model(x[i : i + 256]).flatten(0, 1), y[i : i + 256].flatten(), reduction="sum")
            for i in range(0, windows, 256)
        )
    model.train()
    return float(total) / (windows * WINDOW) / math.log(2)


def task(job: Job) -> tuple[Job, float, float, bool, float]:
    """Train one run: (job, validation bpc, test bpc, diverged, seconds)."""
    torch.set_num_threads(1)
    train, valid, test, vocabulary = _splits()
    torch.manual_seed(job.seed)
    model = CharRNN(job.cell, vocabulary)
    pre = BNPPreconditioner(model) if job.method == "BNP" else None
    optimizer: torch.optim.Optimizer = (
        torch.optim.Adam(model.parameters(), lr=job.lr)
        if job.method == "Adam"
        else torch.optim.SGD(model.parameters(), lr=job.lr)
    )
    g = torch.Generator().manual_seed(1000 + job.seed)
    start, diverged = time.perf_counter(), False
    for _ in range(job.steps):
        at = torch.randint(len(train) - WINDOW - 1, (job.batch,), generator=g)
        x = torch.stack([train[i : i + WINDOW] for i in at.tolist()])
        y = torch.stack([train[i + 1 : i + WINDOW + 1] for i in at.tolist()])
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        if not torch.isfinite(loss):
            diverged = True
            break
        loss.backward()
        if pre is not None:
            pre.step()
        nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
    seconds = time.perf_counter() - start
    limit = 4000 if job.quick else 0
    if diverged:
        return job, math.inf, math.inf, True, seconds
    valid_bpc, test_bpc = _bpc(model, valid, limit), _bpc(model, test, limit)
    diverged = not math.isfinite(valid_bpc)
    return job, valid_bpc, test_bpc, diverged, seconds


def _summary(values: list[float]) -> str:
    if not values:
        return "—"
    return f"{statistics.fmean(values):.3f} [{min(values):.3f}–{max(values):.3f}]"


def section(results: list[tuple[Job, float, float, bool, float]], seeds: int, note: str) -> list[str]:
    """The report's section: per setting and method the rate chosen on validation and its test bpc; verdicts."""
    lines = [HEADER, "", note, ""]
    lines += ["| model | batch | steps | method | lr (chosen on validation) | test bpc, mean [min–max] | diverged | "
              "s / run |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    verdicts = []
    for cell, batch, _ in SETTINGS:
        chosen: dict[str, list[float]] = {}
        for method in LRS:
            runs = [r for r in results if (r[0].cell, r[0].batch, r[0].method) == (cell, batch, method)]
            if not runs:
                continue
            by_lr: dict[float, list[tuple[Job, float, float, bool, float]]] = {}
            for run in runs:
                by_lr.setdefault(run[0].lr, []).append(run)
            lr = min(by_lr, key=lambda k: statistics.fmean([r[1] for r in by_lr[k]]))  # inf where a seed diverged
            best = by_lr[lr]
            tests = [r[2] for r in best if not r[3]]
            chosen[method] = tests
            lines.append(
                f"| {cell} | {batch} | {best[0][0].steps} | {method} | {lr:g} | {_summary(tests)} | "
                f"{sum(r[3] for r in best)}/{len(best)} | {statistics.fmean(r[4] for r in best):.0f} |"
            )
        for method in ("vanilla", "Adam"):
            if "BNP" in chosen and method in chosen and chosen["BNP"] and chosen[method]:
                verdicts.append(f"- {cell}, batch {batch}: BNP is {_verdict(chosen['BNP'], chosen[method])} {method}.")
    lines += ["", *verdicts, "", f"Seeds per configuration: {seeds}; learning-rate grids: {_grids()}."]
    return lines


def extract(report: str) -> list[str]:
    """§8's lines in ``report`` (empty if it has none): ``benchmarks.reproduce`` keeps them when it rewrites."""
    return extract_section(report, HEADER)


def _verdict(ours: list[float], theirs: list[float]) -> str:
    if len(ours) < 2 or len(theirs) < 2:
        return "not compared (one seed: no spread) with"
    spread = max(max(ours) - min(ours), max(theirs) - min(theirs))
    gap = statistics.fmean(ours) - statistics.fmean(theirs)
    return "ahead of" if gap < -spread else "behind" if gap > spread else "level with"


def plot(results: list[tuple[Job, float, float, bool, float]], path: Path) -> None:
    """Validation bpc against the learning rate, per setting and method (mean over the seeds, min–max band; a rate
    where a seed diverged is left out): how each method's best compares, and how wide its good range is."""
    from benchmarks.reproduce.plotting import plt_module, save_png

    plt = plt_module()
    fig, grid = plt.subplots(1, len(SETTINGS), figsize=(4 * len(SETTINGS), 3.4), squeeze=False)
    axes = grid[0]
    for ax, (cell, batch, _) in zip(axes, SETTINGS):
        steps = next((r[0].steps for r in results if (r[0].cell, r[0].batch) == (cell, batch)), 0)
        for color, method in zip(("tab:gray", "tab:blue", "tab:orange"), LRS):
            rates, mean, low, high = [], [], [], []
            for lr in LRS[method]:
                runs = [
                    r for r in results if (r[0].cell, r[0].batch, r[0].method, r[0].lr) == (cell, batch, method, lr)
                ]
                if runs and not any(r[3] for r in runs):
                    values = [r[1] for r in runs]
                    rates.append(lr)
                    mean.append(statistics.fmean(values))
                    low.append(min(values))
                    high.append(max(values))
            ax.plot(rates, mean, "o-", color=color, label=method)
            ax.fill_between(rates, low, high, color=color, alpha=0.2)
        ax.set_xscale("log")
        ax.set_title(f"{cell}, batch {batch}, {steps} steps")
        ax.set_xlabel("learning rate")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation bits per character")
    axes[0].legend()
    fig.tight_layout()
    save_png(fig, path)


def _grids() -> str:
    return "; ".join(f"{m} {', '.join(f'{lr:g}' for lr in lrs)}" for m, lrs in LRS.items())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.recurrent", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few steps per run, one seed: checks the script")
    parser.add_argument("--out", type=Path, default=None, help="folder of the RESULTS.md to write the section into")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per configuration (default 3; 1 with --quick)")
    parser.add_argument("--workers", type=int, default=None, help="training processes (default: CPU count, at most 4)")
    parser.add_argument(
        "--rerender", action="store_true", help="write the section and its figure from the saved runs, training nothing"
    )
    args = parser.parse_args(argv)
    seeds = args.seeds or (1 if args.quick else 3)
    workers = args.workers or min(os.cpu_count() or 1, 4)
    out = args.out or (ROOT / "out" / "quick" if args.quick else ROOT)
    jobs = [
        Job(cell, batch, 12 if args.quick else steps, method, lr, seed, args.quick)
        for cell, batch, steps in SETTINGS
        for method, lrs in LRS.items()
        for lr in (lrs[1:3] if args.quick else lrs)
        for seed in range(seeds)
    ]
    saved = out / "results" / "recurrent.pkl"
    if args.rerender:
        results, seconds, workers = pickle.loads(saved.read_bytes())
    else:
        results, seconds = _train(jobs, workers)
        saved.parent.mkdir(parents=True, exist_ok=True)
        saved.write_bytes(pickle.dumps((results, seconds, workers)))
    plot(results, out / "results" / "recurrent.png")
    train, valid, test, vocabulary = _splits()
    note = (
        ("**QUICK MODE: tiny runs, the numbers mean nothing.** " if args.quick else "")
        + f"Generated by `python -m benchmarks.recurrent` on {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, torch {torch.__version__}, {workers} worker processes; wall time "
        f"{seconds / 60:.1f} min. Text: the docstrings of {len(MODULES)} standard-library modules and their public "
        f"members ({len(train) + len(valid) + len(test):,} characters, {vocabulary} distinct; train / validation / "
        f"test {len(train):,} / {len(valid):,} / {len(test):,}). Model: embedding {EMBED}, one {HIDDEN}-unit "
        f"recurrent layer, linear read-out; windows of {WINDOW} characters drawn at random, state from zero; "
        f"gradient norm clipped at {CLIP:g} for every method (after BNP's transform). BNP: `BNPPreconditioner` "
        "defaults (the recurrent layer's W_ih, W_hh and the read-out; the embedding left to SGD) with plain SGD."
    )
    lines = section(results, seeds, note)
    lines[4:4] = ["![recurrent](results/recurrent.png)", ""]
    out.mkdir(parents=True, exist_ok=True)
    path = out / "RESULTS.md"
    report = path.read_text() if path.exists() else ""
    path.write_text(splice_section(report, HEADER, lines))
    print("\n".join(lines))
    print(f"wrote the section into {path} in {seconds:.0f} s")


def _train(jobs: list[Job], workers: int) -> tuple[list[tuple[Job, float, float, bool, float]], float]:
    """Every job in ``workers`` processes: (the results, wall seconds)."""
    start = time.perf_counter()
    # the fork server preloads the text and the network (torch with them), not this module: run as
    # `python -m benchmarks.recurrent`, the server imports this module as the workers' __main__ itself, and a
    # preloaded copy would be imported twice (runpy's RuntimeWarning)
    with ProcessPoolExecutor(max_workers=workers, mp_context=worker_processes("example_projects.char_text")) as pool:
        results = list(pool.map(task, jobs, chunksize=1))
    return results, time.perf_counter() - start


if __name__ == "__main__":
    main()
