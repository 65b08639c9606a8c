"""One pass over a model that finds, for BNP, which layer kinds apply to each module and which modules a parent's
kind claims (the one home of that rule: the selection, the layers and the coverage report all read its result).

:func:`scan_model` reads every module once: its registered kinds (:func:`kinds_of`), those ``layer_types`` selects
(:func:`kinds_for`) and, where ``layer_types`` selects linear layers, the ``F.linear`` kinds read from the source of
its class's ``forward`` (:func:`~lightning_bnp.core.attention.inferred_functional_linears`); then which modules a
kind feeds in their place (:meth:`~lightning_bnp.core.kinds.LayerKind.claims`).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lightning_bnp.core.attention import inferred_functional_linears
from lightning_bnp.core.kinds import LINEAR_FAMILY, LayerKind, ModelScan, layer_kinds

__all__ = ["kinds_for", "kinds_of", "scan_model"]


def scan_model(model: nn.Module, layer_types: Sequence[str]) -> ModelScan:
    """What ``model`` holds for BNP under ``layer_types`` (validated: every name a registered kind, e.g. by
    :func:`~lightning_bnp.core.preconditioner.validate_bnp_arguments`); see :class:`~lightning_bnp.core.kinds.
    ModelScan`. A module claimed by a registered kind is not claimed again by a kind read from a source."""
    selected = kinds_for(layer_types)
    # the selected kinds first: of two kinds for one class and suffix, the selected one applies (a user's kind for
    # nn.Linear selected alone is not shadowed by the built-in one); of two selected, the one registered first
    known = selected + [kind for kind in layer_kinds().values() if kind not in selected]
    modules = dict(model.named_modules())
    applicable = {name: kinds_of(m, known) for name, m in modules.items()}
    kinds = {name: [k for k in found if k in selected] for name, found in applicable.items()}
    claims: dict[int, list[tuple[str, LayerKind]]] = {}

    def claim(name: str, module: nn.Module, found: Sequence[LayerKind]) -> None:
        for kind in found:
            for claimed in kind.claims(module):
                claims.setdefault(id(claimed), []).append((name, kind))

    for name, m in modules.items():
        claim(name, m, kinds[name])
    if LINEAR_FAMILY in layer_types:  # a Linear an unknown parent uses through F.linear (read from its source)
        registered = frozenset(claims)
        for name, m in modules.items():
            inferred = inferred_functional_linears(m, registered)
            kinds[name].extend(inferred)
            claim(name, m, inferred)
    return ModelScan(
        model,
        tuple(layer_types),
        tuple(selected),
        tuple(known),
        modules,
        applicable,
        kinds,
        {key: tuple(value) for key, value in claims.items()},
    )


def kinds_for(layer_types: Sequence[str]) -> list[LayerKind]:
    """The registered kinds ``layer_types`` selects: those it names, and those whose family it names."""
    wanted = set(layer_types)
    return [kind for name, kind in layer_kinds().items() if name in wanted or kind.family in wanted]


def kinds_of(module: nn.Module, kinds: Sequence[LayerKind]) -> list[LayerKind]:
    """The kinds among ``kinds`` that apply to ``module``: per :attr:`~LayerKind.suffix`, the one whose class is
    the most specific (first in the module's MRO), e.g. a user's kind for a subclass of ``nn.Linear``, and of equally
    specific ones the first in ``kinds``; of those, the ones whose rows the module holds in its form
    (:meth:`~LayerKind.present`: a bidirectional layer's reverse)."""
    mro = type(module).__mro__
    best: dict[str, tuple[int, LayerKind]] = {}
    for kind in kinds:
        depth = min((mro.index(t) for t in kind.module_types() if t in mro), default=None)
        if depth is not None and (kind.suffix not in best or depth < best[kind.suffix][0]):
            best[kind.suffix] = (depth, kind)
    return [kind for _, kind in best.values() if kind.present(module)]
