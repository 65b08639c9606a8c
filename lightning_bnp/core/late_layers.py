"""Layers that appear after BNP was set up: named when an optimizer BNP steps holds their parameters.

BNP finds its layers once, at construction (:func:`~lightning_bnp.core.layer_setup.manage_layers`). A layer made
later — an adapter injected after set-up, a layer created mid-training and given to the optimizer with
``add_param_group`` — has no forward hook and no statistics, and its gradient would get the plain optimizer step. So
at each :meth:`~lightning_bnp.core.preconditioner.BNPPreconditioner.step` given an optimizer, the number of parameters
it holds is compared with the last one seen for it (one ``len`` per step); when it changed, or the optimizer is new,
the parameters the model did not hold at construction are looked up (identity only, no tensor value) and the layers
BNP would have managed among them are named in a :class:`~lightning_bnp.core.layers.BNPWarning`, once each; so are
the managed layers set up without a bias whose bias is among them (registered later: it would get the plain step, and
the weight keeps the bias-free transform).
A copy of the preconditioner (pickle, deepcopy) does not look: it does not know its copied model.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_bnp.core.kinds import EMBEDDING, select_layer_kinds
from lightning_bnp.core.layers import ManagedLayer
from lightning_bnp.core.model_scan import scan_model
from lightning_bnp.core.step_warnings import StepWarnings

__all__ = ["LATE_BIASES", "LATE_LAYERS", "LateLayers"]

LATE_LAYERS = (
    "BNP does not manage the layers {layers}: they did not exist when it was set up, and optimizer {optimizer} now "
    "holds their parameters, so their gradients get the plain optimizer step. Build every layer before BNP is set "
    "up (the BatchNormPreconditioning callback sets up at `on_fit_start`, after the LightningModule's `setup` and "
    "`configure_model`; a BNPPreconditioner at its construction), or precondition them with a second "
    "BNPPreconditioner(model, include={include}) stepped beside this one."
)
LATE_BIASES = (
    "BNP layers {layers} were set up without a bias, and optimizer {optimizer} now holds a bias registered on them "
    "since: it gets the plain optimizer step, and their weights keep the transform of a layer without bias (eq. 15 "
    "without its centring). Register the bias before BNP is set up, or build a new BNPPreconditioner for the model "
    "as it is now."
)


class LateLayers:
    """The parameters ``model`` held at construction, and the count each stepped optimizer held when last seen.

    Args:
        model: the model BNP was built on (weakly referenced).
        layer_types, include, exclude, embeddings: the preconditioner's selection (validated).
        warnings: where the warning goes.
        layers: the managed layers (those set up without a bias are watched for one registered later).
    """

    def __init__(
        self,
        model: nn.Module,
        layer_types: Sequence[str],
        include: list[str] | None,
        exclude: list[str] | None,
        warnings: StepWarnings,
        *,
        embeddings: bool = False,
        layers: Sequence[ManagedLayer] = (),
    ) -> None:
        self.model: weakref.ref[nn.Module] | None = weakref.ref(model)
        self.bias_free = [layer for layer in layers if not layer.has_bias]
        types = [*layer_types, EMBEDDING] if embeddings and EMBEDDING not in layer_types else list(layer_types)
        self.selection = (types, include, exclude)
        self.warnings = warnings
        self.known: dict[int, weakref.ref[Tensor]] = {id(p): weakref.ref(p) for p in model.parameters()}
        self.counts: weakref.WeakKeyDictionary[Optimizer, int] = weakref.WeakKeyDictionary()

    def __getstate__(self) -> dict[str, Any]:
        # weak references do not copy, and a copy's model is another one: a copy does not look
        return {**self.__dict__, "model": None, "known": {}, "counts": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({**state, "counts": weakref.WeakKeyDictionary()})

    def check(self, optimizer: Optimizer, params: list[Tensor]) -> None:
        """Name the layers BNP would manage whose parameters ``optimizer`` (the ``torch.optim.Optimizer`` itself:
        :func:`~lightning_bnp.core.pending.unwrap_optimizer`) holds but the model did not hold at construction;
        ``params``: the optimizer's parameters."""
        if self.model is None:
            return
        if self.counts.get(optimizer) == len(params):
            return
        self.counts[optimizer] = len(params)
        new = [p for p in params if (ref := self.known.get(id(p))) is None or ref() is not p]
        if not new:
            return
        self.known.update((id(p), weakref.ref(p)) for p in new)  # each named once
        model = self.model()
        if model is None:
            return
        ids = {id(p) for p in new}
        self._name_late_biases(optimizer, ids)
        layer_types, include, exclude = self.selection
        try:
            chosen = select_layer_kinds(scan_model(model, layer_types), include, exclude)
        except ValueError:  # (a pattern that matches nothing now: the layers are not BNP's to name)
            return
        late = {
            name: type(module).__name__ for name, (module, kind) in chosen.items() if id(kind.weight(module)) in ids
        }
        if late:
            listed = ", ".join(f"{name!r} ({kind})" for name, kind in late.items())
            message = LATE_LAYERS.format(layers=listed, optimizer=type(optimizer).__name__, include=list(late))
            self.warnings.warn_once(f"late {sorted(late)}", message)

    def _name_late_biases(self, optimizer: Optimizer, ids: set[int]) -> None:
        """Name the managed layers set up without a bias whose bias (registered since) is among ``ids``."""
        late = [layer.name for layer in self.bias_free if id(layer.kind.bias(layer.module)) in ids]
        if late:
            message = LATE_BIASES.format(layers=late, optimizer=type(optimizer).__name__)
            self.warnings.warn_once(f"late biases {late}", message)
