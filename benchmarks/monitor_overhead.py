"""What the monitors cost: the digits FC example trained with BNP, with and without the monitors, side by side.

Runs, in one process and interleaved (the arm order rotates every repeat, so load from other processes
hits every arm alike), repeated Lightning fits of ``example_projects.fc_digits``: the paper's FC network
(3×100, ReLU; paper 000, §5) on the bundled digits at batch 60 with SGD (lr 0.1), that example's Trainer
settings (validation every epoch, ``deterministic=True``, a TensorBoardLogger; the progress bar off) except
``log_every_n_steps``: Lightning's default 50 here (``--log-every-n-steps``; the example sets 5 for its short
demo), which ``ConditionNumberMonitor``'s default cadence follows. Arms:

* ``BNP`` — ``BatchNormPreconditioning()`` only, as in the example;
* ``BNP + monitors (defaults)`` — plus ``ConditionNumberMonitor()`` and ``TimingMonitor()`` at their
  default settings;
* ``BNP + ConditionNumberMonitor()``, ``BNP + TimingMonitor()`` — each monitor alone (attribution);
* ``BNP + monitors (all options)`` — plus Lanczos, landscape probes and the Hessian of every layer.

Two times per fit, each as wall time and as process CPU time (the latter is far less sensitive to other
processes competing for the cores): the whole ``trainer.fit`` (what the example's user waits for), and
the training steps alone (``on_train_start`` → ``on_train_end`` minus the validation loops), the stricter
measure. The table gives medians, the ratios to ``BNP`` (target for the defaults: ≤ 1.05) and the extra
CPU milliseconds per ConditionNumberMonitor record. Writes ``benchmarks/out/monitor_overhead.md``.

Run: ``python -m benchmarks.monitor_overhead [--repeats 15] [--epochs 20] [--threads N] [--log-every-n-steps 50]
[--quick]``
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from example_projects.classifier import Classifier
from example_projects.digits import DigitsDataModule
from example_projects.models import fc_network
from lightning_bnp.callbacks.bnp import BatchNormPreconditioning
from lightning_bnp.callbacks.condition_monitor import ConditionNumberMonitor
from lightning_bnp.callbacks.timing_monitor import TimingMonitor

OUT = Path(__file__).parent / "out"
BATCH = 60
DEFAULTS = "BNP + monitors (defaults)"
ARMS: dict[str, Callable[[], list[pl.Callback]]] = {
    "BNP": lambda: [BatchNormPreconditioning()],
    DEFAULTS: lambda: [BatchNormPreconditioning(), ConditionNumberMonitor(), TimingMonitor()],
    "BNP + ConditionNumberMonitor()": lambda: [BatchNormPreconditioning(), ConditionNumberMonitor()],
    "BNP + TimingMonitor()": lambda: [BatchNormPreconditioning(), TimingMonitor()],
    "BNP + monitors (all options)": lambda: [
        BatchNormPreconditioning(),
        ConditionNumberMonitor(lanczos=True, landscape=True, hessian_layers=["*"]),
        TimingMonitor(),
    ],
}


def _now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()  # a CPU run: host clocks are the right clocks here


class TrainClock(pl.Callback):
    """Wall and CPU time of the training steps: the training loop minus its validation loops."""

    def __init__(self) -> None:
        self.start, self.val_start, self.validation = _now(), _now(), [0.0, 0.0]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start, self.validation = _now(), [0.0, 0.0]

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.val_start = _now()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for i, t in enumerate(_now()):
            self.validation[i] += t - self.val_start[i]

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seconds = [t - s - v for t, s, v in zip(_now(), self.start, self.validation)]


def fit_seconds(arm: str, data: DigitsDataModule, epochs: int, root: Path, log_every: int) -> list[float]:
    """[fit wall, fit CPU, steps wall, steps CPU] of one fit of the example in the given arm."""
    torch.manual_seed(0)
    clock = TrainClock()
    trainer = pl.Trainer(  # example_projects.fc_digits's settings but `log_every_n_steps`, progress bar off
        max_epochs=epochs,
        logger=TensorBoardLogger(root, name=arm.replace(" ", "_")),
        callbacks=[*ARMS[arm](), clock],
        log_every_n_steps=log_every,
        accelerator="cpu",
        deterministic=True,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    start = _now()
    trainer.fit(Classifier(fc_network(), lr=0.1), datamodule=data)
    return [t - s for t, s in zip(_now(), start)] + clock.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="fits per arm (the median is reported)")
    parser.add_argument("--epochs", type=int, default=20, help="epochs per fit (20 steps each at batch 60)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave as is)")
    parser.add_argument(
        "--log-every-n-steps", type=int, default=50, help="Trainer(log_every_n_steps): the monitor's default cadence"
    )
    parser.add_argument("--quick", action="store_true", help="2 repeats of 3 epochs: a smoke test")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    repeats, epochs = (2, 3) if args.quick else (args.repeats, args.epochs)
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    data = DigitsDataModule(batch_size=BATCH)
    data.setup("fit")
    steps = epochs * len(data.train_dataloader())
    every = args.log_every_n_steps  # ConditionNumberMonitor(every_n_steps=None) follows the Trainer's cadence
    records = len(range(0, steps, every))
    samples: dict[str, list[list[float]]] = {arm: [] for arm in ARMS}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        fit_seconds("BNP", data, 1, Path(tmp), every)  # warm-up (imports, allocator)
        fit_seconds(DEFAULTS, data, 1, Path(tmp), every)  # the first float64 double backward initialises vmap
        arms = list(ARMS)
        for r in range(repeats):
            for arm in arms[r % len(arms) :] + arms[: r % len(arms)]:
                samples[arm].append(fit_seconds(arm, data, epochs, Path(tmp), every))
    elapsed = time.perf_counter() - start
    med = {arm: [statistics.median(column) for column in zip(*s)] for arm, s in samples.items()}
    setup = f"CPU, {torch.get_num_threads()} threads, torch {torch.__version__}, {repeats} repeats"
    lines = [
        f"# Monitor overhead on the digits FC example ({setup})\n",
        f"`example_projects.fc_digits` settings, {epochs} epochs = {steps} steps at batch {BATCH} plus validation "
        f"each epoch; ConditionNumberMonitor records {records} times per fit (default `every_n_steps`: the Trainer's "
        f"`log_every_n_steps` = {every}), "
        f"TimingMonitor every {TimingMonitor().every_n_steps or every} steps. Medians over interleaved fits; "
        "CPU = process "
        "time (robust to other load on the machine). *fit* = the whole `trainer.fit`; *steps* = the training "
        "loop without its validation.\n",
        "| arm | fit wall s | fit CPU s | steps wall ms/step | steps CPU ms/step | "
        "ratio: fit wall | fit CPU | steps wall | steps CPU | extra CPU ms per record |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = med["BNP"]
    for arm, (fit_w, fit_c, step_w, step_c) in med.items():
        ratios = " | ".join(f"{v / b:.3f}" for v, b in zip(med[arm], base))
        extra = "-" if arm in ("BNP", "BNP + TimingMonitor()") else f"{(step_c - base[3]) * 1e3 / records:.1f}"
        lines.append(
            f"| {arm} | {fit_w:.3f} | {fit_c:.3f} | {step_w * 1e3 / steps:.2f} | {step_c * 1e3 / steps:.2f} | "
            f"{ratios} | {extra} |"
        )
    lines.append("")
    for i, name in enumerate(("fit wall", "fit CPU", "steps wall", "steps CPU")):
        ratio = med[DEFAULTS][i] / base[i]
        verdict = "met" if ratio <= 1.05 else "NOT met"
        lines.append(f"- {name}: monitors at defaults / BNP = {ratio:.3f} (target <= 1.05): {verdict}")
    lines.append(f"\nMeasuring took {elapsed:.1f} s.")
    print("\n".join(lines))
    OUT.mkdir(exist_ok=True)
    name = "monitor_overhead_quick.md" if args.quick else "monitor_overhead.md"
    (OUT / name).write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT / name}")


if __name__ == "__main__":
    main()
