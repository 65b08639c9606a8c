"""Which Lightning strategies the callbacks support: those where every rank holds whole rows of every weight.

BNP's transform is row-local (paper 000, eq. 15: output row i needs G_w[i, :], G_b[i] and its input's
statistics), so a single device, DDP and FSDP2 (rows sharded along dim 0) work; strategies that split rows or
columns, or flatten the layers' parameters, do not (:func:`check_strategy`).
"""

from __future__ import annotations

from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
    SingleDeviceXLAStrategy,
    Strategy,
    XLAStrategy,
)

# Private, kept on purpose: Lightning has no public way to ask whether a strategy's launcher runs `fit` in
# processes it spawns or forks (`ddp_spawn`, `ddp_fork`, `ddp_notebook`) rather than in this one; the strategy's
# `_start_method` is just as private, and `launcher.is_interactive_compatible` is true only for fork.
# tests/callbacks/test_strategy.py pins it for each of those strategy names, so a rename fails a test.
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.utilities import rank_zero_warn


def check_strategy(strategy: Strategy) -> None:
    """BatchNormPreconditioning's check at setup: refuse a strategy it does not support, and warn that under
    a launcher that spawns workers its state stays in them.

    Raises:
        RuntimeError: DeepSpeed (named: its gradients are not in ``param.grad``), or a strategy that is neither a full
            replica per rank nor FSDP2 without tensor parallelism.
    """
    if is_deepspeed(strategy):
        raise RuntimeError(
            f"BatchNormPreconditioning does not support DeepSpeed ({type(strategy).__name__}): its engine reduces "
            "the gradients into buffers it owns (ZeRO stages 1-3: `param.grad` is None after its backward) and "
            "flattens or partitions the layers' parameters, so BNP would transform nothing. Supported: a single "
            "device, DDP ('ddp', 'ddp_spawn', 'ddp_find_unused_parameters_true'), and FSDP2: "
            "ModelParallelStrategy(tensor_parallel_size=1) with `fully_shard` applied in `configure_model`."
        )
    if not holds_full_replica(strategy) and not shards_rows(strategy):
        tp = tensor_parallel_size(strategy)
        cause = (
            f"tensor parallelism (tensor_parallel_size={tp}) splits a layer's rows or columns over ranks"
            if tp > 1
            else "it needs every rank to hold whole rows of the Linear/Conv weights and their gradients"
        )
        raise RuntimeError(
            f"BatchNormPreconditioning does not support the {type(strategy).__name__} strategy: {cause}. "
            "Supported: a single device, DDP ('ddp', 'ddp_spawn', 'ddp_find_unused_parameters_true'), and "
            "FSDP2: ModelParallelStrategy(tensor_parallel_size=1) with `fully_shard` applied in "
            "`configure_model` (FSDPStrategy, FSDP1, is not: its flat parameters mix the layers' rows)."
        )
    if spawns_workers(strategy):
        rank_zero_warn(
            f"BatchNormPreconditioning under {type(strategy.launcher).__name__}: the running statistics "
            "live in the worker processes and only the weights return to the main one. Checkpoints saved "
            "during fit (ModelCheckpoint) hold the BNP state; `trainer.save_checkpoint` called in the main "
            "process after fit does not. Use strategy='ddp' to keep it in the main process."
        )


def is_deepspeed(strategy: Strategy) -> bool:
    """Lightning's ``DeepSpeedStrategy``, or any strategy class of that name or from a ``deepspeed`` module (a
    subclass of the DDP or single-device strategies would otherwise pass for a full replica)."""
    return isinstance(strategy, DeepSpeedStrategy) or any(
        "deepspeed" in f"{cls.__module__}.{cls.__name__}".lower() for cls in type(strategy).__mro__
    )


def holds_full_replica(strategy: Strategy) -> bool:
    """A single device or DDP (any launcher): full Linear/Conv weights and gradients on every rank.

    DeepSpeed and XLA subclass the DDP/single-device strategies but shard or trace the parameters,
    and FSDP / model parallelism are not subclasses at all; all of them are excluded.
    """
    sharded_or_xla = (DeepSpeedStrategy, XLAStrategy, SingleDeviceXLAStrategy)
    return isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) and not isinstance(strategy, sharded_or_xla)


def spawns_workers(strategy: Strategy) -> bool:
    """'ddp_spawn', 'ddp_fork', 'ddp_notebook': training runs in processes the main one does not share
    callback state with (only the weights come back)."""
    return isinstance(strategy.launcher, _MultiProcessingLauncher)


def shards_rows(strategy: Strategy) -> bool:
    """``ModelParallelStrategy`` without tensor parallelism: FSDP2 (``fully_shard`` in ``configure_model``), each
    rank holding some rows of every weight and bias (``DTensor``, ``Shard(0)``) on a 1-D data-parallel mesh."""
    return isinstance(strategy, ModelParallelStrategy) and tensor_parallel_size(strategy) == 1


def tensor_parallel_size(strategy: Strategy) -> int:
    """The tensor-parallel size of a ``ModelParallelStrategy`` (its device mesh exists from ``setup_environment``,
    before any callback's ``setup``); 1 for any other strategy."""
    if not isinstance(strategy, ModelParallelStrategy):
        return 1
    return int(strategy.device_mesh["tensor_parallel"].size())
