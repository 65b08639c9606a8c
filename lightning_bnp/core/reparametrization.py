"""Which trainable tensors stand for a layer's weight and bias when torch reparametrizes them.

BNP's transform (eq. 15/23) maps the gradient of a layer's (W, b). When torch computes ``weight`` or
``bias`` from other tensors, the optimizer updates those tensors instead, and BNP needs one rule for
each way torch does it (README "Reparametrized layers"):

* ``torch.nn.utils.prune`` and Lightning's ``ModelPruning`` (W = W_orig ⊙ mask, b = b_orig ⊙ m):
  the leaves ``weight_orig`` / ``bias_orig`` (the optimizer's own tensors, the same objects as the
  ``weight`` / ``bias`` before pruning) are preconditioned as the layer's (W, b): exactly
  g ← (1/q²)·P·Pᵀ·g on the leaves' gradients (G_w ⊙ mask, G_b ⊙ m), centred when the layer has a bias.
  Masked entries get a nonzero update but the mask hides it from the output, as it hides momentum's.
* this package's Equilibration (``WeightConditioning``): the leaf ``parametrizations.weight.original``
  (the documented composition: BNP preconditions the free parameter's gradient; README "Weight
  Conditioning"). A parametrization says so itself, with a class attribute ``bnp_follows_original = True``
  (:data:`FOLLOWS_ORIGINAL`): this module knows no feature's class.
* every other reparametrization — ``torch.nn.utils.parametrize`` with anything else on ``weight``
  or ``bias`` (``parametrizations.weight_norm``, ``spectral_norm``, ``orthogonal``, user ones), the
  legacy hook-based ``torch.nn.utils.weight_norm`` / ``spectral_norm``, a ``weight`` that is not a
  parameter: the optimizer's gradient is J_fᵀ·∂L/∂W for some f, for which eq. 15 has no exact form,
  so the layer is left alone with a :class:`BNPWarning` naming it and the reason (at construction;
  or at the first step after the change, for a layer reparametrized after BNP was set up).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy
from torch.nn.utils import parametrize, prune
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from lightning_bnp.core.stack import user_stacklevel

__all__ = [
    "FOLLOWS_ORIGINAL",
    "NO_LEAF",
    "bias_leaf",
    "describe",
    "lazy_names",
    "manageable",
    "tensor_leaf",
    "unsupported",
    "weight_leaf",
]

#: the class attribute by which a parametrization of ``weight`` declares that BNP preconditions its free
#: parameter ``parametrizations.weight.original`` as the layer's weight (``Equilibration`` sets it True)
FOLLOWS_ORIGINAL = "bnp_follows_original"

# what `weight_leaf` gives for a layer BNP leaves alone: no gradient, not trainable, in no optimizer,
# so the forward hook records nothing and the step skips it (``preconditioner`` names it once)
NO_LEAF = torch.empty(0)


def _pruned(module: nn.Module, name: str) -> bool:
    return any(
        isinstance(hook, prune.BasePruningMethod) and hook._tensor_name == name
        for hook in module._forward_pre_hooks.values()
    )


def _legacy_hook(module: nn.Module, name: str) -> str | None:
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, WeightNorm) and hook.name == name:
            return f"torch.nn.utils.weight_norm (legacy hook: {name} = g·v/‖v‖ from {name}_g and {name}_v)"
        if isinstance(hook, SpectralNorm) and hook.name == name:
            return f"torch.nn.utils.spectral_norm (legacy hook: {name} = {name}_orig/σ({name}_orig))"
    return None


def _chain(module: nn.Module, name: str) -> parametrize.ParametrizationList:
    return module.parametrizations[name]  # type: ignore[index, return-value]


def _followed(module: nn.Module, name: str) -> bool:
    """Whether every parametrization of ``module.<name>`` declares :data:`FOLLOWS_ORIGINAL` (``weight`` only)."""
    return name == "weight" and all(getattr(p, FOLLOWS_ORIGINAL, False) is True for p in _chain(module, name))


def describe(module: nn.Module, name: str) -> str | None:
    """How ``module.<name>`` is reparametrized, in words (None: a plain parameter, or no such tensor)."""
    if parametrize.is_parametrized(module, name):
        chain = _chain(module, name)
        kinds = ", ".join(type(p).__name__ for p in chain)
        originals = ", ".join(f"parametrizations.{name}.{n}" for n, _ in chain.named_parameters(recurse=False))
        return f"computed by torch.nn.utils.parametrize ({kinds}) from {originals}"
    if name in module._parameters:
        return None  # a parameter (or None: no bias)
    legacy = _legacy_hook(module, name)
    if legacy is not None:
        return f"computed by {legacy}"
    if _pruned(module, name) and isinstance(module._parameters.get(f"{name}_orig"), Tensor):
        return f"pruned by torch.nn.utils.prune ({name} = {name}_orig · {name}_mask)"
    if not isinstance(getattr(module, name, None), Tensor):
        return None  # no such tensor: absent, None (no bias) or not a tensor at all (nn.LSTM's `bias` flag)
    return "not a parameter of the module (a tensor set or computed outside it)"


def _why(module: nn.Module, name: str) -> str | None:
    """Why BNP cannot precondition ``module.<name>`` (None: a plain parameter, pruned, equilibrated, or absent)."""
    description = describe(module, name)
    if description is None or description.startswith("pruned"):
        return None
    if parametrize.is_parametrized(module, name) and _followed(module, name):
        return None
    if description.startswith("not a parameter"):
        return f"its {name} is {description}, so its gradient is not the one an optimizer uses"
    return (
        f"its {name} is {description}; the optimizer updates those tensors, whose gradient is Jᵀ·∂L/∂{name}, "
        "for which BNP's transform (eq. 15) has no exact form"
    )


def unsupported(module: nn.Module, weight_name: str = "weight", bias_name: str | None = "bias") -> str | None:
    """Why BNP leaves ``module`` alone (its weight or bias, the tensors its layer kind names ``weight_name`` and
    ``bias_name``, is reparametrized in a way eq. 15 cannot follow exactly), or None when both have leaves BNP
    preconditions (or are absent). A kind's own names: the bias of a kind with ``bias_name="b"`` is ``b``, whatever
    the module's ``bias`` attribute is (:meth:`~lightning_bnp.core.kinds.LayerKind.reparametrized`)."""
    return _why(module, weight_name) or (_why(module, bias_name) if bias_name is not None else None)


