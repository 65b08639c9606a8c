"""Running-statistics updates that a step computed and an optimizer's step stores: so that a step the optimizer
does not take (``GradScaler`` skipping non-finite gradients) leaves the statistics as they were.

An optimizer is known by the ``torch.optim.Optimizer`` itself, never by its ``id()`` nor by a wrapper around it:
:func:`unwrap_optimizer` follows the wrappers that frameworks hand out (Lightning's ``LightningOptimizer`` from
``self.optimizers()``, Fabric's optimizer from ``fabric.setup``, 🤗 Accelerate's ``AcceleratedOptimizer``) to the
optimizer whose ``step()`` runs the post-hook, and the pending updates are held in a ``WeakKeyDictionary``, so that
an optimizer re-created every step gets its own entry (``id()`` is reused once the old one is freed) and a freed
optimizer's entry goes with it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_bnp.core.statistics import RunningStatistics

__all__ = ["OptimizerCommits", "PendingUpdate", "unwrap_optimizer"]

# the attributes under which the wrappers keep the optimizer they wrap (Lightning, Fabric: `_optimizer`;
# 🤗 Accelerate: `optimizer`), read from the wrapper's own `__dict__` (its `__getattr__` forwards to the optimizer)
_WRAPPED = ("_optimizer", "optimizer")


def unwrap_optimizer(optimizer: Optimizer) -> Optimizer:
    """The ``torch.optim.Optimizer`` inside ``optimizer``'s wrappers (``optimizer`` itself when it wraps none)."""
    seen = {id(optimizer)}
    while True:
        state = getattr(optimizer, "__dict__", {})
        inner = next((state[a] for a in _WRAPPED if isinstance(state.get(a), Optimizer)), None)
        if inner is None or id(inner) in seen:
            return optimizer
        seen.add(id(inner))
        optimizer = inner


@dataclass
class PendingUpdate:
    """Running-statistics updates computed by a step but not yet stored.

    The Lightning callback commits them from the optimizer's step post-hook, so a step that the
    ``GradScaler`` skips (non-finite gradients) leaves the statistics untouched.
    """

    # (statistics, (m, v, t, ρ^t)): views of the buffers that `writes` fill, t and ρ^t as (1,) device tensors
    items: list[tuple[RunningStatistics, tuple[Tensor, Tensor, Tensor, Tensor]]] = field(default_factory=list)
    # (buffer, value, add): the state the step computed, copied (or added) into the step plan's buffers in place
    writes: list[tuple[Tensor, Tensor, bool]] = field(default_factory=list)

    def commit(self) -> None:
        for buffer, value, add in self.writes:
            if add:
                buffer.add_(value)
            else:
                buffer.copy_(value)
        for running, state in self.items:  # (the views of the buffers: mostly the ones it holds already)
            running.assign(*state)
        self.items.clear()
        self.writes.clear()


@dataclass
class _Entry:
    """One optimizer's step post-hook and the update its next ``step()`` stores."""

    hook: RemovableHandle
    pending: PendingUpdate | None = None


class OptimizerCommits:
    """The update each optimizer's next ``step()`` stores (from a step post-hook registered once per optimizer)."""

    def __init__(self) -> None:
        self.entries: weakref.WeakKeyDictionary[Optimizer, _Entry] = weakref.WeakKeyDictionary()

    def __getstate__(self) -> dict[str, Any]:
        # hook handles and updates of this process's optimizers stay behind with them
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def defer(self, optimizer: Optimizer, update: PendingUpdate) -> None:
        """Store ``update`` when ``optimizer.step()`` next runs (replacing one not stored yet); ``optimizer``: the
        ``torch.optim.Optimizer`` itself, not a wrapper (:func:`unwrap_optimizer`)."""
        entry = self.entries.get(optimizer)
        if entry is None:
            entry = self.entries[optimizer] = _Entry(optimizer.register_step_post_hook(self._commit))
        entry.pending = update

    def pending(self, optimizer: Optimizer) -> PendingUpdate | None:
        """The update ``optimizer``'s next ``step()`` stores (``None``: none); ``optimizer`` unwrapped as for
        :meth:`defer`."""
        entry = self.entries.get(optimizer)
        return None if entry is None else entry.pending

    def _commit(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        entry = self.entries.get(optimizer)
        if entry is not None and entry.pending is not None:
            pending, entry.pending = entry.pending, None
            pending.commit()

    def clear(self) -> None:
        """Remove the hooks and drop the updates not stored."""
        for entry in list(self.entries.values()):
            entry.hook.remove()
        self.entries.clear()
