"""Experiment 3: cost per training step against paper 000 Table 1 and the FLOP model of Prop. 6."""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import overhead
from benchmarks.reproduce.plotting import plt_module, save_png
from benchmarks.reproduce.selection import verdict
from example_projects.models import Norm, cnn5, fc_network

FC_IN, FC_OUT, FC_DEPTH = 784, 10, 3  # the paper's Table 1 network: MNIST 784-100×3


def fc_layers(width: int) -> list[tuple[int, int]]:
    """(n_in, n_out) of the FC network's Linear layers."""
    return [(FC_IN, width)] + [(width, width)] * (FC_DEPTH - 1) + [(width, FC_OUT)]


def flops_bnp(width: int, n: int) -> int:
    """Prop. 6 summed over the BNP layers: 4·n_in·N + 6·n_in·n_out + 2·n_out + 8·n_in."""
    return sum(4 * i * n + 6 * i * o + 2 * o + 8 * i for i, o in fc_layers(width))


def flops_bn(width: int, n: int) -> int:
    """The paper's BN count (§3.3 after Prop. 6), 32·n·N + 4·n, for each of the network's BN layers."""
    return FC_DEPTH * (32 * width * n + 4 * width)


def flops_step(width: int, n: int) -> int:
    """Vanilla step: 2 (forward) + 4 (backward) FLOPs per multiply-add of every Linear, plus SGD."""
    return sum(6 * i * o * n + 2 * (i * o + o) for i, o in fc_layers(width))


COST_FC = [(100, b) for b in (1, 16, 60, 256, 512, 1024)] + [(1000, b) for b in (16, 64, 256, 1024)]
COST_CNN = [2, 128]


@dataclass
class CostRow:
    model: str
    width: int
    batch: int
    us: dict[str, float]

    def ratio(self, a: str, b: str) -> float:
        return self.us[a] / self.us[b] if a in self.us and b in self.us else math.nan


VARIANTS = ("vanilla", "BN", "BNP")


def _fc(width: int, norm: Norm) -> torch.nn.Module:
    return fc_network(28 * 28, hidden=width, norm=norm)


def _sampler(row: overhead.Row, batch: int, variant: str, device: torch.device) -> overhead.Sampler:
    key = overhead.Key(row.key, batch, variant, "eager", "fp32", "plain")
    return overhead.plain_sampler(overhead.plain_step(row, batch, key, device), device)


def measure(quick: bool, threads: int) -> tuple[list[CostRow], str]:
    """Step times of every (network, width, batch, variant), interleaved in one loop (``overhead.time_steps``)."""
    torch.set_num_threads(threads)
    device = torch.device("cpu")
    fc = [*COST_FC[:3], COST_FC[-1]] if quick else COST_FC
    samplers: dict[tuple[str, int, str], overhead.Sampler] = {}
    shapes: dict[str, tuple[str, int]] = {}  # the rows' labels -> (model, width)
    for width, batch in fc:
        shapes[f"FC {width}"] = ("FC", width)
        row = overhead.Row("fc", f"FC {width}", (batch,), (784,), functools.partial(_fc, width), "none")
        for variant in VARIANTS:
            if not (variant == "BN" and batch == 1):  # BatchNorm cannot train on a single row
                samplers[f"FC {width}", batch, variant] = _sampler(row, batch, variant, device)
    shapes["CNN"] = ("CNN", 0)
    cnn = overhead.Row("cnn", "CNN", tuple(COST_CNN), (1, 28, 28), lambda norm: cnn5(1, 28, norm=norm), "none")
    for batch in COST_CNN:
        for variant in VARIANTS:
            samplers["CNN", batch, variant] = _sampler(cnn, batch, variant, device)
    repeats, warmup, target_s = (2, 1, 1e-3) if quick else (30, 10, 20e-3)
    med = overhead.time_steps(samplers, repeats, warmup, target_s)
    rows: dict[tuple[str, int], CostRow] = {}
    for (label, batch, variant), t in med.items():
        rows.setdefault((label, batch), CostRow(*shapes[label], batch, {})).us[variant] = t * 1e6
    setup = f"cpu, {torch.get_num_threads()} threads, {repeats} interleaved repeats"
    return list(rows.values()), setup


