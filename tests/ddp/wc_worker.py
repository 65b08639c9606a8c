"""Fit the test CNN with WeightConditioning (and optionally BNP) and save every rank's final state.

Run as a script (Lightning's ``ddp`` launcher re-executes it for the other ranks)::

    python -m tests.ddp.wc_worker --devices 2 --batch-size 8 --bnp --out DIR

Each rank writes ``DIR/rank{r}.pt`` with the model's parameters (``….parametrizations.weight.original``
for the conditioned layers) and the conditioned weights at the end.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_bnp.callbacks.bnp import BatchNormPreconditioning
from lightning_bnp.callbacks.weight_conditioning import WeightConditioning
from tests.ddp.fit_worker import OrderedData, release_process_group
from tests.helpers import BoringClassifier, make_cnn, make_data


class SaveFinalState(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = {
            "params": {k: v.detach().cpu().clone() for k, v in pl_module.named_parameters()},
            "conditioned": {
                k: m.weight.detach().cpu().clone()
                for k, m in pl_module.named_modules()
                if hasattr(m, "parametrizations")
            },
            "global_step": trainer.global_step,
            "world_size": trainer.world_size,
        }
        torch.save(state, self.out / f"rank{trainer.global_rank}.pt")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--n", type=int, default=160)
    parser.add_argument("--mode", default="row_column")
    parser.add_argument("--bnp", action="store_true", help="add BatchNormPreconditioning on top")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    callbacks: list[pl.Callback] = [WeightConditioning(mode=args.mode), SaveFinalState(args.out)]
    if args.bnp:
        callbacks.append(BatchNormPreconditioning())
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=args.strategy,
        max_epochs=args.epochs,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    model = BoringClassifier(make_cnn(), momentum=0.9)
    data = make_data(n=args.n, shape=(2, 6, 6))
    trainer.fit(model, datamodule=OrderedData(data, args.batch_size))
    release_process_group()


if __name__ == "__main__":
    main()
