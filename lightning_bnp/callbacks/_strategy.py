"""Which Lightning strategies the callbacks support: those where every rank holds the full model."""

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
