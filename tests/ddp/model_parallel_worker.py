"""Fit with BNP under Lightning's ``ModelParallelStrategy`` (FSDP2, tensor-parallel size 1) on 2 CPU processes, the
network built and sharded with ``fully_shard`` in ``configure_model`` (issue 26), and save every rank's final state.

Run as a script (Lightning's launcher re-executes it for the other rank)::

    python -m tests.ddp.model_parallel_worker --epochs 2 --out DIR [--ckpt-dir D] [--ckpt-in D/last.ckpt]

Each rank writes ``DIR/rank{r}.pt``: the full parameters (gathered from the shards), the BNP statistics and the
global step. ``--single`` runs the same fit in one process on the combined batch, unsharded (the reference;
``tests.ddp.launch.run_worker`` runs it in the test's own process).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from typing_extensions import override

from lightning_bnp import BatchNormPreconditioning, TimingMonitor, ZSpaceRegularization
from tests.ddp.fit_worker import OrderedData, release_process_group
from tests.helpers import BoringClassifier, make_data

BATCH, ACCUMULATE, N = 4, 2, 64  # per rank and micro-batch; 4 steps per epoch on 2 ranks


def make_net() -> nn.Sequential:
    """Conv and Linear layers; 3 output channels shard 2 + 1, one output channel 1 + 0, 3 classes 2 + 1."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Conv2d(3, 1, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16, 3)
    )


class ShardedClassifier(BoringClassifier):
    def __init__(self, shard: bool) -> None:
        super().__init__(nn.Identity(), momentum=0.9)
        self.network: nn.Module | None = None  # type: ignore[assignment]
        self.shard = shard

    @override
    def configure_model(self) -> None:
        if self.network is not None:
            return
        net = make_net()
        if self.shard:
            mesh = self.device_mesh["data_parallel"]
            for module in net:
                if any(True for _ in module.parameters()):
                    fully_shard(module, mesh=mesh)
            fully_shard(net, mesh=mesh)
        self.network = net


class SaveFinalState(pl.Callback):
    def __init__(self, out: Path, bnp: BatchNormPreconditioning) -> None:
        self.out, self.bnp = out, bnp

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.bnp.preconditioner is not None
        params = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone()
            for k, v in pl_module.named_parameters()
        }
        state: dict[str, Any] = {
            "params": params,
            "bnp": self.bnp.preconditioner.state_dict(),
            "global_step": trainer.global_step,
            "world_size": trainer.world_size,
        }
        torch.save(state, self.out / f"rank{trainer.global_rank}.pt")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ckpt-in", default=None)
    parser.add_argument("--ckpt-dir", type=Path, default=None)
    parser.add_argument("--full-checkpoint", action="store_true", help="save_distributed_checkpoint=False")
    parser.add_argument("--single", action="store_true", help="one process on the combined batch, unsharded")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    bnp = BatchNormPreconditioning(verbose=False)
    callbacks: list[pl.Callback] = [bnp, ZSpaceRegularization(weight_decay=0.05), TimingMonitor()]
    callbacks.append(SaveFinalState(args.out, bnp))
    if args.ckpt_dir is not None:
        # every epoch's checkpoint is kept: the first one is a mid-run checkpoint to resume from
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, filename="{epoch}", save_top_k=-1))
    strategy: Any = (
        "auto"
        if args.single
        else ModelParallelStrategy(
            data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=not args.full_checkpoint
        )
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1 if args.single else 2,
        strategy=strategy,
        max_epochs=args.epochs,
        accumulate_grad_batches=ACCUMULATE,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=args.ckpt_dir is not None,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    model = ShardedClassifier(shard=not args.single)
    data = make_data(n=N, shape=(2, 6, 6))
    trainer.fit(model, datamodule=OrderedData(data, BATCH * (1 if not args.single else 2)), ckpt_path=args.ckpt_in)
    release_process_group()


if __name__ == "__main__":
    main()
