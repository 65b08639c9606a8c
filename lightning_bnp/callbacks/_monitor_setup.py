"""What :class:`~lightning_bnp.callbacks.condition_monitor.ConditionNumberMonitor` checks at construction (every
argument, messages naming the argument and the value) and which layers it selects at fit start (its ``layers`` and
``hessian_layers`` patterns, each of which must match a Linear/ConvNd layer)."""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatchcase
from typing import Any

import lightning.pytorch as pl
from torch import nn

from lightning_bnp.callbacks import _probes as probes
from lightning_bnp.core.validation import check_bool, check_choice, check_float, check_int, check_patterns

__all__ = ["check_arguments", "hessian_layer_names", "matches", "selected_layers"]

_LANDSCAPE_STEPS = [0.5, 1.0, 2.0, 3.0, 4.0]  # the paper's [1/2, 4] range for VGG (paper 003)


def check_arguments(
    *,
    every_n_steps: Any,
    layers: Any,
    hessian_layers: Any,
    neuron: Any,
    hessian_precision: Any,
    hessian_rtol: Any,
    max_hessian_size: Any,
    max_weight_kappa_size: Any,
    lanczos_iters: Any,
    landscape_steps: Any,
    landscape_direction: Any,
    flags: dict[str, Any],
) -> tuple[list[str] | None, list[str] | None, float | None, list[float]]:
    """The monitor's constructor checks (``flags``: its on/off arguments by name).

    Returns:
        ``(layers, hessian_layers, hessian_rtol, landscape_steps)`` as the monitor stores them: the patterns as lists
        (a bare string is one pattern), ``hessian_rtol`` as a float, the step multiples as floats (the default ones
        when ``None``).

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: an argument out of range, or every metric switched off.
    """
    if every_n_steps is not None:
        check_int("every_n_steps", every_n_steps, low=1)
    for name, value, low in (
        ("neuron", neuron, 0),
        ("max_hessian_size", max_hessian_size, 1),
        ("max_weight_kappa_size", max_weight_kappa_size, 1),
        ("lanczos_iters", lanczos_iters, 1),
    ):
        check_int(name, value, low=low)
    layers, hessian_layers = check_patterns("layers", layers), check_patterns("hessian_layers", hessian_layers)
    for name, flag in flags.items():
        check_bool(name, flag)
    check_choice("hessian_precision", hessian_precision, ("float64", "model"))
    if hessian_rtol is not None:
        hessian_rtol = check_float("hessian_rtol", hessian_rtol, low=0.0, high=1.0, low_open=True, high_open=True)
    steps = list(_LANDSCAPE_STEPS) if landscape_steps is None else _step_multiples(landscape_steps)
    check_choice("landscape_direction", landscape_direction, ("gradient", "preconditioned"))
    metrics = ("kappa_d", "hessian_block", "weight_kappa", "effective_lr", "lanczos", "landscape")
    if not any(flags[name] for name in metrics):
        raise ValueError("every metric is switched off (`kappa_d`, `hessian_block`, ...): nothing to log")
    return layers, hessian_layers, hessian_rtol, steps


def selected_layers(
    pl_module: pl.LightningModule, layers: list[str] | None, hessian_layers: list[str] | None
) -> dict[str, nn.Module]:
    """The Linear/ConvNd layers of ``pl_module`` that ``layers`` selects (all when ``None``), by name.

    Raises:
        ValueError: a pattern of ``layers`` or ``hessian_layers`` matches no Linear/ConvNd layer (the error lists
            the candidates).
    """
    candidates = {name: m for name, m in pl_module.named_modules() if probes.is_neuron_layer(m)}
    for arg, patterns in (("layers", layers), ("hessian_layers", hessian_layers)):
        for pattern in patterns or ():
            if not any(fnmatchcase(name, pattern) for name in candidates):
                raise ValueError(
                    f"`{arg}` pattern {pattern!r} matches no Linear/ConvNd layer; candidates are {sorted(candidates)}"
                )
    return {n: m for n, m in candidates.items() if matches(n, layers)}


def hessian_layer_names(
    selected: dict[str, nn.Module], bnp_layers: Iterable[str] | None, hessian_layers: list[str] | None
) -> list[str]:
    """The layers whose neuron Hessian is computed: among the ``selected`` BNP layers (``bnp_layers``; all the
    selected ones without BNP), those ``hessian_layers`` matches, or the last one when it is ``None``."""
    base = [n for n in (bnp_layers if bnp_layers is not None else selected) if n in selected]
    return base[-1:] if hessian_layers is None else [n for n in base if matches(n, hessian_layers)]


def matches(name: str, patterns: list[str] | None) -> bool:
    return patterns is None or any(fnmatchcase(name, p) for p in patterns)


def _step_multiples(value: Any) -> list[float]:
    """``landscape_steps`` as floats: a non-empty list of finite numbers > 0."""
    message = f"`landscape_steps` must be a non-empty list of finite numbers > 0, got {value!r}"
    if not isinstance(value, (list, tuple)):
        raise TypeError(message)
    if not value:
        raise ValueError(message)
    try:
        return [check_float("landscape_steps", k, low=0.0, low_open=True) for k in value]
    except (TypeError, ValueError) as err:
        raise type(err)(message) from None
