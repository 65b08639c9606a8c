"""Token masks: the forward calls of a step count only the real tokens of their padded (B, T, …) inputs, so that
μ, σ² and N (so q²) of each managed layer are those of the rows a mask marks, as if the padding were not there;
a jagged nested tensor's real rows count without a mask."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import Tensor, nn

from lightning_bnp.core.layers import ManagedLayer
from lightning_bnp.core.selection import module_name
from lightning_bnp.core.statistics import Moments
from lightning_bnp.core.validation import check_patterns

__all__ = ["TokenMasks", "layer_names"]


def layer_names(layer: ManagedLayer) -> tuple[str, ...]:
    """A layer's name, its module's (``attn`` for ``attn.q``) and those of modules tied to it."""
    return (layer.name, module_name(layer.name, layer.kind.suffix), *layer.tied)


def _jagged_rows(layer: ManagedLayer, module: nn.Module, h: Tensor) -> Tensor:
    """The real rows of a nested input: a jagged nested tensor's ``values()`` (Σ lengths, …, F), every row a
    token, no padding.

    Raises:
        ValueError: a nested tensor of another layout (torch.strided), or a layer whose rows are not tokens.
    """
    if h.layout != torch.jagged or not layer.kind.dense:
        raise ValueError(
            f"BNP layer {layer.name!r} ({type(module).__name__}) got a nested tensor of layout {h.layout} "
            f"({h.size(0)} sequences); BNP reads the real rows of a jagged one (torch.nested.nested_tensor(..., "
            "layout=torch.jagged)) into a dense layer (Linear and its kinds). Pass a jagged nested tensor, or a "
            "padded tensor with `token_mask`, or exclude the layer with `exclude`"
        )
    return h.values()


class TokenMasks:
    """The token mask in force for a preconditioner's forward calls, and the layers it applies to.

    Args:
        layers: the preconditioner's managed layers (``layers=`` patterns match their names).
    """

    def __init__(self, layers: list[ManagedLayer]) -> None:
        self.layers = layers
        self.mask: Tensor | None = None  # True or nonzero = a real token
        self._real: tuple[Tensor, Tensor] | None = None  # (an integer mask, it as a bool tensor) once a forward read it
        self.applies_to: frozenset[str] | None = None  # the layers it applies to (None: all)
        self._chosen: dict[tuple[str, ...], frozenset[str]] = {}  # `layers` patterns → layer names

    def __getstate__(self) -> dict[str, Any]:
        # a mask is the current batch's: a copy starts without one
        return {**self.__dict__, "mask": None, "applies_to": None, "_real": None}

    def set(self, mask: Tensor | None, *, layers: Sequence[str] | str | None = None) -> None:
        """Set ``mask`` for the forward calls from now on (arguments, errors: ``BNPPreconditioner.set_token_mask``)."""
        if mask is not None:
            if not isinstance(mask, Tensor) or mask.dtype.is_floating_point or mask.dtype.is_complex:
                described = f"a tensor of dtype {mask.dtype}" if isinstance(mask, Tensor) else type(mask).__name__
                raise TypeError(
                    "`mask` must be a bool tensor (True = real token) or an integer one (nonzero = real token), "
                    f"got {described}"
                )
            if mask.dim() == 0:
                raise ValueError(
                    f"`mask` needs the leading dimensions of the layers' inputs, got shape {tuple(mask.shape)}"
                )
        chosen = None
        if layers is not None:
            patterns = check_patterns("layers", layers)
            assert patterns is not None
            chosen = self._chosen.get(tuple(patterns))  # the callback sets one per batch
            if chosen is None:
                chosen = self._chosen[tuple(patterns)] = self._layers_matching(patterns)
        self.mask, self.applies_to = mask, chosen
        self._real = None

    def _real_tokens(self, mask: Tensor) -> Tensor:
        """``mask`` as a bool tensor (True = real), made at the first forward that reads it after it is set, not
        when it is set: the forward is inside a captured step, where a graph reads the batch's own mask (the batch
        hook that sets it runs before the step, and its tensors would be that batch's only)."""
        if mask.dtype == torch.bool:
            return mask
        if self._real is None or self._real[0] is not mask:
            self._real = (mask, mask != 0)
        return self._real[1]

    @contextmanager
    def applied(self, mask: Tensor | None, *, layers: Sequence[str] | str | None = None) -> Iterator[None]:
        """:meth:`set` for the forward calls inside the context; the previous mask (or none) is restored on exit."""
        previous = self.mask, self.applies_to
        self.set(mask, layers=layers)
        try:
            yield
        finally:
            self.mask, self.applies_to = previous

    def _layers_matching(self, patterns: list[str]) -> frozenset[str]:
        chosen: set[str] = set()
        for pattern in patterns:
            matched = {
                layer.name for layer in self.layers if any(fnmatchcase(name, pattern) for name in layer_names(layer))
            }
            if not matched:
                names = [layer.name for layer in self.layers]
                raise ValueError(f"`layers` pattern {pattern!r} matches no BNP layer; layers are {names}")
            chosen |= matched
        return frozenset(chosen)

    def moments_of(
        self,
        layer: ManagedLayer,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        h: Tensor,
        output: Any,
    ) -> Moments | None:
        """The moments of one call under a token mask or of a nested input; ``None`` for the usual case (no mask
        applies, a dense input): the caller reduces it as always."""
        mask = self.mask
        if mask is not None and (self.applies_to is None or layer.name in self.applies_to):
            if h.is_nested:
                raise ValueError(
                    f"BNP layer {layer.name!r} ({type(module).__name__}) got a nested tensor while a token mask of "
                    f"shape {tuple(mask.shape)} is set: a nested tensor holds no padding (its real rows are used "
                    "without a mask); leave this layer out of the mask with `layers`"
                )
            real = layer.kind.token_rows(module, args, kwargs, h, self._real_tokens(mask))
            if real is None:
                raise ValueError(
                    f"BNP layer {layer.name!r} ({type(module).__name__}): the token mask of shape "
                    f"{tuple(mask.shape)} does not fit its input of shape {tuple(h.shape)} (the mask needs the "
                    "input's leading dimensions; a MultiheadAttention's, those of its query, key or value). Pass "
                    "the mask in the layout this layer sees, or leave the layer out with "
                    "`token_mask(mask, layers=...)`"
                )
            return layer.kind.masked_moments(module, h, output, real)
        if h.is_nested:
            return layer.kind.moments(module, _jagged_rows(layer, module, h), output)
        return None
