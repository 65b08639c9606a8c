"""A preconditioner's checkpoint state: the running statistics of every managed layer by name, the kind and weight
shape of each layer, and the settings that shaped them. Loading is all or nothing: it checks first that every saved
layer fits (names, kinds, lengths, finite values), then loads them, and says what changed."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from lightning_bnp.core.layers import BNPWarning, ManagedLayer
from lightning_bnp.core.stack import user_stacklevel

__all__ = ["SAVED_SETTINGS", "hyperparameters", "load_state_dict", "saved_settings", "state_dict"]

# the settings of a preconditioner that shape the running statistics and P (saved as its hyperparameters)
SAVED_SETTINGS = ("rho", "eps1", "eps2", "statistics", "bias_correction", "conv_statistics")


def saved_settings(preconditioner: Any) -> dict[str, Any]:
    """The :data:`SAVED_SETTINGS` of ``preconditioner`` (its attributes of those names), by name."""
    return {name: getattr(preconditioner, name) for name in SAVED_SETTINGS}


def hyperparameters(layers: dict[str, ManagedLayer], settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` (ρ, ε1, ε2, statistics, bias correction, conv statistics) that shape the running statistics
    and P of ``layers``; ``conv_statistics`` only when a layer's kind has that option (it shapes nothing else)."""
    chosen = {k: v for k, v in settings.items() if k != "conv_statistics"}
    if any("conv_statistics" in layer.kind.options for layer in layers.values()):
        chosen["conv_statistics"] = settings["conv_statistics"]
    return chosen


def state_dict(layers: dict[str, ManagedLayer], settings: dict[str, Any]) -> dict[str, Any]:
    """Running statistics per layer name (CPU tensors), each layer's kind and weight shape (checked at load), and the
    :func:`hyperparameters` they were made with."""
    return {
        "layers": {name: layer.running.state_dict() for name, layer in layers.items()},
        "kinds": {
            name: {"kind": layer.kind.name, "shape": tuple(layer.weight.shape)} for name, layer in layers.items()
        },
        "hyperparameters": hyperparameters(layers, settings),
    }


def load_state_dict(
    layers: dict[str, ManagedLayer], state: dict[str, Any], settings: dict[str, Any], *, strict: bool = True
) -> None:
    """Restore :func:`state_dict` output into ``layers`` (made under ``settings``): all of it or, on an error, nothing.

    Args:
        strict: the saved layer names must be the managed ones; ``False`` loads the layers both have, leaves the
            others' statistics as they are (fresh: μ = 0, σ² = 1) and names both sets in a ``BNPWarning``.

    Raises:
        ValueError: the saved layer names differ from the managed ones (``strict``), a saved layer was another kind
            of layer (a Conv1d's statistics for a Conv2d), its statistics have another length (e.g. per-channel ones
            saved under ``conv_statistics="channel"`` loaded into ``"column"``: they cannot be converted), or they are
            not finite (NaN or Inf).
    """
    saved, kinds = state["layers"], state.get("kinds", {})  # (no kinds: saved before they were kept)
    missing, unexpected = sorted(set(layers) - set(saved)), sorted(set(saved) - set(layers))
    if (missing or unexpected) and strict:
        raise ValueError(
            f"BNP state does not match the managed layers: missing {missing} (managed now, not in the state), "
            f"unexpected {unexpected} (in the state, not managed now). It was saved from another model or another "
            "layer selection (`layer_types`, `include`, `exclude`, `embeddings`): build the preconditioner with the "
            "selection it was saved with; or load the layers both have with `load_state_dict(state, strict=False)` "
            "(the others start fresh: μ = 0, σ² = 1); or start without the BNP state."
        )
    saved_settings, current = state.get("hyperparameters") or {}, hyperparameters(layers, settings)
    common = {name: layer_state for name, layer_state in saved.items() if name in layers}
    for name, layer_state in common.items():  # everything checked before anything is loaded
        _check_kind(name, layers[name], kinds.get(name))
        _check_length(name, layers[name], layer_state["mean_acc"].numel(), saved_settings, settings)
        _check_finite(name, layers[name], layer_state)
    for name, layer_state in common.items():
        layers[name].running.load_state_dict(layer_state, saved_rho=saved_settings.get("rho"))
    if missing or unexpected:
        warnings.warn(
            f"BNP statistics loaded for the layers the state and the preconditioner both have; missing {missing} "
            f"(not in the state) keep their statistics, unexpected {unexpected} (not managed) are ignored.",
            BNPWarning,
            stacklevel=user_stacklevel(),
        )
    # (a setting that shapes nothing in the current layers, e.g. conv_statistics with no conv left, is not compared)
    changed = {k: (v, current[k]) for k, v in saved_settings.items() if k in current and current[k] != v}
    if changed:  # a deliberate change on resume is allowed, but it should not pass unnoticed
        described = ", ".join(f"{k}: saved {old!r}, now {new!r}" for k, (old, new) in sorted(changed.items()))
        warnings.warn(
            f"BNP statistics loaded from a state saved with other settings ({described}); they continue "
            "under the current settings.",
            BNPWarning,
            stacklevel=user_stacklevel(),
        )


def _check_kind(name: str, layer: ManagedLayer, saved: dict[str, Any] | None) -> None:
    """A layer's statistics are those of its kind of input: a Conv1d's channels are not a Conv2d's."""
    if saved is None or saved.get("kind") == layer.kind.name:
        return
    shape = tuple(saved.get("shape", ()))
    raise ValueError(
        f"BNP statistics of layer {name!r} were saved from a {saved.get('kind')} layer (weight shape {shape}), but "
        f"{name!r} is now a {layer.kind.name} layer (weight shape {tuple(layer.weight.shape)}): the state was saved "
        "from a model whose layer of that name is another kind of layer; nothing was loaded. Load it into the same "
        "architecture, or start without the BNP state."
    )


def _check_finite(name: str, layer: ManagedLayer, layer_state: dict[str, Any]) -> None:
    """Saved statistics that are not finite would make P not finite (a running NaN never leaves the average)."""
    bad = [
        key
        for key in ("mean_acc", "var_acc", "decay")
        if isinstance(value := layer_state.get(key), Tensor) and not bool(torch.isfinite(value).all())
    ]
    if bad:
        raise ValueError(
            f"BNP statistics of layer {name!r} ({type(layer.module).__name__}) in the state are not finite (NaN or "
            f"Inf in {', '.join(bad)}): the state was saved from a run whose statistics had already gone wrong; "
            "nothing was loaded. Resume from an earlier checkpoint, or start without the BNP state."
        )


def _check_length(
    name: str, layer: ManagedLayer, length: int, saved_settings: dict[str, Any] | None, settings: dict[str, Any]
) -> None:
    if length == layer.features:
        return
    was = (saved_settings or {}).get("conv_statistics", "channel")
    if not layer.kind.statistics_differ(**(saved_settings or {})):
        raise ValueError(
            f"BNP statistics of layer {name!r} have {length} entries, but the layer "
            f"({type(layer.module).__name__}) has {layer.features} {layer.kind.statistics_unit(layer.module)}: the "
            "state was saved from a model whose layer has another shape. Load it into the same architecture, or "
            "start without the BNP state."
        )
    raise ValueError(
        f"BNP statistics of layer {name!r} have {length} entries, but it has {layer.features} with "
        f"conv_statistics={settings['conv_statistics']!r} (saved with conv_statistics={was!r}); per-channel "
        "and per-column statistics cannot be converted into each other. Resume with the saved "
        "`conv_statistics`, or start without the BNP state."
    )
