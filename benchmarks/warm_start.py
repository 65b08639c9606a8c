"""Paper's running statistics (μ = 0, σ² = 1 start) vs bias-corrected ones, side by side.

With ρ = 0.99 the paper's running statistics are dominated by their initial values for the
first ~100 steps. This script trains the paper's FC network (3×100, ReLU) with BNP on the bundled
digits at batch 60 for both warm starts over a learning-rate grid and several seeds, in one
process, and writes ``benchmarks/out/warm_start.md`` and ``warm_start.png``. The learning rate
is chosen on the validation split; the test split is not used.

Run: ``python -m benchmarks.warm_start [--epochs 10] [--seeds 3]``
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from torch import nn

from example_projects.digits import load_digits_splits
from example_projects.models import fc_network
from lightning_bnp.core import BNPPreconditioner

OUT = Path(__file__).parent / "out"


def train(
    bias_correction: bool, lr: float, seed: int, epochs: int, batch_size: int, pixel_scale: float
) -> dict[str, list[float]]:
    torch.manual_seed(seed)
    splits = load_digits_splits()
    x, y = splits["train"]
    xv, yv = splits["val"]
    x, xv = x * pixel_scale, xv * pixel_scale
    model = fc_network()
    pre = BNPPreconditioner(model, bias_correction=bias_correction)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss_fn = nn.CrossEntropyLoss()
    losses, val_acc = [], []
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        model.train()
        for idx in torch.randperm(len(y), generator=gen).split(batch_size):
            opt.zero_grad()
            loss = loss_fn(model(x[idx]), y[idx])
            loss.backward()
            pre.step()
            opt.step()
            losses.append(loss.item() if math.isfinite(loss.item()) else float("nan"))
        model.eval()
        with torch.no_grad():
            val_acc.append((model(xv).argmax(1) == yv).float().mean().item())
    return {"loss": losses, "val_acc": val_acc}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=60)
    parser.add_argument("--lrs", type=float, nargs="+", default=[0.1, 0.3, 1.0, 3.0])
    parser.add_argument(
        "--pixel-scale", type=float, default=1.0, help="multiply the [0, 1] pixels (16 gives the raw 0–16 values)"
    )
    args = parser.parse_args()
    tag = "" if args.pixel_scale == 1.0 else f"_x{args.pixel_scale:g}"
    OUT.mkdir(exist_ok=True)

    variants = {"paper (μ=0, σ²=1 start)": False, "bias-corrected": True}
    results: dict[tuple[str, float], list[dict[str, list[float]]]] = {}
    for name, bc in variants.items():
        for lr in args.lrs:
            results[name, lr] = [
                train(bc, lr, s, args.epochs, args.batch_size, args.pixel_scale) for s in range(args.seeds)
            ]

    def final_val(name: str, lr: float) -> list[float]:
        return [r["val_acc"][-1] for r in results[name, lr]]

    def early_val(name: str, lr: float) -> list[float]:
        return [r["val_acc"][0] for r in results[name, lr]]

    lines = [
        f"# BNP warm start: FC 3×100 on digits, batch {args.batch_size}, {args.epochs} epochs, "
        f"{args.seeds} seeds, pixels in [0, {args.pixel_scale:g}] (mean [min, max] validation accuracy)\n",
        "| variant | lr | after epoch 1 | final | diverged runs |",
        "|---|---|---|---|---|",
    ]
    best: dict[str, tuple[float, float]] = {}
    for name in variants:
        for lr in args.lrs:
            fin, early = final_val(name, lr), early_val(name, lr)
            diverged = sum(not math.isfinite(r["loss"][-1]) or r["loss"][-1] > 2.3 for r in results[name, lr])
            mean_fin = sum(fin) / len(fin)
            lines.append(
                f"| {name} | {lr:g} | {sum(early) / len(early):.3f} | {mean_fin:.3f} "
                f"[{min(fin):.3f}, {max(fin):.3f}] | {diverged}/{args.seeds} |"
            )
            if name not in best or mean_fin > best[name][1]:
                best[name] = (lr, mean_fin)
    (paper_lr, paper_acc), (bc_lr, bc_acc) = best["paper (μ=0, σ²=1 start)"], best["bias-corrected"]
    summary = (
        f"\nBest (by validation): paper {paper_acc:.3f} at lr {paper_lr:g}; bias-corrected {bc_acc:.3f} "
        f"at lr {bc_lr:g}; ratio bias-corrected/paper = {bc_acc / paper_acc:.3f}"
    )
    lines.append(summary)
    (OUT / f"warm_start{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(args.lrs), figsize=(4 * len(args.lrs), 3.2), sharey=True)
    for ax, lr in zip(axes, args.lrs):
        for name in variants:
            curves = torch.tensor([r["loss"] for r in results[name, lr]])
            mean = curves.nanmean(0)
            ax.plot(mean.numpy(), label=name)
            ax.fill_between(range(curves.shape[1]), curves.amin(0).numpy(), curves.amax(0).numpy(), alpha=0.2)
        ax.set_title(f"lr {lr:g}")
        ax.set_yscale("log")
        ax.set_xlabel("step")
    axes[0].set_ylabel("training loss")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(OUT / f"warm_start{tag}.png", dpi=100)
    print(f"wrote {OUT / f'warm_start{tag}.md'} and {OUT / f'warm_start{tag}.png'}")


if __name__ == "__main__":
    main()
