"""``__repr__`` from constructor arguments: ``Name(arg=value, ...)`` for the objects users configure."""

from __future__ import annotations

import inspect

__all__ = ["ArgumentsRepr"]


class ArgumentsRepr:
    """Mixin: ``repr`` lists every ``__init__`` argument by its attribute of the same name (the value after
    validation, e.g. a bare-string pattern as the one-element list it means). Arguments in
    ``_repr_skip`` are left out (e.g. the model a preconditioner was built on); those in
    ``_repr_if_set`` only appear when they differ from their default (options added after the first
    release, as ``torch.nn.Conv2d``'s repr shows ``padding_mode`` only when it is not ``'zeros'``), so
    that the repr of an existing configuration does not change."""

    _repr_skip: tuple[str, ...] = ()
    _repr_if_set: tuple[str, ...] = ()

    def __repr__(self) -> str:
        parameters = inspect.signature(type(self).__init__).parameters
        names = [
            name
            for name, p in parameters.items()
            if name != "self"
            and name not in self._repr_skip
            and not (name in self._repr_if_set and getattr(self, name) == p.default)
        ]
        parts = [f"{name}={getattr(self, name)!r}" for name in names]
        return f"{type(self).__name__}({', '.join(parts + self._repr_extra())})"

    def _repr_extra(self) -> list[str]:
        return []
