"""Forward statistics: hooks on the managed modules that reduce each training forward call's input to moments and
add them to the layer's statistics for the next step once the backward pass reaches the call's output; which
preconditioner owns a module (one at a time), attaching and detaching the hooks, and pausing the collection.

A forward call's statistics count once the backward pass reaches its output (a pre-hook on the output's autograd
node): a forward whose output gets no gradient adds nothing, and the forward that non-reentrant activation
checkpointing recomputes during the backward is not counted twice. Under ``torch.compile`` the hooks are traced
and count at the forward (README "torch.compile").

Discarded gradients. Statistics counted belong to the gradient accumulated in the weight's ``.grad``: a hook after
the weight's gradient accumulation marks a layer's pending statistics as having reached it, and a later count that
finds ``.grad`` reset to ``None`` (``zero_grad()``, whose default is ``set_to_none=True``) since then drops them
first — e.g. a GAN's discriminator forward during the generator's step, without ``toggle_optimizer``, whose
gradient the discriminator's ``zero_grad()`` throws away (issue 37, item 5). Only identity is compared (no tensor
value, no host read). Not seen: a gradient zeroed in place (``zero_grad(set_to_none=False)``).

Other tensors as the weight. ``torch.func.functional_call(model, params, x)`` swaps its own tensors into the
module for one forward: the hooks record that forward's statistics, but the backward puts the gradient on those
tensors, not on the weight leaf BNP manages. A counted forward whose module held another tensor than the leaf kept
at :meth:`~StatisticsCollection.attach` marks the layer (:attr:`ManagedLayer.foreign_weight`, identity only, eager
only); the step names such a layer when its leaf has no gradient (under FSDP2 the forward's unsharded weight is
another tensor too, but the gradient reaches the leaf: nothing is said).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_bnp.core.attention import capturing, stop_capturing
from lightning_bnp.core.copies import register_forward_hook, register_forward_pre_hook
from lightning_bnp.core.layers import ManagedLayer
from lightning_bnp.core.statistics import Moments
from lightning_bnp.core.token_masks import TokenMasks

__all__ = ["StatisticsCollection"]

# module → the attached collection that manages it (so that a second one is refused)
_OWNERS: weakref.WeakKeyDictionary[nn.Module, weakref.ref[StatisticsCollection]] = weakref.WeakKeyDictionary()


def _shared_moments(shared: list[Any], kind: Any, module: nn.Module, h: Tensor, out: Tensor) -> Moments:
    """Moments of ``h``, reduced once for the q, k and v layers of a self-attention (one tensor, one reduction
    of the same kind class): ``shared[0]`` keeps the latest with a weak reference to its input and version."""
    last, reduce = shared[0], type(kind).moments
    if last is not None and last[0]() is h and last[1] == h._version and last[2] is reduce and last[3] is module:
        return last[4]
    part = kind.moments(module, h, out)
    shared[0] = (weakref.ref(h), h._version, reduce, module, part)
    return part


class StatisticsCollection:
    """The forward hooks of one preconditioner's layers.

    Args:
        layers: the managed layers (their :attr:`~ManagedLayer.moments` collect the step's statistics).
        masks: the token masks in force for the forward calls.
    """

    def __init__(self, layers: list[ManagedLayer], masks: TokenMasks) -> None:
        self.layers, self.masks = layers, masks
        self.handles: list[RemovableHandle] = []
        self.collecting = True  # False inside BNPPreconditioner.paused()
        self.generation = 0  # bumped by detach(): forwards from before it never count
        # layer → (its weight, the pending statistics that reached the weight's gradient, whose accumulation ran
        # since): they are dropped if that gradient is reset before the next count
        self.settled: dict[str, tuple[weakref.ref[Tensor], Moments]] = {}
        # layer → its weight leaf when attached: a forward that runs with another tensor as the weight is marked
        self.leaves: dict[str, weakref.ref[Tensor]] = {}

    def __getstate__(self) -> dict[str, Any]:
        # hook handles stay behind (a copy of the model carries no BNP hooks: core/copies.py)
        return {**self.__dict__, "handles": [], "settled": {}, "leaves": {}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({"settled": {}, "leaves": {}, **state})  # (pickled before `settled` existed)

    @property
    def attached(self) -> bool:
        return bool(self.handles)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Forward passes inside this context do not contribute statistics."""
        previous, self.collecting = self.collecting, False
        try:
            yield
        finally:
            self.collecting = previous

    def attach(self) -> None:
        """Register the forward hooks (idempotent).

        Raises:
            RuntimeError: a layer is already managed by another attached preconditioner (the
                gradient would be transformed twice); ``detach()`` that one first.
        """
        if self.handles:
            return
        taken = {
            name: owner
            for layer in self.layers
            for name, module in layer.modules.items()
            if (owner := _OWNERS.get(module)) is not None and owner() is not None and owner() is not self
        }
        if taken:
            raise RuntimeError(
                f"layers {sorted(taken)} are already managed by another attached BNPPreconditioner (or "
                "BatchNormPreconditioning callback); two would transform the gradients twice. Call "
                "`.detach()` on the other one first."
            )
        shared: list[Any] = [None]  # attention's q, k, v layers share one reduction of one tensor
        for layer in self.layers:
            for module in layer.modules.values():
                _OWNERS[module] = weakref.ref(self)
                if layer.kind.captures or not layer.kind.default_calls:  # attention (core/attention.py)
                    self.handles.extend(self._register_calls_hooks(layer, module, shared))
                    continue
                self.handles.append(register_forward_hook(module, self._make_hook(layer), with_kwargs=True))
        for layer in self.layers:
            weight = layer.weight
            if isinstance(weight, Tensor) and weight.is_leaf and weight.requires_grad:  # (frozen: nothing to track)
                settle = self._settle_when_accumulated(layer, weight)
                self.handles.append(weight.register_post_accumulate_grad_hook(settle))
                self.leaves[layer.name] = weakref.ref(weight)

    def detach(self) -> None:
        """Remove the hooks; statistics of forwards that ran before this call never count."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.settled.clear()
        self.leaves.clear()
        self.generation += 1
        for layer in self.layers:
            layer.moments = None
            layer.foreign_weight = False
            for module in layer.modules.values():
                owner = _OWNERS.get(module)
                if owner is not None and owner() is self:
                    del _OWNERS[module]

    def _make_hook(self, layer: ManagedLayer) -> Any:
        kind = layer.kind
        moments, layer_input, default_input, input_name = kind.moments, kind.input, kind.default_input, kind.input_name

        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            # statistics only from training forward passes that build a graph for a gradient
            if not (self.collecting and module.training and torch.is_grad_enabled()):
                return
            weight = layer.weight  # (looked up once per call: a property that follows reparametrizations)
            if not weight.requires_grad:
                return
            if default_input:  # forward(input): inline, as it runs at every forward call
                h = args[0] if args else kwargs.get(input_name)
            else:
                h = layer_input(module, args, kwargs)
            if isinstance(h, Tensor) and isinstance(output, Tensor):
                self._record(layer, module, args, kwargs, h, output, moments, weight)

        return hook

    def _record(
        self,
        layer: ManagedLayer,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        h: Tensor,
        out: Tensor | tuple[Tensor, ...],
        moments: Callable[[nn.Module, Tensor, Any], Moments],
        weight: Tensor,
    ) -> None:
        """Count the moments of one (input, output) pair of a training forward call: ``moments`` reduces ``h`` (on
        ``h.detach()``: it records no graph) unless a token mask applies or ``h`` is nested; they join the step once
        the backward reaches ``out`` (any one of them, for a tuple: a recurrent layer's sequence and final states),
        or at once in a traced forward (README, "torch.compile"). ``weight``: the layer's weight attribute as this
        forward found it."""
        special = None
        if self.masks.mask is not None or h.is_nested:  # token masks, jagged rows
            special = self.masks.moments_of(layer, module, args, kwargs, h, out)
        if torch.compiler.is_compiling():
            layer.add_moments(moments(module, h, out) if special is None else special)
            return
        nodes = [out.grad_fn] if isinstance(out, Tensor) else list(dict.fromkeys(o.grad_fn for o in out))
        if any(node is not None for node in nodes):
            # the tensor this forward used as the weight (the module's attribute now: torch.func.functional_call
            # swaps in its own tensors) is not the leaf BNP manages: its gradient lands elsewhere
            leaf = self.leaves.get(layer.name)
            foreign = leaf is not None and weight is not leaf()
            count = self._count_when_reached(layer, moments(module, h, out) if special is None else special, foreign)
            for node in nodes:  # (one count: the first node the backward reaches)
                if node is not None:
                    node.register_prehook(count)

    def _register_calls_hooks(self, layer: ManagedLayer, module: nn.Module, shared: list[Any]) -> list[RemovableHandle]:
        """Hooks of a kind whose forward yields several (input, output) pairs (:meth:`LayerKind.calls`), or whose
        input is captured from an ``F.linear`` call made during the forward (:attr:`LayerKind.captures`)."""
        kind, handles = layer.kind, []
        started: list[Tensor] = []

        def reduce(module: nn.Module, h: Tensor, out: Tensor) -> Moments:
            # eager: the q, k, v layers of a self-attention reduce their one input once (traced: fused anyway)
            return (
                kind.moments(module, h, out)
                if torch.compiler.is_compiling()
                else _shared_moments(shared, kind, module, h, out)
            )

        def recording() -> bool:
            return self.collecting and module.training and torch.is_grad_enabled() and layer.weight.requires_grad

        if kind.captures:

            def pre_hook(module: nn.Module, args: tuple[Any, ...]) -> None:
                if recording():
                    weight = kind.watched(module)  # type: ignore[attr-defined]
                    capturing(weight)
                    started.append(weight)

            handles.append(register_forward_pre_hook(module, pre_hook))

        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if kind.captures:
                if not started:
                    return
                calls = stop_capturing(started.pop())
                if output is None:  # the forward raised (an always_call hook)
                    return
            elif recording():
                calls = kind.calls(module, args, kwargs, output)
            else:
                return
            weight = layer.weight
            for h, out in calls:
                if isinstance(h, Tensor) and (
                    isinstance(out, Tensor) or (isinstance(out, tuple) and all(isinstance(o, Tensor) for o in out))
                ):
                    self._record(layer, module, args, kwargs, h, out, reduce, weight)

        handles.append(register_forward_hook(module, hook, with_kwargs=True, always_call=kind.captures))
        return handles

    def _count_when_reached(self, layer: ManagedLayer, part: Moments, foreign: bool = False) -> Any:
        """A pre-hook for the output's autograd node: the forward's statistics join the step when the
        backward pass reaches the output (once, however often the graph is back-propagated); ``foreign``: the
        forward used another tensor than the managed weight leaf (:attr:`ManagedLayer.foreign_weight`)."""
        generation, counted = self.generation, False

        def count(grad_outputs: tuple[Tensor | None, ...]) -> None:
            nonlocal counted
            if counted or generation != self.generation:
                return
            counted = True
            settled = self.settled.pop(layer.name, None)
            # the very statistics that reached the gradient, and the gradient reset since: a discarded gradient's
            # (statistics counted after the settle — a later step's, a traced forward's — are not those)
            if (
                settled is not None
                and layer.moments is settled[1]
                and (weight := settled[0]()) is not None
                and weight.grad is None
            ):
                layer.moments = None
            layer.add_moments(part)
            layer.foreign_weight |= foreign

        return count

    def _settle_when_accumulated(self, layer: ManagedLayer, leaf: Tensor) -> Any:
        """A post-accumulate-grad hook of the weight ``leaf``: the layer's pending statistics have reached its gradient.
        Only for ``leaf`` itself: a wrapper that copies the hook to a tensor of its own (FSDP2's unsharded parameter,
        whose gradient it moves to the sharded one and resets) settles nothing."""
        ref = weakref.ref(leaf)

        def settle(weight: Tensor) -> None:
            if layer.moments is not None and weight is ref():
                self.settled[layer.name] = (ref, layer.moments)

        return settle
