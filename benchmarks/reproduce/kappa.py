"""Experiment 2: the Hessian-block condition number over training, against paper 000 §5.1, Fig. 8."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from benchmarks.reproduce.plotting import band, curves, plt_module, save_png
from benchmarks.reproduce.selection import Choice, fmt_range, mean, verdict

LABELS = {
    "original": "∇²L",
    "preconditioned": "Pᵀ∇²L P (BNP's P)",
    "batch_preconditioned": "P₀ᵀ∇²L P₀ (batch μ, σ)",
    "kappa_D_floored": "κ(D̃), BNP's σ̃",
    "kappa_D_raw": "κ(D), batch σ",
}


def medians(choice: Choice, key: str) -> list[float]:
    """Per seed: the median over the run's measurements of ``key``."""
    return [statistics.median(r.kappa[key]) for r in choice.runs]


def median_ratio(choice: Choice, num: str, den: str, head: float = 1.0) -> list[float]:
    """Per seed: the median over the run's measurements (the first ``head`` fraction of them) of num/den."""
    out = []
    for r in choice.runs:
        pairs = list(zip(r.kappa[num], r.kappa[den]))
        out.append(statistics.median(a / b for a, b in pairs[: max(1, round(head * len(pairs)))]))
    return out


def log_ratio(gains: list[float], kd: list[float]) -> list[float]:
    """log(gain) / log(κ(D)²) per seed: 1 means gain = κ(D)²."""
    return [math.log(g) / math.log(k * k) if k > 1 and g > 0 else math.nan for g, k in zip(gains, kd)]


def section(bnp: Choice, vanilla: Choice) -> list[str]:
    s = bnp.setting
    n = len(bnp.runs[0].kappa["original"])
    gain, gain0 = median_ratio(bnp, "original", "preconditioned"), median_ratio(bnp, "original", "batch_preconditioned")
    early = median_ratio(bnp, "original", "preconditioned", head=0.25)
    kd, kd_raw = medians(bnp, "kappa_D_floored"), medians(bnp, "kappa_D_raw")
    original, conditioned = medians(bnp, "original"), medians(bnp, "preconditioned")
    all_raw = [k for r in bnp.runs for k in r.kappa["kappa_D_raw"] if math.isfinite(k)]
    span = f"{min(all_raw, default=math.nan):.3g}–{max(all_raw, default=math.nan):.3g}"
    dead = mean([mean(r.kappa["dead"]) for r in bnp.runs])
    row = "| {} | {} |"
    lines = [
        "## 2. Hessian-block condition number over training (paper 000 §5.1, Fig. 8)\n",
        f"The 2×100 FC network at batch {s.batch} trained with BNP (lr {bnp.lr:g}, chosen on validation "
        f"from {', '.join(f'{x:g}' for x in s.lrs)}; vanilla at its chosen lr {vanilla.lr:g} for the "
        f"accuracy panel), {s.epochs} epochs, {len(bnp.runs)} seeds. At {n} evenly spaced steps, after "
        "BNP's transform and before the SGD update, the exact Hessian ∇²L of the step's loss with respect to "
        "the output layer's first neuron ŵ = [b₀, w₀] ∈ ℝ¹⁰¹ is computed in float64 "
        "(`core.metrics.neuron_hessians`) and preconditioned two ways (`core.metrics.neuron_preconditioner`, "
        "eq. 12): with the P BNP applied in that step (running μ and σ̃² = σ² + ε1·max σ² + ε2), and with "
        "the theory's P₀ (§3: the batch's own μ and σ of the layer's input, no ε floors, over the live "
        f"units). κ counts the numerically nonzero eigenvalues (`core.metrics.spectrum`): with {s.batch} rows "
        f"per batch the 101×101 block has rank ≤ {s.batch}. κ(D̃) = max σ̃ / min σ̃ (what BNP divides by); κ(D) = "
        "max σ / min σ of the batch over the live units (σ > 0), the D of the paper's analysis.\n",
        f"| quantity (2×100 FC + BNP, batch {s.batch}, lr {bnp.lr:g}; per seed: median over the run) | "
        "mean [min–max] over seeds |",
        "|---|---|",
        row.format("κ(∇²L) original", fmt_range(original, 1, ".3g")),
        row.format("κ(Pᵀ∇²L P), BNP's P", fmt_range(conditioned, 1, ".3g")),
        row.format("κ(P₀ᵀ∇²L P₀), the theory's P₀", fmt_range(medians(bnp, "batch_preconditioned"), 1, ".3g")),
        row.format("gain with BNP's P = κ original / κ preconditioned", fmt_range(gain, 1, ".3g")),
        row.format("same, first quarter of training only", fmt_range(early, 1, ".3g")),
        row.format("gain with the theory's P₀", fmt_range(gain0, 1, ".3g")),
        row.format("κ(D̃) (BNP's σ̃, with ε floors)", fmt_range(kd, 1, ".3g")),
        row.format("κ(D) (batch σ, live units)", fmt_range(kd_raw, 1, ".3g")),
        row.format("κ(D), all measurements: min–max", span),
        row.format("log gain / log κ(D̃)², BNP's P (1: gain = κ(D̃)²)", fmt_range(log_ratio(gain, kd), 1, ".2f")),
        row.format(
            "log gain / log κ(D)², the theory's P₀ (1: gain = κ(D)²)", fmt_range(log_ratio(gain0, kd_raw), 1, ".2f")
        ),
        row.format("dead units (σ = 0) in the layer's input, mean", f"{dead:.1f} of 100"),
        "\n![kappa](results/kappa.png)\n",
        "### Claims\n",
    ]
    lines.append(
        f"- *BNP reduces the Hessian-block condition number* — {verdict(mean(conditioned) < mean(original))}: κ "
        f"{mean(original):.3g} → {mean(conditioned):.3g} with BNP's P (median gain {mean(gain):.3g}×; "
        f"{mean(gain0):.3g}× with the theory's P₀)."
    )
    lines.append(gain_claim(mean(gain0), mean(kd_raw) ** 2, mean(gain), mean(kd) ** 2))
    in_range = 1e2 <= mean(kd_raw) <= 1e5
    lines.append(
        f"- *κ(D) lies in 1e2–1e5* — {verdict(in_range)} for the batch σ: κ(D) {fmt_range(kd_raw, 1, '.3g')} "
        f"(per seed medians; all measurements {span}). "
        f"The D that BNP divides by has κ(D̃) {fmt_range(kd, 1, '.3g')}: σ̃² ≥ ε1·max σ² bounds it by "
        "√((1+ε1)/ε1) ≈ 10.05 with ε1 = 1e-2, so the paper's range can only refer to the raw σ."
        + (
            ""
            if in_range
            else " Most likely reason: MNIST's 784 pixels, many of them constant or nearly so, give the hidden "
            "units a different spread of variances than CIFAR-10's 3,072 inputs."
        )
    )
    return lines


