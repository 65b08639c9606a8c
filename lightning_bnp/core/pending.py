"""Running-statistics updates that a step computed and an optimizer's step stores: so that a step the optimizer
does not take (``GradScaler`` skipping non-finite gradients) leaves the statistics as they were."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_bnp.core.statistics import RunningStatistics

__all__ = ["OptimizerCommits", "PendingUpdate"]


@dataclass
class PendingUpdate:
    """Running-statistics updates computed by a step but not yet stored.

    The Lightning callback commits them from the optimizer's step post-hook, so a step that the
    ``GradScaler`` skips (non-finite gradients) leaves the statistics untouched.
    """

    # (statistics, (m, v, t, ρ^t)): t and ρ^t as (1,) device tensors
    items: list[tuple[RunningStatistics, tuple[Tensor, Tensor, Tensor, Tensor]]] = field(default_factory=list)

    def commit(self) -> None:
        for running, state in self.items:
            running.assign(*state)
        self.items.clear()


class OptimizerCommits:
    """The update each optimizer's next ``step()`` stores (from a step post-hook registered once per optimizer)."""

    def __init__(self) -> None:
        self.pending: dict[int, PendingUpdate] = {}
        self.hooks: dict[int, RemovableHandle] = {}

    def __getstate__(self) -> dict[str, Any]:
        # hook handles and updates of this process's optimizers stay behind with them
        return {"pending": {}, "hooks": {}}

    def defer(self, optimizer: Optimizer, update: PendingUpdate) -> None:
        """Store ``update`` when ``optimizer.step()`` next runs (replacing one not stored yet)."""
        self.pending[id(optimizer)] = update
        if id(optimizer) not in self.hooks:
            self.hooks[id(optimizer)] = optimizer.register_step_post_hook(self._commit)

    def _commit(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        pending = self.pending.pop(id(optimizer), None)
        if pending is not None:
            pending.commit()

    def clear(self) -> None:
        """Remove the hooks and drop the updates not stored."""
        for handle in self.hooks.values():
            handle.remove()
        self.hooks.clear()
        self.pending.clear()
