"""Cost of Weight Conditioning per training step and at inference, against the vanilla network.

The paper (004, §6) admits an overhead: every forward recomputes E·W from the free parameter and
every backward differentiates through the norms. This script measures it in one process, round-robin
over every (model, variant) so that drift and load from other processes hit all rows alike, as the
median time of

* one training step — forward, backward, SGD step; a plain torch loop, no Lightning — for
  ``vanilla``, ``WC first+last`` (row equilibration of the first and last layer: the paper's CNN
  recipe, §6.1) and ``WC all`` (every Conv/Linear layer);
* one inference forward (eval, ``no_grad``) for ``vanilla``, ``WC all`` still parametrized, and
  ``WC all`` after :func:`bake_weight_conditioning` (plain modules again);

on the 5-layer CNN of the BNP paper's CNN experiments (3×3 convolutions 32-64-32, two dense layers;
:func:`example_projects.models.cnn5`) at batch 128 on CIFAR-sized 3×32×32 inputs and on 1×28×28 MNIST-sized
inputs (the examples' offline data: less convolution work per weight, so a worse case for the
relative overhead), and torchvision's ResNet-18 (``num_classes=10``) at batch 32
on 3×32×32 inputs. Inputs are random: only time is measured. Writes
``benchmarks/out/weight_conditioning.md`` and ``.png``.

Run: ``python -m benchmarks.weight_conditioning [--repeats 30] [--threads 2] [--quick]`` (about 2 min
on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from example_projects.models import cnn5
from lightning_bnp.core.conditioning import apply_weight_conditioning, bake_weight_conditioning

OUT = Path(__file__).parent / "out"
TRAIN_VARIANTS = ("vanilla", "WC first+last", "WC all")
INFER_VARIANTS = ("vanilla", "WC all", "WC all baked")
Run = Callable[[int], None]
Key = tuple[str, str]  # (model, variant)


def make_model(kind: str, args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(0)  # every variant starts from the same weights
    if kind.startswith("CNN5"):
        c, h, _ = cases(args)[kind][1]
        return cnn5(c, h)
    import torchvision

    return torchvision.models.resnet18(num_classes=10)


def cases(args: argparse.Namespace) -> dict[str, tuple[int, tuple[int, ...]]]:
    """model -> (batch, input shape)."""
    return {"CNN5 3×32×32": (args.cnn_batch, (3, 32, 32)),
            "CNN5 1×28×28": (args.cnn_batch, (1, 28, 28)),
            "ResNet-18": (args.resnet_batch, (3, 32, 32))}  # fmt: skip


def build_train(kind: str, variant: str, batch: int, shape: tuple[int, ...], args: argparse.Namespace) -> Run:
    model = make_model(kind, args).train()
    if variant != "vanilla":
        apply_weight_conditioning(model, layers="first_and_last" if "first" in variant else "all")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(batch, *shape, generator=gen), torch.randint(0, 10, (batch,), generator=gen)) for _ in range(4)
    ]
    loss_fn = nn.CrossEntropyLoss()

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    return step


def build_infer(kind: str, variant: str, batch: int, shape: tuple[int, ...], args: argparse.Namespace) -> Run:
    model = make_model(kind, args).eval()
    if variant != "vanilla":
        apply_weight_conditioning(model, layers="all")
        if variant.endswith("baked"):
            bake_weight_conditioning(model)
    x = torch.randn(batch, *shape, generator=torch.Generator().manual_seed(1))

    def forward(i: int) -> None:
        with torch.no_grad():
            model(x)

    return forward


def time_runs(runs: dict[Key, Run], repeats: int, warmup: int, target_s: float) -> dict[Key, list[float]]:
    """Seconds per call of every entry, one sample per repeat; each sample runs about ``target_s`` of
    calls, and every repeat visits every entry once in an order rotated per repeat."""
    inner = {}
    for key, run in runs.items():
        for i in range(warmup):
            run(i)
        t0 = time.perf_counter()
        for i in range(3):
            run(i)
        inner[key] = max(1, round(target_s / ((time.perf_counter() - t0) / 3)))
    samples: dict[Key, list[float]] = {key: [] for key in runs}
    keys = list(runs)
    for r in range(repeats):
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            t0 = time.perf_counter()
            for i in range(inner[key]):
                runs[key](i)
            samples[key].append((time.perf_counter() - t0) / inner[key])
    return samples


def summarize(samples: dict[Key, list[float]]) -> tuple[dict[Key, float], dict[Key, float]]:
    """Median time per entry, and the median over repeats of each entry's time divided by the vanilla
    time of the same model *in the same repeat* (paired: robust to load that drifts between repeats)."""
    med = {key: statistics.median(s) for key, s in samples.items()}
    ratio = {
        (kind, v): statistics.median(a / b for a, b in zip(s, samples[kind, "vanilla"]))
        for (kind, v), s in samples.items()
    }
    return med, ratio


def table(
    title: str, variants: tuple[str, ...], med: dict[Key, float], ratio: dict[Key, float], models: dict
) -> list[str]:
    head = " | ".join(f"{v} ms" for v in variants)
    ratios = " | ".join(f"{v} / vanilla" for v in variants[1:])
    lines = [f"\n## {title}\n", f"| model | batch | {head} | {ratios} |", "|---" * (2 + 2 * len(variants) - 1) + "|"]
    for kind, (batch, _) in models.items():
        times = " | ".join(f"{med[kind, v] * 1e3:.2f}" for v in variants)
        rel = " | ".join(f"{ratio[kind, v]:.3f}" for v in variants[1:])
        lines.append(f"| {kind} | {batch} | {times} | {rel} |")
    return lines


def plot(train: dict[Key, float], infer: dict[Key, float], models: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, med, variants, name in ((axes[0], train, TRAIN_VARIANTS, "training step"),
                                    (axes[1], infer, INFER_VARIANTS, "inference forward")):  # fmt: skip
        width = 0.8 / len(variants)
        top = 1.0
        for k, variant in enumerate(variants):
            rel = [med[kind, variant] for kind in models]  # paired ratios to vanilla
            top = max(top, *rel)
            bars = ax.bar([i + (k - 1) * width for i in range(len(models))], rel, width, label=variant)
            ax.bar_label(bars, fmt="%.3f", fontsize=7)
        ax.axhline(1.05, color="grey", ls="--", lw=0.8)
        ax.set_xticks(range(len(models)), [f"{kind}\nbatch {b}" for kind, (b, _) in models.items()])
        ax.set_ylabel(f"{name} time / vanilla")
        ax.set_ylim(0.8, max(1.3, 1.1 * top))
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30, help="timed samples per variant (the median is reported)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--cnn-batch", type=int, default=128)
    parser.add_argument("--resnet-batch", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="tiny repeats: a smoke test of a few seconds")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    repeats, warmup, target_s = (2, 1, 1e-3) if args.quick else (args.repeats, 5, 0.1)
    tag = "_quick" if args.quick else ""

    start = time.perf_counter()
    models = cases(args)
    train_runs = {
        (kind, v): build_train(kind, v, b, s, args) for kind, (b, s) in models.items() for v in TRAIN_VARIANTS
    }
    infer_runs = {
        (kind, v): build_infer(kind, v, b, s, args) for kind, (b, s) in models.items() for v in INFER_VARIANTS
    }
    train_med, train = summarize(time_runs(train_runs, repeats, warmup, target_s))
    infer_med, infer = summarize(time_runs(infer_runs, repeats, warmup, target_s))
    elapsed = time.perf_counter() - start

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    setup = f"cpu, {torch.get_num_threads()} threads, torch {torch.__version__}, {repeats} repeats"
    lines = [f"# Weight Conditioning cost (median ms; {setup})\n",
             "Ratios are medians of per-repeat ratios to the vanilla run of the same repeat. "
             f"Load average (1 min) at the end: {load:.1f} on {os.cpu_count()} CPUs."]  # fmt: skip
    lines += table(
        "Training step (forward + backward + SGD), row equilibration", TRAIN_VARIANTS, train_med, train, models
    )
    lines += table("Inference forward (eval, no_grad)", INFER_VARIANTS, infer_med, infer, models)
    lines.append("")
    for kind in models:
        lines.append(
            f"{kind} batch {models[kind][0]}: WC first+last / vanilla = {train[kind, 'WC first+last']:.3f}, "
            f"WC all / vanilla = {train[kind, 'WC all']:.3f} (training; target <= 1.05), "
            f"baked / vanilla = {infer[kind, 'WC all baked']:.3f} (inference)"
        )
    lines.append(f"\nMeasuring took {elapsed:.1f} s.")
    print("\n".join(lines))
    OUT.mkdir(exist_ok=True)
    (OUT / f"weight_conditioning{tag}.md").write_text("\n".join(lines) + "\n")
    plot(train, infer, models, OUT / f"weight_conditioning{tag}.png", f"Weight Conditioning cost ({setup})")
    print(f"wrote {OUT / f'weight_conditioning{tag}.md'} and {OUT / f'weight_conditioning{tag}.png'}")


if __name__ == "__main__":
    main()