def weight_leaf(module: nn.Module) -> Tensor:
    """The trainable tensor BNP preconditions as the layer's weight (the module docstring's rule): ``weight``, or
    under a reparametrization the leaf that stands for it (``weight_orig`` when pruned,
    ``parametrizations.weight.original`` under Weight Conditioning); :data:`NO_LEAF` for a layer it leaves alone."""
    # the fields nn.Module keeps, read directly: this runs for every layer every step, and ``module.weight`` goes
    # through nn.Module.__getattr__ (issue 16)
    weight = module._parameters.get("weight")
    if weight is not None and "parametrizations" not in module._modules:
        return weight
    if unsupported(module) is not None:
        return NO_LEAF
    if parametrize.is_parametrized(module, "weight"):
        return _chain(module, "weight").original
    weight = module._parameters.get("weight")
    if weight is None and _pruned(module, "weight"):
        weight = module._parameters.get("weight_orig")
    return weight if weight is not None else NO_LEAF


def tensor_leaf(module: nn.Module, name: str) -> Tensor:
    """The trainable tensor that stands for ``module.<name>``: :func:`weight_leaf` for ``weight``; for another name
    ``parametrizations.<name>.original`` under ``torch.nn.utils.parametrize``, else the attribute itself."""
    if name == "weight":
        return weight_leaf(module)
    parametrizations = module._modules.get("parametrizations")
    if isinstance(parametrizations, nn.ModuleDict) and name in parametrizations:
        return parametrizations[name].original  # type: ignore[return-value]
    return getattr(module, name)


def bias_leaf(module: nn.Module) -> Tensor | None:
    """The trainable tensor BNP preconditions as the layer's bias: ``bias``, or ``bias_orig`` when pruned;
    None without a bias (or for a layer it leaves alone)."""
    parameters = module._parameters
    if "bias" in parameters:
        return parameters["bias"]
    if _pruned(module, "bias"):
        return parameters.get("bias_orig")
    return None


def lazy_names(modules: dict[str, nn.Module]) -> list[str]:
    """The names of the modules whose weight or bias is still an uninitialised lazy parameter."""
    return [
        name
        for name, module in modules.items()
        if any(is_lazy(p) for p in module._parameters.values() if p is not None)
    ]


def manageable(
    selected: dict[str, nn.Module], category: type[Warning], reasons: Mapping[str, str | None] | None = None
) -> dict[str, nn.Module]:
    """``selected`` without the layers BNP leaves alone, each named once in a ``category`` warning: those with a
    reason in ``reasons`` (by layer name: their kinds' :meth:`~lightning_bnp.core.kinds.LayerKind.reparametrized`),
    or when ``reasons`` is None, whose ``weight`` or ``bias`` is one BNP does not follow (:func:`unsupported`).

    Raises:
        ValueError: a layer is an uninitialised lazy module (its shapes are unknown until a forward), or no
            layer is left.
    """
    lazy = lazy_names(selected)
    if lazy:
        raise ValueError(
            f"layers {lazy} are uninitialised lazy modules (e.g. nn.LazyLinear): BNP sizes its statistics from "
            "the weight's shape, which is known only after a first forward pass. Run one forward first "
            "(`model(example_input)`; the Lightning callback does it with `example_input_array`), or exclude "
            f"them with `exclude`, e.g. exclude={lazy!r}."
        )
    kept = {}
    for name, module in selected.items():
        reason = unsupported(module) if reasons is None else reasons.get(name)
        if reason is None:
            kept[name] = module
            continue
        warnings.warn(
            f"BNP layer {name!r} ({type(module).__name__}) is left alone: {reason}. Exclude it with `exclude` "
            "to silence this warning (README 'Reparametrized layers').",
            category,
            stacklevel=user_stacklevel(),
        )
    if not kept:
        raise ValueError(
            f"no layer is left for BNP: every selected layer ({sorted(selected)}) is reparametrized in a way BNP "
            "cannot precondition (the warnings name the reason for each)"
        )
    return kept
