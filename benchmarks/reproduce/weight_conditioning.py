"""Experiment 4: BN vs BN + Weight Conditioning at large learning rates, against paper 004 Fig. 1."""

from __future__ import annotations

from pathlib import Path

from benchmarks.reproduce.plotting import band, plt_module, save_png
from benchmarks.reproduce.runs import Job, Run, runs_of
from benchmarks.reproduce.selection import fmt_range, mean, verdict
from benchmarks.reproduce.settings import Setting

TRAINS = 0.9  # a rate "trains" when the mean final test accuracy over the seeds is at least this


def final_accuracies(s: Setting, results: dict[Job, Run]) -> dict[tuple[str, float], list[float]]:
    """(method, lr) -> the seeds' final test accuracies over the sweep."""
    return {(m, lr): [r.final for r in runs_of(results, s, m, lr)] for m in s.methods for lr in s.lrs}


def section(s: Setting, results: dict[Job, Run]) -> list[str]:
    lrs = s.lrs
    lines = [
        "## 4. BN vs BN + Weight Conditioning at large learning rates (paper 004 Fig. 1, §6.1)\n",
        f"CNN-5 with BN after every convolution, batch {s.batch}, {s.epochs} epochs of plain SGD, {s.seeds} "
        "seeds; BN+WC adds row equilibration to the first convolution and the last dense layer "
        '(`apply_weight_conditioning(layers="first_and_last")`, the paper\'s CNN recipe). No learning-rate '
        "choice is made: every rate of the sweep is reported (final test accuracy, %).\n",
        f"| lr (CNN-5 + BN, batch {s.batch}, {s.epochs} epochs) | "
        + " | ".join(f"{m} test acc" for m in s.methods)
        + " | "
        + " | ".join(f"{m} diverged" for m in s.methods)
        + " |",
        "|---|" + "---|" * (2 * len(s.methods)),
    ]
    finals = final_accuracies(s, results)
    for lr in lrs:
        cells = [fmt_range(finals[m, lr]) for m in s.methods]
        div = [f"{sum(r.diverged for r in runs_of(results, s, m, lr))}/{s.seeds}" for m in s.methods]
        lines.append(f"| {lr:g} | " + " | ".join(cells) + " | " + " | ".join(div) + " |")
    lines.append("\n![wc](results/weight_conditioning.png)\n")

    def largest(method: str) -> float:
        """The largest rate that trains (0 if none)."""
        return max((lr for lr in lrs if mean(finals[method, lr]) >= TRAINS), default=0.0)

    def fmt_rate(lr: float) -> str:
        return f"{lr:g}" if lr > 0 else "none of the sweep"

    bn, wc = largest("BN"), largest("BN+WC")
    above = [lr for lr in lrs if lr > bn]
    ahead = bool(above) and all(mean(finals["BN+WC", lr]) - mean(finals["BN", lr]) > 0.05 for lr in above)
    ok = True if wc > bn else (None if wc == bn and ahead else False)  # partly: ahead by > 5 points above it
    lines.append("### Claims\n")
    lines.append(
        "- *BN+WC tolerates larger learning rates than BN (paper 004 Fig. 1: GoogleNet on CIFAR-100 at lr 2, "
        f"BN+WC ~15 points ahead)* — {verdict(ok)}: the largest learning rate with mean final test accuracy "
        f"≥ {TRAINS:.0%} is {fmt_rate(bn)} for BN and {fmt_rate(wc)} for BN+WC; BN+WC − BN at each rate: "
        + ", ".join(f"{lr:g}: {(mean(finals['BN+WC', lr]) - mean(finals['BN', lr])) * 100:+.1f}" for lr in lrs)
        + " points."
        + (
            ""
            if ok is True
            else " Most likely reason: equilibrating only the first and last layer leaves the three middle "
            "layers' steps unchanged, and BN already makes the convolutions scale-invariant, so on this small "
            "network the learning rate at which training breaks down is set by the layers WC does not touch."
        )
    )
    return lines


def plot(s: Setting, results: dict[Job, Run], path: Path) -> None:
    lrs = s.lrs
    finals = final_accuracies(s, results)
    # the curves at the first rate of the sweep that BN does not train at: where it breaks
    shown = next((lr for lr in lrs if mean(finals["BN", lr]) < TRAINS), lrs[-1])
    plt = plt_module()
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(10, 3.3))
    for k, method in enumerate(s.methods):
        per_lr = [finals[method, lr] for lr in lrs]
        a0.plot(lrs, [mean(f) for f in per_lr], marker="o", color=f"C{k}", label=method)
        a0.fill_between(lrs, [min(f) for f in per_lr], [max(f) for f in per_lr], color=f"C{k}", alpha=0.15, lw=0)
        band(a1, runs_of(results, s, method, shown), "test", method, f"C{k}")
    a0.set_xscale("log")
    a0.set_xlabel("learning rate (plain SGD)", fontsize=8)
    a0.set_ylabel("final test accuracy", fontsize=8)
    a0.set_title(f"CNN-5 + BN, batch {s.batch}: final test accuracy vs learning rate", fontsize=8)
    a0.legend(fontsize=7)
    a1.set_title(f"test accuracy over training at lr {shown:g} (BN's first rate below {TRAINS:.0%})", fontsize=8)
    a1.set_xlabel("optimizer step", fontsize=8)
    a1.legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, path)
