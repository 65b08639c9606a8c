"""The main job: the BNP paper's fully connected network (3×100, ReLU, §5) trained with BNP on the
bundled scikit-learn digits. Shows the progress bar, writes TensorBoard logs, prints the test
accuracy and where the logs are.

Run: ``python -m example_projects.fc_digits [--epochs 20] [--batch-size 60] [--lr 0.1] [--no-bnp]``
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger

from example_projects.classifier import Classifier
from example_projects.digits import DigitsDataModule
from example_projects.models import fc_network
from lightning_bnp import BatchNormPreconditioning


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description="Train the paper's FC network with BNP on bundled digits.")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=60)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", type=Path, default=Path("runs"))
    parser.add_argument("--no-bnp", action="store_true", help="train the vanilla network for comparison")
    args = parser.parse_args(argv)

    pl.seed_everything(args.seed, workers=True)
    name = "fc_digits_vanilla" if args.no_bnp else "fc_digits_bnp"
    logger = TensorBoardLogger(args.log_dir, name=name)
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        logger=logger,
        callbacks=[] if args.no_bnp else [BatchNormPreconditioning()],
        log_every_n_steps=5,
        accelerator="cpu",
        deterministic=True,
    )
    model = Classifier(fc_network(), lr=args.lr)
    data = DigitsDataModule(batch_size=args.batch_size)
    trainer.fit(model, datamodule=data)
    accuracy = float(trainer.test(model, datamodule=data, verbose=False)[0]["test/acc"])
    print(f"\nfinal test accuracy: {accuracy:.4f}")
    print(f"TensorBoard logs: {Path(logger.log_dir).resolve()}  (view with: tensorboard --logdir {args.log_dir})")
    return accuracy


if __name__ == "__main__":
    main()
