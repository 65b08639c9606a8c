"""BNP before clipping under Lightning's manual optimization (issue 37, item 4).

In automatic optimization Lightning runs ``on_before_optimizer_step`` (where BNP transforms the gradients) before
it clips them, so clipping sees the preconditioned gradient, the one the optimizer uses. In manual optimization
the ``training_step`` clips with ``self.clip_gradients(opt, …)`` before ``opt.step()``, and ``opt.step()`` is what
runs ``on_before_optimizer_step``: the clip would see the plain gradient. So for the length of a fit with
``automatic_optimization=False`` the module's ``clip_gradients`` first runs BNP's step for that optimizer, and the
``on_before_optimizer_step`` of that ``opt.step()`` does not run it again (nor does a second clipping of the same
optimizer: BNP's step, and the regularizer's terms with it, run once per optimizer step, also when several optimizers
are clipped before any of them steps). Clipping with ``torch.nn.utils`` directly is not seen: use
``self.clip_gradients``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from torch.optim import Optimizer

from lightning_bnp.core.pending import unwrap_optimizer

__all__ = ["PreconditionBeforeClipping"]

_ATTRIBUTE = "clip_gradients"


class _Clipping:
    """``pl_module.clip_gradients`` for a fit: BNP's step for ``optimizer`` (once), then Lightning's clipping."""

    def __init__(self, owner: PreconditionBeforeClipping, original: Callable[..., Any]) -> None:
        self.owner, self.original = owner, original

    def __call__(self, optimizer: Optimizer, *args: Any, **kwargs: Any) -> Any:
        module = self.original.__self__  # type: ignore[attr-defined]
        self.owner.precondition_early(module.trainer, module, optimizer)
        return self.original(optimizer, *args, **kwargs)

    def __reduce__(self) -> Any:  # a copy of the module (pickle, deepcopy) gets Lightning's own method back
        return getattr, (self.original.__self__, _ATTRIBUTE)  # type: ignore[attr-defined]


class PreconditionBeforeClipping:
    """Installs :class:`_Clipping` on a manual-optimization module and tells ``on_before_optimizer_step`` whether
    the step of its optimizer already ran.

    Args:
        precondition: BNP's step for an optimizer: ``precondition(trainer, pl_module, optimizer)`` (the
            callback's, with its regularizer).
    """

    def __init__(self, precondition: Callable[[pl.Trainer, pl.LightningModule, Optimizer], None]) -> None:
        self.precondition = precondition
        self.early: list[weakref.ref[Optimizer]] = []  # the optimizers whose step ran at clipping, before their step
        self.module: pl.LightningModule | None = None

    def __getstate__(self) -> dict[str, Any]:
        # a copy of the callback (pickle, deepcopy) installs nothing and remembers no optimizer of this process
        return {**self.__dict__, "early": [], "module": None}

    def install(self, pl_module: pl.LightningModule) -> None:
        """On a module with ``automatic_optimization=False``, for this fit (idempotent)."""
        if pl_module.automatic_optimization or isinstance(pl_module.__dict__.get(_ATTRIBUTE), _Clipping):
            return
        pl_module.__dict__[_ATTRIBUTE] = _Clipping(self, getattr(pl_module, _ATTRIBUTE))
        self.module = pl_module

    def remove(self) -> None:
        """Give the module Lightning's ``clip_gradients`` back (end of fit, or an exception)."""
        module, self.module, self.early = self.module, None, []
        if module is not None and isinstance(module.__dict__.get(_ATTRIBUTE), _Clipping):
            del module.__dict__[_ATTRIBUTE]

    def precondition_early(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer) -> None:
        """BNP's step for ``optimizer`` at its clipping, once before its step."""
        optimizer = unwrap_optimizer(optimizer)
        if self._clipped(optimizer):
            return  # clipped twice before one step
        self.precondition(trainer, pl_module, optimizer)
        self.early.append(weakref.ref(optimizer))

    def ran_early(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer``'s step already ran at its clipping (then forgotten: its next step is a new one); the
        other optimizers clipped and not stepped yet stay remembered."""
        optimizer = unwrap_optimizer(optimizer)
        ran = self._clipped(optimizer)
        self.early = [ref for ref in self.early if (other := ref()) is not None and other is not optimizer]
        return ran

    def _clipped(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer`` (unwrapped) had its step run at a clipping since its last step."""
        return any(ref() is optimizer for ref in self.early)

    def new_batch(self) -> None:
        """A clip not followed by its optimizer's step does not carry over into the next batch."""
        self.early = []
