"""Forward calls that reentrant activation checkpointing recomputes during the backward, counted under the token
mask and the pause of the forward they recompute.

``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True)`` (and Hugging Face's
``gradient_checkpointing_enable()`` with reentrant checkpointing) runs ``fn`` once under ``torch.no_grad()`` in the
forward, then again with gradients during the backward, and back-propagates that second run. Its statistics are the
ones that count (the first run builds no graph), but they are taken after ``with pre.token_mask(mask):`` or
``with pre.paused():`` has exited: padding rows would enter σ², a paused forward would count.

So the first run records the context in force at each managed module call (:class:`Context`) on the checkpoint's
autograd node (its ``ctx``, found as the frame of ``CheckpointFunction.forward`` above the hook: :func:`remember`),
and the second run, which autograd executes as that node's backward (``torch._C._current_autograd_node()``), counts
each call under the context of the same call of the first run (:func:`replayed`). Non-reentrant checkpointing
needs none of this: its first run is the one back-propagated (the recomputed outputs are never reached,
:mod:`~lightning_bnp.core.reached`).
"""

from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import CheckpointFunction

from lightning_bnp.core.reached import current_task

__all__ = ["Context", "remember", "replayed"]

_FORWARD = CheckpointFunction.forward.__code__
_ATTRIBUTE = "_bnp_contexts"  # on the checkpoint's ctx: {collection: the contexts of its module calls, in order}
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


def _outermost_checkpoint() -> Any | None:
    """The ``ctx`` of the outermost reentrant ``torch.utils.checkpoint`` forward on the stack, or None."""
    found, frame = None, sys._getframe(2)
    for _ in range(_MAX_DEPTH):
        if frame is None:
            break
        if frame.f_code is _FORWARD:
            found = frame.f_locals.get("ctx")
        frame = frame.f_back  # type: ignore[assignment]
    return found


def remember(owner: object, context: Context) -> bool:
    """Append ``context``, that of one managed module call of ``owner`` (a statistics collection), to the outermost
    reentrant checkpoint whose first, gradient-free run makes the call; whether there is one. The recomputation
    makes the same calls in the same order and takes them back one per call (:func:`replayed`): a mask or pause
    that changes inside the checkpointed function holds too, and a checkpoint nested in another is remembered by
    the outer one (its own first run happens during the outer recomputation)."""
    if torch.compiler.is_compiling():  # (a traced forward: no frames to read, and no checkpoint's ctx to reach)
        return False
    ctx = _outermost_checkpoint()
    if ctx is None:
        return False
    contexts: dict[object, deque[Context]] | None = getattr(ctx, _ATTRIBUTE, None)
    if contexts is None:
        contexts = {}
        setattr(ctx, _ATTRIBUTE, contexts)
    contexts.setdefault(owner, deque()).append(context)
    return True


def replayed(owner: object) -> Context | None:
    """The context of the module call that the running backward recomputes now (reentrant checkpointing), taken
    from those :func:`remember` kept; None for any other forward call (and once they run out)."""
    if torch.compiler.is_compiling() or current_task() < 0:  # not in a backward: the usual forward
        return None
    node: Any = _current_node()
    contexts = getattr(node, _ATTRIBUTE, None)
    kept = None if contexts is None else contexts.get(owner)
    return kept.popleft() if kept else None
