"""Which layers BNP and Weight Conditioning manage: the layer types (one list), name patterns, the names of layers
made by a suffix."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from fnmatch import fnmatchcase

from torch import nn

from lightning_bnp.core.validation import check_patterns, check_str_list

__all__ = [
    "DEFAULT_LAYER_TYPES",
    "SUPPORTED_LAYER_TYPES",
    "filter_by_name",
    "layer_name",
    "module_name",
    "select_layers",
    "validate_layer_types",
]

SUPPORTED_LAYER_TYPES: dict[str, type[nn.Module]] = {
    "Linear": nn.Linear,
    "Conv1d": nn.Conv1d,
    "Conv2d": nn.Conv2d,
    "Conv3d": nn.Conv3d,
}
#: the ``layer_types`` of BNP and Weight Conditioning when none are given: every type above
DEFAULT_LAYER_TYPES: tuple[str, ...] = tuple(SUPPORTED_LAYER_TYPES)


def validate_layer_types(layer_types: Sequence[str] | str, supported: Collection[str] | None = None) -> list[str]:
    """The type names as a list (a bare string is one name); ``supported``: the accepted names
    (default: :data:`SUPPORTED_LAYER_TYPES`; BNP accepts every registered layer kind).

    Raises:
        TypeError: not a string or a list of strings.
        ValueError: an empty list or an unknown type name.
    """
    layer_types = check_str_list("layer_types", layer_types)
    if not layer_types:
        raise ValueError("`layer_types` must name at least one layer type, got []")
    supported = SUPPORTED_LAYER_TYPES if supported is None else supported
    unknown = [t for t in layer_types if t not in supported]
    if unknown:
        raise ValueError(f"`layer_types` must be a subset of {sorted(supported)}, got unknown {unknown}")
    return layer_types


def select_layers(
    model: nn.Module,
    layer_types: Sequence[str] | str,
    include: Sequence[str] | str | None = None,
    exclude: Sequence[str] | str | None = None,
) -> dict[str, nn.Module]:
    """Return ``{qualified_name: module}`` of the layers BNP should manage.

    A layer is selected when it is an instance of one of ``layer_types`` (subclasses included),
    its name matches one of the ``include`` glob patterns (all names when ``None``), matches
    none of the ``exclude`` patterns. Frozen layers stay selected (they are skipped while they have
    no gradient, so unfreezing later works). Patterns use shell-style
    wildcards on ``named_modules()`` names, e.g. ``"encoder.*"`` or ``"*.fc?"``; a bare string is one
    pattern (``"net.0"`` means ``["net.0"]``).

    Raises:
        TypeError: ``layer_types``, ``include`` or ``exclude`` is not a string or a list of strings.
        ValueError: a pattern in ``include`` or ``exclude`` matches no layer of a selected type,
            or nothing is left to manage.
    """
    layer_types = validate_layer_types(layer_types)
    include, exclude = check_patterns("include", include), check_patterns("exclude", exclude)
    types = tuple(SUPPORTED_LAYER_TYPES[t] for t in layer_types)
    candidates = {name: m for name, m in model.named_modules() if isinstance(m, types)}
    return filter_by_name(candidates, layer_types, include, exclude)


def filter_by_name(
    candidates: dict[str, nn.Module],
    layer_types: Sequence[str],
    include: Sequence[str] | None,
    exclude: Sequence[str] | None,
) -> dict[str, nn.Module]:
    """The ``candidates`` (by module name) that ``include``/``exclude`` keep (validated patterns).

    Raises:
        ValueError: a pattern matches no candidate, or no candidate is left.
    """
    for arg, patterns in (("include", include), ("exclude", exclude)):
        for pattern in patterns or ():
            if not any(fnmatchcase(name, pattern) for name in candidates):
                raise ValueError(
                    f"`{arg}` pattern {pattern!r} matches no {'/'.join(layer_types)} layer; "
                    f"candidates are {sorted(candidates)}"
                )
    selected = {
        name: m
        for name, m in candidates.items()
        if (include is None or any(fnmatchcase(name, p) for p in include))
        and not any(fnmatchcase(name, p) for p in exclude or ())
    }
    if not selected:
        raise ValueError(
            f"no {'/'.join(layer_types)} layer is left for BNP after include={include!r}, "
            f"exclude={exclude!r}; candidates are {sorted(candidates)}"
        )
    return selected


def layer_name(module: str, suffix: str) -> str:
    """The name of the layer a kind with this ``suffix`` makes of the module named ``module``: ``<module><suffix>``
    (``attn.q``), and for the root module (``""``) the suffix without its leading dot (``q``, ``fc``: the name
    ``include``/``exclude`` patterns, the state and the messages use)."""
    return module + suffix if module else suffix.removeprefix(".")


def module_name(layer: str, suffix: str) -> str:
    """The name of the module whose layer of a kind with this ``suffix`` is named ``layer`` (the inverse of
    :func:`layer_name`)."""
    if not suffix:
        return layer
    if layer.endswith(suffix):
        return layer[: -len(suffix)]
    return "" if layer == layer_name("", suffix) else layer
