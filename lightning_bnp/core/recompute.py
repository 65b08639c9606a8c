"""Forward calls that reentrant activation checkpointing recomputes during the backward, counted under the token
mask and the pause of the forward they recompute.

``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True)`` (and Hugging Face's
``gradient_checkpointing_enable()`` with reentrant checkpointing) runs ``fn`` once under ``torch.no_grad()`` in the
forward, then again with gradients during the backward, and back-propagates that second run. Its statistics are the
ones that count (the first run builds no graph), but they are taken after ``with pre.token_mask(mask):`` or
``with pre.paused():`` has exited: padding rows would enter σ², a paused forward would count.

So the first run records the context in force (:class:`Context`) on the checkpoint's autograd node (its ``ctx``,
found as the frame of ``CheckpointFunction.forward`` above the hook: :func:`remember`), and the second run, which
autograd executes as that node's backward (``torch._C._current_autograd_node()``), is counted under it
(:func:`replayed`). Non-reentrant checkpointing needs none of this: its first run is the one back-propagated (the
recomputed outputs are never reached, :mod:`~lightning_bnp.core.reached`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import CheckpointFunction

from lightning_bnp.core.reached import current_task

__all__ = ["Context", "remember", "replayed"]

_FORWARD = CheckpointFunction.forward.__code__
_ATTRIBUTE = "_bnp_contexts"  # on the checkpoint's ctx: {collection: Context}
# the node the autograd engine runs now (a torch without it: recomputations count under the current context)
_current_node = getattr(torch._C, "_current_autograd_node", lambda: None)
# frames between a forward hook and the checkpoint's forward: module calls nested this deep inside ``fn``
_MAX_DEPTH = 200


@dataclass(frozen=True)
class Context:
    """What a forward call is counted under: whether statistics are collected (not paused), and the token mask."""

    collecting: bool
    mask: Tensor | None
    applies_to: frozenset[str] | None


def _checkpoint_ctx() -> Any | None:
    """The ``ctx`` of the reentrant ``torch.utils.checkpoint`` forward that the caller's caller runs in, or None."""
    frame = sys._getframe(2)
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return None
        if frame.f_code is _FORWARD:
            return frame.f_locals.get("ctx")
        frame = frame.f_back  # type: ignore[assignment]
    return None


def remember(owner: object, context: Context) -> bool:
    """Keep ``context`` for ``owner`` (a statistics collection) on the reentrant checkpoint whose first, gradient-free
    run calls this hook; the first call of a run wins. Whether the call runs inside one."""
    if torch.compiler.is_compiling():  # (a traced forward: no frames to read, and no checkpoint's ctx to reach)
        return False
    ctx = _checkpoint_ctx()
    if ctx is None:
        return False
    contexts: dict[object, Context] | None = getattr(ctx, _ATTRIBUTE, None)
    if contexts is None:
        contexts = {}
        setattr(ctx, _ATTRIBUTE, contexts)
    contexts.setdefault(owner, context)
    return True


def replayed(owner: object) -> Context | None:
    """The context ``owner`` remembered for the forward that the running backward recomputes (reentrant
    checkpointing); None for any other forward call."""
    if torch.compiler.is_compiling() or current_task() < 0:  # not in a backward: the usual forward
        return None
    node: Any = _current_node()
    contexts = getattr(node, _ATTRIBUTE, None)
    return None if contexts is None else contexts.get(owner)
