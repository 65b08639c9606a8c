"""Forward statistics: hooks on the managed modules that reduce each training forward call's input to moments and
add them to the layer's statistics for the next step once a backward gives the weight the gradient of the call's
output; which preconditioner owns a module (one at a time), attaching and detaching the hooks, and pausing the
collection.

When a forward call counts (docs/computation.md "Which forward calls count"). Its moments are held when a backward
reaches its output (a pre-hook on the output's autograd node) and join the step when that same backward accumulates
the weight's gradient (a post-accumulate-grad hook on the weight): :mod:`~lightning_bnp.core.reached`. A forward
whose output gets no gradient, or whose backward accumulates nothing into the weight (``torch.autograd.grad(loss,
x)`` for adversarial examples or saliency, ``autograd.grad`` with respect to the parameters, ``backward(inputs=...)``
without the weight) adds nothing; the forward that non-reentrant activation checkpointing recomputes during the
backward is never reached, and the one that reentrant checkpointing recomputes (the only one back-propagated there)
counts under the token mask and pause of the forward it recomputes (:mod:`~lightning_bnp.core.recompute`). Under
``torch.compile`` the hooks are traced and count at the forward (README "torch.compile").

Discarded gradients. Statistics counted belong to the gradient accumulated in the weight's ``.grad``: the hook after
the weight's gradient accumulation marks a layer's pending statistics as having reached it, and a later forward
reached by a backward that finds ``.grad`` reset to ``None`` (``zero_grad()``, whose default is
``set_to_none=True``) since then drops them first — e.g. a GAN's discriminator forward during the generator's step,
without ``toggle_optimizer``, whose gradient the discriminator's ``zero_grad()`` throws away (issue 37, item 5).
Only identity is compared (no tensor value, no host read). Not seen: a gradient zeroed in place
(``zero_grad(set_to_none=False)``).

Other tensors as the weight. ``torch.func.functional_call(model, params, x)`` swaps its own tensors into the
module for one forward: the hooks record that forward's statistics, but the backward puts the gradient on those
tensors, not on the weight leaf BNP manages. Such a forward counts when the backward accumulates the gradient of
the tensor it used (its leaf is hooked at the forward), and marks the layer (:attr:`ManagedLayer.foreign_weight`,
identity only, eager only); the step names such a layer when its leaf has no gradient (under FSDP2 the forward's
unsharded weight is another tensor too, but the gradient reaches the leaf: nothing is said).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_bnp.core.call_hooks import register_calls_hooks, under
from lightning_bnp.core.copies import register_forward_hook
from lightning_bnp.core.layers import NO_LEAF, ManagedLayer
from lightning_bnp.core.reached import BackwardTasks, Reached
from lightning_bnp.core.recompute import Context, remember, replayed
from lightning_bnp.core.statistics import Moments
from lightning_bnp.core.token_masks import TokenMasks

__all__ = ["StatisticsCollection"]

# module → the attached collection that manages it (so that a second one is refused)
_OWNERS: weakref.WeakKeyDictionary[nn.Module, weakref.ref[StatisticsCollection]] = weakref.WeakKeyDictionary()


def _count(layer: ManagedLayer, reached: Reached) -> None:
    """A reached forward's statistics join the layer's step."""
    reached.counted = True
    layer.add_moments(reached.part)
    layer.foreign_weight |= reached.foreign


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
        # layer → the tensors whose gradient accumulation counts its reached forwards: id → (tensor, hook handle)
        self.watched: dict[str, dict[int, tuple[weakref.ref[Tensor], RemovableHandle]]] = {}
        self.tasks = BackwardTasks()  # forwards reached by each running backward, not counted yet
        self.recomputes = False  # a reentrant checkpoint ran a managed module: look for recomputations from then on

    def __getstate__(self) -> dict[str, Any]:
        # hook handles stay behind (a copy of the model carries no BNP hooks: core/copies.py)
        fresh = {"settled": {}, "leaves": {}, "watched": {}, "tasks": BackwardTasks(), "recomputes": False}
        return {**self.__dict__, "handles": [], **fresh}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # (pickled before `settled`, `watched` existed)
        fresh = {"settled": {}, "leaves": {}, "watched": {}, "tasks": BackwardTasks(), "recomputes": False}
        self.__dict__.update({**fresh, **state})

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
                    hooks = register_calls_hooks(
                        layer, module, shared, self.masks, self._context, self._remember, self._record
                    )
                    self.handles.extend(hooks)
                    continue
                self.handles.append(register_forward_hook(module, self._make_hook(layer), with_kwargs=True))
        for layer in self.layers:
            weight = layer.weight
            if isinstance(weight, Tensor) and weight.is_leaf and weight is not NO_LEAF:
                self.leaves[layer.name] = weakref.ref(weight)
                self._watch(layer, weight)  # (frozen: at its first forward once trainable)

    def detach(self) -> None:
        """Remove the hooks; statistics of forwards that ran before this call never count."""
        for handle in self.handles:
            handle.remove()
        for watched in self.watched.values():
            for _, handle in watched.values():
                handle.remove()
        self.handles.clear()
        self.settled.clear()
        self.leaves.clear()
        self.watched.clear()
        self.tasks.clear()
        self.generation += 1
        for layer in self.layers:
            layer.moments = None
            layer.foreign_weight = False
            for module in layer.modules.values():
                owner = _OWNERS.get(module)
                if owner is not None and owner() is self:
                    del _OWNERS[module]

    def _replayed(self) -> Context | None:
        """Inside a reentrant checkpoint's recomputation, the context of the module call it recomputes (taken back:
        call once per module call, :mod:`~lightning_bnp.core.recompute`); None otherwise (without a look before any
        reentrant checkpoint ran)."""
        return replayed(self) if self.recomputes else None

    def _context(self) -> Context:
        """What a module call running now is counted under (once per call, as :meth:`_replayed`)."""
        return self._replayed() or Context(self.collecting, self.masks.mask, self.masks.applies_to)

    def _remember(self) -> None:
        """A training forward call without gradients: a reentrant checkpoint's first run keeps the context."""
        self.recomputes |= remember(self, self._context())

    def _make_hook(self, layer: ManagedLayer) -> Any:
        kind = layer.kind
        moments, layer_input, default_input, input_name = kind.moments, kind.input, kind.default_input, kind.input_name

        def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            weight = layer.weight  # (looked up once per call: a property that follows reparametrizations)
            if not weight.requires_grad:
                return
            if default_input:  # forward(input): inline, as it runs at every forward call
                h = args[0] if args else kwargs.get(input_name)
            else:
                h = layer_input(module, args, kwargs)
            if isinstance(h, Tensor) and isinstance(output, Tensor):
                self._record(layer, module, args, kwargs, h, output, moments, weight)

        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            # statistics only from training forward passes that build a graph for a gradient
            if not module.training:
                return
            if not torch.is_grad_enabled():
                self._remember()
                return
            replay = self._replayed()
            if replay is None:
                if self.collecting:
                    record(module, args, kwargs, output)
            elif replay.collecting:  # recomputed by reentrant checkpointing: under its forward's mask
                under(self.masks, replay, lambda: record(module, args, kwargs, output))

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
        a backward reaches ``out`` (any one of them, for a tuple: a recurrent layer's sequence and final states) and
        accumulates the gradient of ``weight``, or at once in a traced forward (README, "torch.compile"). ``weight``:
        the layer's weight attribute as this forward found it."""
        special = None
        if self.masks.mask is not None or h.is_nested:  # token masks, jagged rows
            special = self.masks.moments_of(layer, module, args, kwargs, h, out)
        if torch.compiler.is_compiling():
            layer.add_moments(moments(module, h, out) if special is None else special)
            return
        nodes: tuple[Any, ...]  # the autograd nodes of the output(s)
        if isinstance(out, Tensor):
            nodes = () if out.grad_fn is None else (out.grad_fn,)
        else:
            nodes = tuple(node for node in dict.fromkeys(o.grad_fn for o in out) if node is not None)
        if nodes:
            # the tensor this forward used as the weight (the module's attribute now: torch.func.functional_call
            # swaps in its own tensors) is not the leaf BNP manages: its gradient lands elsewhere
            leaf = self.leaves.get(layer.name)
            foreign = leaf is not None and weight is not leaf()
            self._watch(layer, weight)
            part = moments(module, h, out) if special is None else special
            hold = self._hold_when_reached(layer, Reached(part, foreign))
            for node in nodes:  # (held once: by the first of them a backward reaches)
                node.register_prehook(hold)

    def _watch(self, layer: ManagedLayer, weight: Tensor) -> None:
        """Count ``layer``'s reached forwards when a backward accumulates the gradient of ``weight`` (a trainable leaf:
        the module's own weight, or one a forward ran with — torch.func.functional_call's, FSDP2's unsharded one)."""
        watched = self.watched.get(layer.name)
        known = None if watched is None else watched.get(id(weight))
        if (known is not None and known[0]() is weight) or not (weight.is_leaf and weight.requires_grad):
            return
        if watched is None:
            watched = self.watched[layer.name] = {}
        for key in [key for key, (ref, _) in watched.items() if ref() is None]:  # (tensors freed since)
            del watched[key]
        handle = weight.register_post_accumulate_grad_hook(self._count_when_accumulated(layer))
        watched[id(weight)] = (weakref.ref(weight), handle)

    def _hold_when_reached(self, layer: ManagedLayer, reached: Reached) -> Any:
        """A pre-hook for the output's autograd node: when a backward reaches the output, the forward's statistics
        wait for that backward to accumulate the weight's gradient (:mod:`~lightning_bnp.core.reached`); they count
        once, however often the graph is back-propagated."""
        generation = self.generation

        def hold(grad_outputs: tuple[Tensor | None, ...]) -> None:
            if reached.counted or generation != self.generation:
                return
            self._drop_discarded(layer)
            if not self.tasks.hold(layer.name, reached):  # (no graph task to wait for: counted now)
                _count(layer, reached)

        return hold

    def _drop_discarded(self, layer: ManagedLayer) -> None:
        """Drop the statistics that reached the weight's gradient if that gradient was reset since (and nothing was
        counted after them: statistics counted after the settle — a later step's, a traced forward's — are not a
        discarded gradient's)."""
        settled = self.settled.get(layer.name)
        if (
            settled is not None
            and layer.moments is settled[1]
            and (weight := settled[0]()) is not None
            and weight.grad is None
        ):
            layer.moments = None
            del self.settled[layer.name]

    def _count_when_accumulated(self, layer: ManagedLayer) -> Any:
        """A post-accumulate-grad hook of a tensor ``layer``'s forwards ran with: what the running backward reached of
        ``layer`` counts, and, for the managed leaf itself, the layer's statistics have reached its gradient. A
        wrapper that accumulates a gradient in a tensor of its own and moves it to the leaf (FSDP2's unsharded
        parameter) counts there and settles nothing."""

        def accumulated(weight: Tensor) -> None:
            for reached in self.tasks.take(layer.name):
                if not reached.counted:
                    _count(layer, reached)
            leaf = self.leaves.get(layer.name)
            if layer.moments is not None and leaf is not None and weight is leaf():
                self.settled[layer.name] = (leaf, layer.moments)

        return accumulated
