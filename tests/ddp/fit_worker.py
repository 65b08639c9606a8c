"""Fit the test classifier with BNP under a given strategy and save every rank's final state.

Run as a script (Lightning's ``ddp`` launcher re-executes it for the other ranks)::

    python -m tests.ddp.fit_worker --strategy ddp --devices 2 --net mlp --batch-size 8 --epochs 2 --out DIR

Each rank writes ``DIR/rank{r}.pt`` with the model's parameters and the BNP statistics at the end.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from typing_extensions import override

from lightning_bnp import BatchNormPreconditioning
from lightning_bnp.callbacks.regularization import ZSpaceRegularization
from tests.helpers import BoringClassifier, make_cnn, make_data, make_mlp
from tests.transposed import make_transposed_mlp

# "tmlp": the MLP with its linear layers stored (in, out), a user-registered layer kind (issue 29)
NETS = {"mlp": (make_mlp, (6,)), "cnn": (make_cnn, (2, 6, 6)), "tmlp": (make_transposed_mlp, (6,))}


def _attention(index: int) -> nn.Module:
    from tests.callbacks.test_layer_kinds_callback import attention_pair

    return attention_pair()[index]


# "mha": self-attention with nn.MultiheadAttention, "mha_twin": the same with four nn.Linear (issue 24)
NETS |= {"mha": (lambda: _attention(0), (32,)), "mha_twin": (lambda: _attention(1), (32,))}


class Bucketed(nn.Module):
    """Tokens from the (float) data: |x| in buckets of 1/4, up to 12; token 0 is padding (issue 24 item 4)."""

    def __init__(self) -> None:
        super().__init__()
        from tests.callbacks.test_layer_kinds_callback import BagOfTokens

        self.inner = BagOfTokens(padding_idx=0)

    def forward(self, x: Tensor) -> Tensor:
        return self.inner((x.abs() * 4).long().clamp(max=12))


NETS |= {"tokens": (Bucketed, (5,))}


class Sequences(nn.Module):
    """The 6 features as 3 steps of 2 through a bidirectional LSTM, read out at the last step (issue 44)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lstm = nn.LSTM(2, 4, batch_first=True, bidirectional=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.lstm(x.view(-1, 3, 2))[0][:, -1])


NETS |= {"lstm": (Sequences, (6,))}


def make_tconv(seed: int = 0) -> nn.Sequential:
    """A conv encoder and a transposed-conv decoder (issue 44), then a linear head."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, stride=2, padding=1), nn.ReLU(), nn.ConvTranspose2d(3, 2, 4, stride=2, padding=1),
        nn.ReLU(), nn.Flatten(), nn.Linear(2 * 6 * 6, 3),
    )  # fmt: skip


NETS |= {"tconv": (make_tconv, (2, 6, 6))}


class OrderedData(pl.LightningDataModule):
    """Rank r of W takes samples r, r+W, r+2W, …: per step the ranks' batches of b are exactly the
    single-process batch of W·b (Lightning's own distributed sampler would shuffle)."""

    def __init__(self, data: Dataset, batch_size: int) -> None:
        super().__init__()
        self.data, self.batch_size = data, batch_size

    @override
    def train_dataloader(self) -> DataLoader:
        sampler = DistributedSampler(
            self.data, num_replicas=self.trainer.world_size, rank=self.trainer.global_rank, shuffle=False
        )
        return DataLoader(self.data, batch_size=self.batch_size, sampler=sampler)


class SaveFinalState(pl.Callback):
    def __init__(self, out: Path, bnp: BatchNormPreconditioning) -> None:
        self.out, self.bnp = out, bnp

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.bnp.preconditioner is not None
        state: dict[str, Any] = {
            "params": {k: v.detach().cpu().clone() for k, v in pl_module.named_parameters()},
            "bnp": self.bnp.preconditioner.state_dict(),
            "global_step": trainer.global_step,
            "world_size": trainer.world_size,
        }
        torch.save(state, self.out / f"rank{trainer.global_rank}.pt")


def release_process_group() -> None:
    """Destroy the gloo process group before the interpreter exits: Lightning leaves it up, and a
    live group's threads can abort the process at exit ("terminate called without an active exception")."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


class ReleaseProcessGroup(pl.Callback):
    """``release_process_group`` in every rank at the end of ``fit``. Under ``ddp_spawn`` the ranks are spawned
    processes that exit once ``fit`` returns, so the call after ``fit`` in ``main`` never runs in them; without
    this, a spawned rank now and then aborted at exit (CI, stop 30: SIGABRT in ``test_other_ddp_strategies``)."""

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # the Trainer's last hook: after the strategy's teardown, and no collective follows it in a spawned rank
        release_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--net", choices=sorted(NETS), default="mlp")
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    # epochs, not steps: Lightning does not resume a run stopped by `max_steps` exactly
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--n", type=int, default=320)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ckpt-in", default=None)
    parser.add_argument("--ckpt-dir", type=Path, default=None)
    parser.add_argument("--no-sync", action="store_true")
    parser.add_argument("--statistics", choices=["running", "batch"], default="running")
    parser.add_argument("--gradient-penalty", type=float, default=0.0)
    parser.add_argument("--conv-statistics", choices=["channel", "column"], default="channel")
    parser.add_argument("--embeddings", action="store_true")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    make_net, shape = NETS[args.net]
    bnp = BatchNormPreconditioning(
        sync_statistics=not args.no_sync,
        statistics=args.statistics,
        conv_statistics=args.conv_statistics,
        embeddings=args.embeddings,
    )
    callbacks: list[pl.Callback] = [bnp, SaveFinalState(args.out, bnp), ReleaseProcessGroup()]
    if args.gradient_penalty > 0:
        callbacks.append(ZSpaceRegularization(gradient_penalty=args.gradient_penalty))
    if args.ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, save_last=True, save_top_k=0))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=args.strategy,
        max_epochs=args.epochs,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=args.ckpt_dir is not None,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    model = BoringClassifier(make_net(), momentum=0.9)
    data = make_data(n=args.n, shape=shape)
    trainer.fit(model, datamodule=OrderedData(data, args.batch_size), ckpt_path=args.ckpt_in)
    release_process_group()


if __name__ == "__main__":
    main()