def plot(rows: list[CostRow], path: Path) -> None:
    plt = plt_module()
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(11, 3.5))
    for k, width in enumerate(sorted({r.width for r in rows if r.model == "FC"})):
        sel = [r for r in rows if r.model == "FC" and r.width == width and "BN" in r.us]
        b = [r.batch for r in sel]
        a0.plot(b, [measured_extra_ratio(r) for r in sel], marker="o", color=f"C{k}", label=f"measured, width {width}")
        a0.plot(
            b,
            [extra_flops_ratio(width, r.batch) for r in sel],
            ls="--",
            color=f"C{k}",
            label=f"Prop. 6 FLOPs, width {width}",
        )
        a1.plot(
            b, [r.ratio("BNP", "vanilla") for r in sel], marker="o", color=f"C{k}", label=f"BNP/vanilla, width {width}"
        )
        a1.plot(
            b,
            [r.ratio("BN", "vanilla") for r in sel],
            marker="s",
            ls=":",
            color=f"C{k}",
            label=f"BN/vanilla, width {width}",
        )
        a1.plot(
            b,
            [1 + flops_bnp(width, n) / flops_step(width, n) for n in b],
            ls="--",
            color=f"C{k}",
            label=f"FLOP model BNP, width {width}",
        )
    a0.axhline(1.0, color="grey", lw=0.6)
    a0.set_xscale("log")
    a0.set_yscale("log")
    a0.set_xlabel("batch size", fontsize=8)
    a0.set_title("extra cost of BNP / extra cost of BN (over vanilla)", fontsize=8)
    a0.legend(fontsize=6)
    a1.set_xscale("log")
    a1.set_xlabel("batch size", fontsize=8)
    a1.set_title("step time relative to vanilla (FC, 3 hidden layers)", fontsize=8)
    a1.legend(fontsize=6)
    fig.tight_layout()
    save_png(fig, path)


def extra_flops_ratio(width: int, n: int) -> float:
    return flops_bnp(width, n) / flops_bn(width, n)


def measured_extra_ratio(r: CostRow) -> float:
    bnp, bn = r.us["BNP"] - r.us["vanilla"], r.us.get("BN", math.nan) - r.us["vanilla"]
    return bnp / bn if bn > 0 else math.nan


def fmt_ratio(x: float) -> str:
    """Two decimals, or n/a where a variant was not timed (BN at batch 1)."""
    return "n/a" if math.isnan(x) else f"{x:.2f}"


