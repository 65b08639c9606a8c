"""Hooks of the layer kinds whose forward yields several (input, output) pairs (:meth:`LayerKind.calls`: the q, k, v
projections and out-projection of ``nn.MultiheadAttention``, core/attention.py) or whose input is captured from an
``F.linear`` call made during the forward (:attr:`LayerKind.captures`), for
:class:`~lightning_bnp.core.collection.StatisticsCollection`; and what its hooks share: a forward recomputed by
reentrant checkpointing counts under its own token mask (:func:`under`).

The q, k and v layers of a self-attention see one input tensor: eager, it is reduced once for the three
(:func:`shared_moments`); traced (``torch.compile``), each layer reduces it and the compiler fuses them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_bnp.core.attention import capturing, stop_capturing
from lightning_bnp.core.copies import register_forward_hook, register_forward_pre_hook
from lightning_bnp.core.layers import ManagedLayer
from lightning_bnp.core.recompute import Context
from lightning_bnp.core.statistics import Moments
from lightning_bnp.core.token_masks import TokenMasks

__all__ = ["Record", "register_calls_hooks", "shared_moments", "under"]

# StatisticsCollection._record: count the moments of one (input, output) pair of a training forward call
Record = Callable[..., None]


def shared_moments(shared: list[Any], kind: Any, module: nn.Module, h: Tensor, out: Tensor) -> Moments:
    """Moments of ``h``, reduced once for the q, k and v layers of a self-attention (one tensor, one reduction
    of the same kind class): ``shared[0]`` keeps the latest with a weak reference to its input and version."""
    last, reduce = shared[0], type(kind).moments
    if last is not None and last[0]() is h and last[1] == h._version and last[2] is reduce and last[3] is module:
        return last[4]
    part = kind.moments(module, h, out)
    shared[0] = (weakref.ref(h), h._version, reduce, module, part)
    return part


def under(masks: TokenMasks, context: Context, record: Callable[[], None]) -> None:
    """Run ``record`` with the token mask of ``context`` in force (a recomputed forward's own)."""
    previous = masks.mask, masks.applies_to
    masks.mask, masks.applies_to = context.mask, context.applies_to
    try:
        record()
    finally:
        masks.mask, masks.applies_to = previous


def register_calls_hooks(
    layer: ManagedLayer,
    module: nn.Module,
    shared: list[Any],
    masks: TokenMasks,
    context_now: Callable[[], Context],
    remember: Callable[[], None],
    record_pair: Record,
) -> list[RemovableHandle]:
    """Hooks of a kind whose forward yields several (input, output) pairs (:meth:`LayerKind.calls`), or whose
    input is captured from an ``F.linear`` call made during the forward (:attr:`LayerKind.captures`).

    Args:
        layer, module: the managed layer and the module of it to hook.
        shared: the one-entry cache of :func:`shared_moments` that the layers of one attention share.
        masks: the token masks in force for the forward calls.
        context_now, remember, record_pair: the collection's: what a module call running now counts under, keep the
            context of a training forward without gradients (a reentrant checkpoint's first run), count the moments
            of one (input, output) pair (``StatisticsCollection._record``).
    """
    kind, handles = layer.kind, []
    started: list[tuple[Tensor, Context]] = []

    def reduce(module: nn.Module, h: Tensor, out: Tensor) -> Moments:
        # eager: the q, k, v layers of a self-attention reduce their one input once (traced: fused anyway)
        return (
            kind.moments(module, h, out)
            if torch.compiler.is_compiling()
            else shared_moments(shared, kind, module, h, out)
        )

    def counted_under() -> Context | None:
        """The context this module call counts under, None if it counts nothing (once per call: a reentrant
        checkpoint's recomputation takes back one remembered context per call)."""
        if not module.training:
            return None
        if not torch.is_grad_enabled():
            remember()
            return None
        context = context_now()
        return context if context.collecting and layer.weight.requires_grad else None

    if kind.captures:

        def pre_hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            context = counted_under()
            if context is not None:
                weight = kind.watched(module)  # type: ignore[attr-defined]
                capturing(weight)
                started.append((weight, context))

        handles.append(register_forward_pre_hook(module, pre_hook))

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if kind.captures:
            if not started:
                return
            watched, context = started.pop()
            calls = stop_capturing(watched)
            if output is None:  # the forward raised (an always_call hook)
                return
        else:
            found = counted_under()
            if found is None:
                return
            context, calls = found, kind.calls(module, args, kwargs, output)
        weight = layer.weight

        def record() -> None:
            for h, out in calls:
                if isinstance(h, Tensor) and (
                    isinstance(out, Tensor) or (isinstance(out, tuple) and all(isinstance(o, Tensor) for o in out))
                ):
                    record_pair(layer, module, args, kwargs, h, out, reduce, weight)

        under(masks, context, record)

    handles.append(register_forward_hook(module, hook, with_kwargs=True, always_call=kind.captures))
    return handles
