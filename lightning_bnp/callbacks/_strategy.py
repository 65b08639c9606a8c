"""Which Lightning strategies the callbacks support: those where every rank holds the full model."""

from __future__ import annotations

from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    SingleDeviceStrategy,
    SingleDeviceXLAStrategy,
    Strategy,
    XLAStrategy,
)


def holds_full_replica(strategy: Strategy) -> bool:
    """A single device or DDP (any launcher): full Linear/Conv weights and gradients on every rank.

    DeepSpeed and XLA subclass the DDP/single-device strategies but shard or trace the parameters,
    and FSDP / model parallelism are not subclasses at all; all of them are excluded.
    """
    sharded_or_xla = (DeepSpeedStrategy, XLAStrategy, SingleDeviceXLAStrategy)
    return isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) and not isinstance(strategy, sharded_or_xla)
