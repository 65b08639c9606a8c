"""The layers BNP manages: one record per distinct weight, with the transform its latest step applied.

Modules that share a weight (``dec.weight = enc.weight``) are one layer, as one module called twice
is: their forward calls feed one set of statistics and the shared gradient is transformed once.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from lightning_bnp.core.reparametrization import NO_LEAF, weight_leaf
from lightning_bnp.core.selection import layer_name
from lightning_bnp.core.stack import user_stacklevel
from lightning_bnp.core.statistics import Moments, RunningStatistics, statistics_dtype
from lightning_bnp.core.transform import precondition_

if TYPE_CHECKING:
    from lightning_bnp.core.kinds import LayerKind, ModelScan

__all__ = ["NO_LEAF", "BNPWarning", "ManagedLayer", "StepTransform", "make_layers", "weight_leaf"]


class BNPWarning(UserWarning):
    """Raised (once per layer and cause) for managed layers that BNP cannot precondition in a step."""


def _as_is(tensor: Tensor) -> Tensor:
    return tensor


@dataclass
class StepTransform:
    """The factors of M = (1/q²)·P·Pᵀ that one layer used in the latest step (so that other
    vectors, e.g. a weight-decay or Hessian-vector term, can be mapped by the same M)."""

    mu: Tensor | None  # None: no centring block (no bias, or no bias gradient)
    var_t: Tensor
    q2: float
    groups: int
    # a weight- / bias-shaped tensor as the layer's rows (its kind's view: e.g. transposed, or a row block)
    rows: Callable[[Tensor], Tensor] = field(default=_as_is, repr=False)
    bias_rows: Callable[[Tensor], Tensor] = field(default=_as_is, repr=False)
    share: int = 1  # n: the bias is one of n tensors holding one bias (LayerKind.column_block)

    def apply_(self, vec_w: Tensor, vec_b: Tensor | None) -> None:
        """vec ← M·vec in place (``vec_w`` shaped like the weight, ``vec_b`` like the bias); ``vec_b`` is ignored
        (may be None) when there is no centring block."""
        vec_b = self.bias_rows(vec_b) if vec_b is not None and self.mu is not None else None
        precondition_(self.rows(vec_w), vec_b, self.mu, self.var_t, self.q2, self.groups, self.share)


@dataclass
class ManagedLayer:
    name: str
    module: nn.Module
    has_bias: bool  # P has the centring block; statistics are centred
    groups: int
    fan_in: int  # weight[0].numel(): c_in/groups · kernel volume, or in_features
    features: int  # length of μ: in_features, c_in, or c_in · kernel volume (per-column statistics)
    running: RunningStatistics
    kind: LayerKind  # what its input is, which rows of which weight it feeds, how its input is reduced
    moments: Moments | None = None
    transform: StepTransform | None = None  # what the latest step applied
    tied: dict[str, nn.Module] = field(default_factory=dict)  # other modules sharing this weight
    # (weak reference, version) of the gradient the latest step transformed: a second step on it is refused
    transformed_grad: tuple[weakref.ref[Tensor], int] | None = None
    # a forward counted since the last step ran with another tensor than the weight leaf BNP manages (e.g. under
    # torch.func.functional_call): if that leaf then has no gradient, the step names the layer
    foreign_weight: bool = False

    def __getstate__(self) -> dict[str, object]:
        # pickle / deepcopy: the weak reference cannot be copied, and a copy's gradients are other tensors
        return {**self.__dict__, "transformed_grad": None}

    def add_moments(self, part: Moments) -> None:
        """Pool one forward call's moments into the statistics of the next step."""
        self.moments = part if self.moments is None else self.moments.merge(part)

    @property
    def modules(self) -> dict[str, nn.Module]:
        """Every module whose forward feeds this layer's statistics (several when weights are tied)."""
        return {self.name: self.module, **self.tied}

    @property
    def weight(self) -> Tensor:
        """The kind's weight leaf of the module (:func:`~lightning_bnp.core.reparametrization.weight_leaf`), looked
        up at use time, so a parametrization registered after BNP's setup is followed."""
        return self.kind.weight(self.module)

    @property
    def dtype(self) -> torch.dtype:
        """Statistics dtype; follows the model if it is cast after BNP was set up (e.g. "64-true")."""
        return statistics_dtype(self.weight.dtype)

    @property
    def bias(self) -> Tensor | None:
        return self.kind.bias(self.module)

    def rows(self, weight_like: Tensor) -> Tensor:
        """A weight-shaped tensor (e.g. the gradient) as this layer's (out, …) rows: a view."""
        return self.kind.rows(self.module, weight_like)

    def bias_rows(self, bias_like: Tensor) -> Tensor:
        return self.kind.bias_rows(self.module, bias_like)


