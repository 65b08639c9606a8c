"""Weight decay in z vs in p vs none with BNP, and the cost of gradient regularization (paper 001).

The paper's FC network (3×100, ReLU) on the bundled digits, batch 60, SGD lr 0.1, BNP with default
settings, trained side by side in one process for each variant and seed:

* ``none`` — BNP alone; ``z-decay`` — ZSpaceRegularization(weight_decay=λ, decay_space="z");
  ``p-decay`` — the same λ as L2 in p (decay_space="p");
* ``z-gradient (fd)`` / ``z-gradient (exact)`` — gradient regularization in z with the finite-difference
  or double-backprop Hessian-vector product, to measure what it costs per step;
* ``p-gradient (exact)`` — gradient regularization in p (paper 001 eq. 11, ``gradient_penalty_space="p"``),
  for comparison with the z version.

Writes ``benchmarks/out/regularization.md`` (final test accuracy mean [min, max] over seeds, median
step time and its ratio to ``none``) and ``regularization.png`` (training-loss curves, mean and
min–max band). Run: ``python -m benchmarks.regularization [--epochs 20] [--seeds 3] [--lam 1e-3]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from typing_extensions import override

from example_projects.classifier import Classifier
from example_projects.digits import DigitsDataModule
from example_projects.models import fc_network
from lightning_bnp import BatchNormPreconditioning, ZSpaceRegularization

OUT = Path(__file__).parent / "out"


class Recorder(pl.Callback):
    """Training loss and wall time of every step."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.step_times: list[float] = []
        self._start = 0.0

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        self.step_times.append(time.perf_counter() - self._start)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss) if isinstance(loss, Tensor) else float("nan"))


def run(variant: str, lam: float, seed: int, epochs: int) -> tuple[float, Recorder]:
    pl.seed_everything(seed, verbose=False)
    callbacks: list[pl.Callback] = [BatchNormPreconditioning()]
    if variant in ("z-decay", "p-decay"):
        callbacks.append(ZSpaceRegularization(weight_decay=lam, decay_space=variant[0]))  # type: ignore[arg-type]
    elif "-gradient" in variant:
        hvp = "finite_difference" if "fd" in variant else "double_backprop"
        space = variant[0]
        callbacks.append(ZSpaceRegularization(gradient_penalty=lam, gradient_penalty_space=space, hvp=hvp))  # type: ignore[arg-type]
    recorder = Recorder()
    trainer = pl.Trainer(
        max_epochs=epochs,
        callbacks=[*callbacks, recorder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    model = Classifier(fc_network(), lr=0.1)
    data = DigitsDataModule(batch_size=60)
    trainer.fit(model, datamodule=data)
    accuracy = float(trainer.test(model, datamodule=data, verbose=False)[0]["test/acc"])
    return accuracy, recorder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--lam", type=float, default=1e-3)
    args = parser.parse_args()
    OUT.mkdir(exist_ok=True)
    name = "regularization" if args.lam == 1e-3 else f"regularization_lam{args.lam:g}"
    variants = ["none", "z-decay", "p-decay", "z-gradient (fd)", "z-gradient (exact)", "p-gradient (exact)"]
    results: dict[str, list[tuple[float, Recorder]]] = {v: [] for v in variants}
    for seed in range(args.seeds):
        for variant in variants:  # interleaved: load changes hit every variant alike
            results[variant].append(run(variant, args.lam, seed, args.epochs))

    base_time = statistics.median(t for _, rec in results["none"] for t in rec.step_times)
    lines = [
        f"# BNP + regularization: FC 3×100 on digits, batch 60, SGD lr 0.1, λ = {args.lam:g}, "
        f"{args.epochs} epochs, {args.seeds} seeds\n",
        "| variant | final test accuracy mean [min, max] | final training loss (mean) | median step ms "
        "| step time / none |",
        "|---|---|---|---|---|",
    ]
    for variant in variants:
        accs = [a for a, _ in results[variant]]
        final_loss = statistics.mean(rec.losses[-1] for _, rec in results[variant])
        step = statistics.median(t for _, rec in results[variant] for t in rec.step_times)
        lines.append(
            f"| {variant} | {statistics.mean(accs):.4f} [{min(accs):.4f}, {max(accs):.4f}] | {final_loss:.4f} "
            f"| {1e3 * step:.2f} | {step / base_time:.2f} |"
        )
    (OUT / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for variant in [*variants[:3], "z-gradient (fd)"]:
        curves = torch.tensor([rec.losses for _, rec in results[variant]])
        steps = range(curves.shape[1])
        ax.plot(steps, curves.mean(0).numpy(), label=variant)
        ax.fill_between(steps, curves.amin(0).numpy(), curves.amax(0).numpy(), alpha=0.2)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(OUT / f"{name}.png", dpi=100)
    print(f"wrote {OUT / name}.md and .png")


if __name__ == "__main__":
    main()
