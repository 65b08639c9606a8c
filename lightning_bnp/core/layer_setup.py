"""What BNP manages in a model, found once at construction: the layers the selection keeps (the model scanned once
for kinds and claims), those BNP can follow in their current form, the layer records made for them, and the coverage
report of every weight matrix it leaves alone."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lightning_bnp.core.coverage import Coverage, coverage
from lightning_bnp.core.kinds import EMBEDDING, select_layer_kinds
from lightning_bnp.core.layers import BNPWarning, ManagedLayer, make_layers
from lightning_bnp.core.model_scan import scan_model
from lightning_bnp.core.reparametrization import manageable

__all__ = ["manage_layers"]


def manage_layers(
    model: nn.Module,
    layer_types: Sequence[str],
    include: list[str] | None,
    exclude: list[str] | None,
    *,
    embeddings: bool,
    rho: float,
    bias_correction: bool,
    conv_statistics: str,
    decay_offset: float,
) -> tuple[dict[str, ManagedLayer], Coverage]:
    """The managed layers of ``model`` by name and the :class:`~lightning_bnp.core.coverage.Coverage` of the rest,
    for validated ``layer_types``, ``include`` and ``exclude`` (``embeddings`` adds the ``"Embedding"`` kind).

    Raises:
        ValueError: as :class:`~lightning_bnp.core.preconditioner.BNPPreconditioner` (patterns, shared weights,
            refused forms, nothing left); each reparametrized layer BNP cannot follow gets a ``BNPWarning``.
    """
    if embeddings and EMBEDDING not in layer_types:
        layer_types = [*layer_types, EMBEDDING]
    scan = scan_model(model, layer_types)  # the model read once: kinds and claims, for all three below
    chosen = select_layer_kinds(scan, include, exclude)
    reasons = {name: kind.reparametrized(module) for name, (module, kind) in chosen.items()}  # by the kinds' names
    kept = manageable({name: module for name, (module, _) in chosen.items()}, BNPWarning, reasons)
    layers = make_layers(
        scan,
        {name: chosen[name] for name in kept},
        rho=rho,
        bias_correction=bias_correction,
        conv_statistics=conv_statistics,
        decay_offset=decay_offset,
    )
    return layers, coverage(scan, list(layers.values()), include, exclude)
