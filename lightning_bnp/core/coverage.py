"""What BNP leaves alone: every weight matrix of a model that it will not transform, with the reason.

A weight matrix is a parameter with two or more dimensions. :func:`coverage` sorts each one of a model into
*transformed* (a managed layer's trainable weight whose gradient BNP preconditions) or *skipped*, with a
reason a user can act on: a layer type BNP does not know (naming the module class; teach it with
:func:`~lightning_bnp.core.kinds.register_layer_kind`), a type left out of ``layer_types``, a name that
``include``/``exclude`` dropped (also some row blocks of a packed weight), a frozen weight, a parametrization
BNP does not follow, an embedding left out (``embeddings=False``) or a positional parameter. A parameter of ≥ 3
dimensions with at most one above 1 that no kind feeds (ConvNeXt's ``layer_scale``, (C, 1, 1)) is an elementwise
scale, named as such and not counted among the weight matrices. A Linear whose
parent calls ``F.linear`` with its weight is transformed when its parent is known
(:mod:`lightning_bnp.core.attention`) or its parent's ``forward`` source shows it
(:func:`~lightning_bnp.core.attention.inferred_functional_linears`); where neither can be seen before a forward
runs, the first step warns naming the layer. Which kinds apply to a module and which modules a parent claims come
from the one scan of the model (:func:`~lightning_bnp.core.model_scan.scan_model`) that also selected the layers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING

from torch import nn
from torch.nn.utils import parametrize

from lightning_bnp.core.kinds import LayerKind, ModelScan
from lightning_bnp.core.model_scan import kinds_of
from lightning_bnp.core.selection import layer_name, module_name

if TYPE_CHECKING:
    from lightning_bnp.core.layers import ManagedLayer

__all__ = ["Coverage", "coverage"]

# a parameter of ≥ 3 dimensions of which at most one is above 1, that no kind feeds (torchvision ConvNeXt's
# `layer_scale`, (C, 1, 1)): a vector shaped to broadcast, which no layer multiplies as a matrix; not counted
ELEMENTWISE = "elementwise scale or shift"
NOT_A_MATRIX = "not a layer's weight matrix (one dimension above 1), left to the optimizer"


@dataclass(frozen=True)
class Coverage:
    """Which weight matrices (parameters with ≥ 2 dimensions) BNP transforms, and why it skips the others.

    Attributes:
        transformed: parameter names (``named_parameters()``) of the trainable weights BNP transforms.
        skipped: parameter name → reason, for every other weight matrix (trainable ones first, then frozen), and
            for each parameter of ≥ 2 dimensions that is no weight matrix (an elementwise scale: one dimension
            above 1).
        trainable: how many weight matrices of the model are trainable (elementwise scales not counted).
    """

    transformed: tuple[str, ...]
    skipped: dict[str, str] = field(default_factory=dict)
    trainable: int = 0

    def summary(self, limit: int = 5) -> str:
        """One sentence: how many trainable weight matrices BNP transforms, and the first ``limit`` skipped ones
        with their reasons, then a count."""
        head = f"BNP transforms {len(self.transformed)} of the model's {self.trainable} trainable weight matrices"
        if not self.skipped:
            return head
        items = [f"{name} ({reason})" for name, reason in list(self.skipped.items())[:limit]]
        more = len(self.skipped) - len(items)
        return f"{head}; it leaves alone {'; '.join(items)}" + (f"; and {more} more" if more else "")


def coverage(
    scan: ModelScan,
    layers: Sequence[ManagedLayer],
    include: Sequence[str] | None,
    exclude: Sequence[str] | None,
) -> Coverage:
    """Sort every weight matrix of the scanned model into transformed or skipped (see the module docstring), by
    the kinds and claims of its ``scan`` (:func:`~lightning_bnp.core.model_scan.scan_model`)."""
    managed = {id(layer.weight): layer for layer in layers}
    transformed: list[str] = []
    trainable: dict[str, str] = {}
    frozen: dict[str, str] = {}
    vectors = 0  # trainable elementwise scales: named, not counted as weight matrices
    for name, p in scan.model.named_parameters():
        if p.dim() < 2:
            continue
        layer = managed.get(id(p))
        missing = _missing_blocks(p, layer, layers, scan.known) if layer is not None else []
        if missing:  # some row blocks of a packed weight (e.g. q, k, v of in_proj_weight) are not managed
            reason = _missing_reason(missing, scan.selected_kinds)
            (trainable if p.requires_grad else frozen)[name] = reason if p.requires_grad else f"frozen; {reason}"
            continue
        if layer is not None:
            if p.requires_grad:
                transformed.append(name)
            else:
                frozen[name] = "frozen (requires_grad=False); transformed once it trains"
            continue
        reason = _reason(name, p, scan, include, exclude)
        (trainable if p.requires_grad else frozen)[name] = reason if p.requires_grad else f"frozen; {reason}"
        vectors += p.requires_grad and reason.startswith(ELEMENTWISE)
    count = len(transformed) + len(trainable) - vectors
    return Coverage(tuple(transformed), {**trainable, **frozen}, count)


def _reason(
    name: str,
    parameter: nn.Parameter,
    scan: ModelScan,
    include: Sequence[str] | None,
    exclude: Sequence[str] | None,
) -> str:
    owner_name, _, attr = name.rpartition(".")
    parametrized = _parametrized_tensor(name, scan.modules)
    if parametrized is not None:  # <module>.parametrizations.<tensor>.original…: the module's <tensor>
        owner_name, attr = parametrized
    owner = scan.modules.get(owner_name)
    if owner is None:
        return "not held by a module BNP can find"
    kinds, selected_kinds = scan.applicable[owner_name], scan.selected_kinds
    # by the names of the tensors its kinds feed: a module no kind applies to is a layer type BNP does not know,
    # whatever its `weight` or `bias` attribute is (nn.LSTM's `bias` is a flag)
    why = next((w for k in kinds if (w := k.reparametrized(owner)) is not None), None)
    if why is not None:  # README "Reparametrized layers"
        return f"left alone: {why}"
    cls = parametrize.type_before_parametrizations(owner)  # a `ParametrizedLinear` is named Linear
    if isinstance(owner, nn.Embedding) and not any(k in selected_kinds for k in kinds):
        return "embedding (embeddings=False)"
    if isinstance(owner, nn.EmbeddingBag):
        return f"embedding ({cls.__name__}: not a layer kind BNP manages)"
    feeding = [k for k in kinds if _weight_of(k, owner) is parameter]
    fed = bool(feeding)
    # a kind of its type may say why it feeds no kind in this form (core/recurrent.py: a multi-layer module's weights)
    typed = (k for k in scan.known if isinstance(owner, k.module_types())) if not fed else ()
    why = next((w for k in typed if (w := k.left_alone(owner, attr)) is not None), None)
    if why is not None:
        return why
    if not fed and any(word in attr.lower() for word in ("pos", "embed", "token")):
        return f"embedding / positional parameter {attr!r} of {cls.__name__}"
    if not fed and parameter.dim() > 2 and sum(size > 1 for size in parameter.shape) <= 1:
        return f"{ELEMENTWISE} of {cls.__name__}, shape {tuple(parameter.shape)}: {NOT_A_MATRIX}"
    if not kinds:
        return f"unknown layer type {cls.__module__}.{cls.__qualname__} (teach BNP with register_layer_kind)"
    # judged by the kinds that feed it (an attention's packed q, k, v can be left out of `layer_types` while its
    # out_proj's is in), and under the names `select_layer_kinds` matches: its module's name and its selected kinds'
    # layer names (`attn.q`); a module that a parent's selected kind feeds in its place, under the parent's names
    # only (ModelScan.claims: also where it is reached first under another name, a module shared elsewhere)
    claimers = scan.claimer_names(owner)
    deciding = feeding or kinds
    selectable = [k for k in deciding if k in selected_kinds]
    if not selectable and not claimers:
        return f"layer type {deciding[0].name!r} is not in `layer_types`"
    if not fed:
        return f"a parameter of its {cls.__name__} layer that no layer kind feeds"
    names = claimers or (owner_name, *(layer_name(owner_name, k.suffix) for k in selectable))
    if include is not None and not any(fnmatchcase(n, p) for n in names for p in include):
        return f"not matched by `include` {list(include)}"
    matched = [p for p in exclude or () if any(fnmatchcase(n, p) for n in names)]
    if matched:
        return f"excluded by `exclude` pattern {matched[0]!r}"
    return "reparametrized (torch.nn.utils.parametrize) in a form BNP does not follow"


def _parametrized_tensor(name: str, modules: Mapping[str, nn.Module]) -> tuple[str, str] | None:
    """``(module, tensor)`` for a parameter ``<module>.parametrizations.<tensor>.…`` of torch.nn.utils.parametrize
    (the original, or a parametrization's own parameter: it shapes that tensor), by the outermost parametrized
    module on its path; None for any other parameter (a module merely named ``parametrizations`` is not one)."""
    dotted, marker, start = f".{name}", ".parametrizations.", 0
    while (found := dotted.find(marker, start)) >= 0:
        prefix, tensor = dotted[1:found], dotted[found + len(marker) :].partition(".")[0]
        held = getattr(modules.get(prefix), "parametrizations", None)
        if isinstance(held, nn.ModuleDict) and isinstance(held._modules.get(tensor), parametrize.ParametrizationList):
            return prefix, tensor
        start = found + 1
    return None


def _weight_of(kind: LayerKind, module: nn.Module) -> object:
    try:
        return kind.weight(module)
    except (AttributeError, KeyError):  # e.g. a kind's weight absent in this form of the module
        return None


def _missing_reason(missing: list[tuple[str, LayerKind]], selected: Sequence[LayerKind]) -> str:
    """Why the row blocks ``missing`` (layer name, kind) of a packed weight are not transformed: their kinds left out
    of ``layer_types``, or their layers dropped by ``include``/``exclude``."""
    unselected = [name for name, kind in missing if kind not in selected]
    dropped = [name for name, kind in missing if kind in selected]
    parts = [f"row blocks {unselected} of it not in `layer_types`"] if unselected else []
    parts += [f"row blocks {dropped} of it dropped by `include`/`exclude`"] if dropped else []
    return "; ".join([*parts, "the others are transformed"])


def _missing_blocks(
    p: object, layer: ManagedLayer, layers: Sequence[ManagedLayer], known: Sequence[LayerKind]
) -> list[tuple[str, LayerKind]]:
    """The layers (name, kind) that would feed other row blocks of ``p`` (several kinds on one module) and are not
    managed."""
    if not layer.kind.suffix:
        return []
    feeding = {(id(m), other.kind.name) for other in layers if other.weight is p for m in other.modules.values()}
    module = layer.module
    expected = [k for k in kinds_of(module, known) if _weight_of(k, module) is p]
    owner = module_name(layer.name, layer.kind.suffix)
    return [(layer_name(owner, k.suffix), k) for k in expected if (id(module), k.name) not in feeding]