def section(rows: list[CostRow], setup: str) -> list[str]:
    lines = [
        "## 3. Cost per training step (paper 000 Table 1, Prop. 6)\n",
        f"Median time of one training step (forward, backward, [BNP transform], SGD step; plain torch) measured "
        f"side by side with `benchmarks.overhead.time_steps` ({setup}): every repeat visits every row in a "
        "rotated order, so load from other processes lands on all rows alike. FC = 3 hidden layers of the "
        "stated width on random 784-input batches (the paper's Table 1 network; cost does not depend on the "
        "data), BN after each hidden activation; BNP manages all 4 Linear layers; the CNN is the paper's on "
        "random 1×28×28 inputs. "
        "FLOP columns use Prop. 6 summed over the BNP layers, the paper's BN count 32·n·N + 4·n per "
        "BN layer, and 6 FLOPs per multiply-add for the vanilla step.\n",
        "| model | width | batch | vanilla µs | BN µs | BNP µs | BNP/vanilla | BNP/BN | "
        "(BNP−van)/(BN−van) measured | same, Prop. 6 FLOPs | BNP extra FLOPs / vanilla FLOPs |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        is_fc = r.model == "FC"
        us = " | ".join(f"{r.us[v]:.0f}" if v in r.us else "n/a" for v in VARIANTS)
        lines.append(
            f"| {r.model} | {r.width if is_fc else '32-64-32'} | {r.batch} | {us} | {r.ratio('BNP', 'vanilla'):.2f} | "
            f"{fmt_ratio(r.ratio('BNP', 'BN'))} | {fmt_ratio(measured_extra_ratio(r))} | "
            f"{f'{extra_flops_ratio(r.width, r.batch):.2f}' if is_fc else '–'} | "
            f"{f'{flops_bnp(r.width, r.batch) / flops_step(r.width, r.batch):.3f}' if is_fc else '–'} |"
        )
    lines.append("\n![cost](results/cost.png)\n")
    lines.append("### Claims\n")
    fc = [r for r in rows if r.model == "FC" and "BN" in r.us]
    worst = max((r.ratio("BNP", "BN") for r in fc), default=math.nan)
    best = min((r.ratio("BNP", "BN") for r in fc), default=math.nan)
    table1 = [r for r in fc if r.width == 100 and r.batch in (16, 256, 512)]
    lines.append(
        f"- *BNP costs about what BN costs (Table 1: BNP/BN 1.04 at batch 16, 0.99 at 256 and 512, V100)* — "
        f"{verdict(worst <= 1.1 or None)}: BNP/BN step time "
        + ", ".join(f"{r.ratio('BNP', 'BN'):.2f} at batch {r.batch}" for r in table1)
        + f" (FC width 100); over all FC rows {best:.2f}–{worst:.2f}."
        + (
            ""
            if worst <= 1.1
            else " Most likely reason: on a CPU these layers are tiny, so a step costs a fixed number of "
            "kernel launches and Python calls, not FLOPs; BNP adds a hook per layer and a dozen small "
            "foreach kernels per step, BN a few fused kernels per layer. The gap closes as batch and width grow."
        )
    )
    crossover = sorted((r for r in fc if r.width == 1000), key=lambda r: r.batch)
    measured = [measured_extra_ratio(r) for r in crossover]
    exact = [extra_flops_ratio(r.width, r.batch) < 1 for r in crossover] == [m < 1 for m in measured]
    resolved = bool(crossover) and all(m > 0 for m in measured)  # both extra costs above the timing noise
    trend = resolved and all(a > b for a, b in itertools.pairwise(measured)) and measured[-1] < 1
    ok = (True if exact else (None if trend else False)) if resolved else None
    if ok is True:
        note = ""
    elif not resolved:
        note = " A negative or missing ratio means an extra cost below the timing noise of these large steps."
    else:
        falls = len(measured) > 1 and all(a > b for a, b in itertools.pairwise(measured))
        how = "falls" if falls else "does not fall steadily"
        note = (
            (
                f" BNP's extra cost {how} relative to BN's as N grows ({measured[0]:.2f} → {measured[-1]:.2f}) "
                + ("and ends below it." if measured[-1] < 1 else "and ends above it.")
                if len(measured) > 1
                else ""
            )
            + " The crossover does not match. Most likely reason: a FLOP count weighs every operation alike, "
            "but the vanilla step's matrix products run near the CPU's peak while the statistics are "
            "memory-bound elementwise passes: BNP reads each layer's N×n input twice (mean, then centred "
            "squares, for accuracy) through a centred temporary, where torch's BN forward and backward are "
            "fused kernels; at small N the number of kernel launches dominates, and BNP launches more."
        )
    lines.append(
        "- *Prop. 6: BNP's extra work is cheaper than BN's when 28·N > 6·n (ignoring first-order terms)* — "
        f"{verdict(ok)} at width 1000 (predicted crossover N ≈ 214): (BNP − vanilla)/(BN − vanilla) "
        + ", ".join(
            f"at batch {r.batch} measured {m:.2f}, FLOP model {extra_flops_ratio(r.width, r.batch):.2f}"
            for r, m in zip(crossover, measured)
        )
        + f".{note}"
    )
    return lines