def make_layers(
    scan: ModelScan,
    selected: dict[str, tuple[nn.Module, LayerKind]],
    *,
    rho: float,
    bias_correction: bool,
    conv_statistics: str = "channel",
    decay_offset: float = 0.0,
) -> dict[str, ManagedLayer]:
    """One :class:`ManagedLayer` per distinct (weight, kind) of the ``selected`` modules of the ``scan``
    (:func:`~lightning_bnp.core.model_scan.scan_model`): modules sharing a weight are one layer (pooled like one
    module called twice). ``conv_statistics="column"``: convolutions keep one statistic per im2col column (input
    channel, kernel offset) instead of one per input channel.

    Raises:
        ValueError: two modules share a weight but not their bias (P couples a weight with its bias), two
            modules of different kinds share a weight (its gradient would be transformed twice, e.g. a tied
            embedding and output layer), or a kind refuses a module's form (:meth:`LayerKind.refuse`).

    Warns:
        BNPWarning: a managed layer's trainable weight is also a parameter of a module BNP does not manage (the
            shared gradient holds that module's contribution; P only sees the managed layer's inputs). A frozen
            weight (``requires_grad=False``) has no gradient and is not warned about.
    """
    layers: dict[tuple[int, str], ManagedLayer] = {}
    for name, (module, kind) in selected.items():
        kind = kind.configure(conv_statistics=conv_statistics)
        refused = kind.refuse(module)
        if refused is not None:
            raise ValueError(f"BNP layer {name!r} ({type(module).__name__}): {refused}")
        key = (id(kind.weight(module)), kind.name)
        if key not in layers:
            layers[key] = _make_layer(name, module, kind, rho, bias_correction, decay_offset)
            continue
        layer = layers[key]
        if kind.bias(module) is not layer.bias:
            raise ValueError(
                f"layers {layer.name!r} and {name!r} share one weight but not their bias; BNP's P couples "
                "a weight with its bias (eq. 15), so a shared weight needs a shared bias (or none). "
                f"Exclude one of them with `exclude`, e.g. exclude=[{name!r}]."
            )
        layer.tied[name] = module
    fed: dict[int, ManagedLayer] = {}
    for layer in layers.values():  # one weight fed by several kinds: only as row blocks of one module (q, k, v)
        other = fed.setdefault(id(layer.weight), layer)
        if other.module is not layer.module:
            raise ValueError(
                f"layers {other.name!r} ({other.kind.name}) and {layer.name!r} ({layer.kind.name}) share one weight "
                "but are different kinds of layer (e.g. an embedding tied to the output layer): BNP would transform "
                "the shared gradient twice, with two different P. Manage one of them: "
                f"exclude=[{layer.name!r}] or exclude=[{other.name!r}]"
                + (" (or embeddings=False)." if "Embedding" in (layer.kind.name, other.kind.name) else ".")
            )
    managed = {id(layer.weight): layer.name for layer in layers.values()}
    modules = {id(m) for layer in layers.values() for m in layer.modules.values()}
    names = {name for layer in layers.values() for name in layer.modules}
    for name, module in scan.modules.items():  # any other module holding a managed weight (e.g. a tied embedding)
        if id(module) in modules or isinstance(module, parametrize.ParametrizationList):
            continue
        if any(layer_name(parent, kind.suffix) in names for parent, kind in scan.claims.get(id(module), ())):
            continue  # a managed layer's kind feeds it in its place (an attention's out_proj)
        for parameter in module._parameters.values():
            owner = managed.get(id(parameter))
            # a frozen weight (e.g. GPT-2's tied lm_head / wte under LoRA) has no gradient to share
            if owner is not None and parameter is not None and parameter.requires_grad:
                warnings.warn(
                    f"BNP layer {owner!r} shares its weight with {name!r} ({type(module).__name__}), which BNP does "
                    f"not manage: the shared gradient includes {name!r}'s contribution but P is built from "
                    f"{owner!r}'s inputs only. Manage both (they are then pooled as one layer) or exclude both "
                    f"(exclude={[owner]!r} when {name!r} is of a type BNP does not know).",
                    BNPWarning,
                    stacklevel=user_stacklevel(),
                )
    return {layer.name: layer for layer in layers.values()}


def _make_layer(
    name: str, module: nn.Module, kind: LayerKind, rho: float, bias_correction: bool, decay_offset: float
) -> ManagedLayer:
    weight = kind.weight(module)  # shape and dtype only
    features = kind.features(module)
    dtype = statistics_dtype(weight.dtype)
    running = RunningStatistics(
        features, rho=rho, bias_correction=bias_correction, device=weight.device, dtype=dtype, decay_offset=decay_offset
    )
    has_bias = kind.bias(module) is not None
    return ManagedLayer(name, module, has_bias, kind.groups(module), kind.fan_in(module), features, running, kind)


_Layer = ManagedLayer  # the name pickles made before it was public refer to
