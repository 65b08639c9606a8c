"""A preconditioner's checkpoint state: the running statistics of every managed layer by name and the settings that
shaped them; loading checks that they fit the layers (names, lengths) and says what changed."""

from __future__ import annotations

import warnings
from typing import Any

from lightning_bnp.core.layers import BNPWarning, ManagedLayer
from lightning_bnp.core.stack import user_stacklevel

__all__ = ["hyperparameters", "load_state_dict", "state_dict"]


def hyperparameters(layers: dict[str, ManagedLayer], settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` (ρ, ε1, ε2, statistics, bias correction, conv statistics) that shape the running statistics
    and P of ``layers``; ``conv_statistics`` only when a layer's kind has that option (it shapes nothing else)."""
    chosen = {k: v for k, v in settings.items() if k != "conv_statistics"}
    if any("conv_statistics" in layer.kind.options for layer in layers.values()):
        chosen["conv_statistics"] = settings["conv_statistics"]
    return chosen


def state_dict(layers: dict[str, ManagedLayer], settings: dict[str, Any]) -> dict[str, Any]:
    """Running statistics per layer name (CPU tensors) and the :func:`hyperparameters` they were made with."""
    return {
        "layers": {name: layer.running.state_dict() for name, layer in layers.items()},
        "hyperparameters": hyperparameters(layers, settings),
    }


def load_state_dict(layers: dict[str, ManagedLayer], state: dict[str, Any], settings: dict[str, Any]) -> None:
    """Restore :func:`state_dict` output into ``layers`` (made under ``settings``).

    Raises:
        ValueError: the saved layer names differ from the managed ones, or a layer's saved statistics
            have another length (e.g. per-channel ones saved under ``conv_statistics="channel"`` loaded
            into ``"column"``: they cannot be converted); nothing is loaded then.
    """
    saved = state["layers"]
    missing, unexpected = set(layers) - set(saved), set(saved) - set(layers)
    if missing or unexpected:
        raise ValueError(
            f"BNP state does not match the managed layers: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        )
    saved_settings, current = state.get("hyperparameters"), hyperparameters(layers, settings)
    for name, layer_state in saved.items():
        _check_length(name, layers[name], layer_state["mean_acc"].numel(), saved_settings, settings)
    for name, layer_state in saved.items():
        layers[name].running.load_state_dict(layer_state)
    changed = {k: (v, current[k]) for k, v in (saved_settings or {}).items() if current.get(k) != v}
    if changed:  # a deliberate change on resume is allowed, but it should not pass unnoticed
        described = ", ".join(f"{k}: saved {old!r}, now {new!r}" for k, (old, new) in sorted(changed.items()))
        warnings.warn(
            f"BNP statistics loaded from a state saved with other settings ({described}); they continue "
            "under the current settings.",
            BNPWarning,
            stacklevel=user_stacklevel(),
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