def gain_claim(gain0: float, kd2: float, gain: float, kd2_t: float) -> str:
    """Verdict on "the gain is about κ(D)²" with the theory's P₀ and D; BNP's own P is quoted beside it."""
    off = abs(math.log10(gain0 / kd2)) if gain0 > 0 and kd2 > 0 else math.inf  # orders of magnitude apart
    ok = True if off <= 0.5 else (None if off <= 1 else False)  # about: within ~3×; partly: within 10×
    if ok is True:
        reason = ""
    elif gain0 < kd2:
        reason = (
            " Most likely reason: κ(D)² is the gain when the block's ill-conditioning comes only from unequal "
            "scales of the layer's input features (Theorem 2 bounds the gain, it does not promise it); here "
            "much of the spread of ∇²L = ĤᵀSĤ comes from correlations between the hidden units and from S, "
            "which a diagonal scaling with centring cannot remove."
        )
    else:
        reason = (
            " Most likely reason: P also *centres* ŵ (the −μ block): the Hessian of a ReLU layer's non-negative "
            "inputs has one large eigenvalue along the mean direction that centring removes, on top of κ(D)²."
        )
    return (
        f"- *The gain is about κ(D)²* — {verdict(ok)}: with the theory's P₀ the gain is {gain0:.3g} against "
        f"κ(D)² = {kd2:.3g}; with BNP's P {gain:.3g} against κ(D̃)² = {kd2_t:.3g} ('about': within a factor of "
        "3; partly: within 10×)." + reason
    )


def plot(bnp: Choice, vanilla: Choice, path: Path) -> None:
    s = bnp.setting
    plt = plt_module()
    fig, (a0, a1, a2) = plt.subplots(1, 3, figsize=(12, 3.3))
    band(a0, vanilla.runs, "test", f"vanilla test acc (lr {vanilla.lr:g})", "C0")
    band(a0, bnp.runs, "test", f"BNP test acc (lr {bnp.lr:g})", "C4")
    a0b = a0.twinx()
    band(a0b, vanilla.runs, "loss", "vanilla loss", "C0", ls="--")
    band(a0b, bnp.runs, "loss", "BNP loss", "C4", ls="--")
    a0b.set_yscale("log")
    a0.set_ylim(0.5, 1.0)
    a0.legend(fontsize=7, loc="center right")
    a0.set_title(f"2×100 FC, batch {s.batch}: accuracy (solid), loss (dashed)", fontsize=8)
    n = min(len(r.kappa["original"]) for r in bnp.runs)  # measured at the evaluation points from step 0
    steps = bnp.runs[0].steps[:n]
    panels = ((a1, ("original", "preconditioned", "batch_preconditioned")), (a2, ("kappa_D_floored", "kappa_D_raw")))
    for ax, keys in panels:
        for k, key in enumerate(keys):
            curves(ax, steps, [r.kappa[key][:n] for r in bnp.runs], LABELS[key], f"C{k}")
        ax.set_yscale("log")
        ax.set_xlabel("optimizer step", fontsize=8)
        ax.legend(fontsize=7)
    a1.set_title("κ of the output neuron's Hessian block", fontsize=8)
    a2.set_title("κ(D) of the output layer's input", fontsize=8)
    fig.tight_layout()
    save_png(fig, path)
