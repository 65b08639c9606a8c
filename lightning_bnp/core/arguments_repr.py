"""``__repr__`` from constructor arguments: ``Name(arg=value, ...)`` for the objects users configure."""

from __future__ import annotations

import inspect

__all__ = ["ArgumentsRepr"]


class ArgumentsRepr:
    """Mixin: ``repr`` lists every ``__init__`` argument by its attribute of the same name (the value after
    validation, e.g. a bare-string pattern as the one-element list it means). Arguments in
    ``_repr_skip`` are left out (e.g. the model a preconditioner was built on)."""

    _repr_skip: tuple[str, ...] = ()

    def __repr__(self) -> str:
        names = [name for name in inspect.signature(type(self).__init__).parameters if name != "self"]
        parts = [f"{name}={getattr(self, name)!r}" for name in names if name not in self._repr_skip]
        return f"{type(self).__name__}({', '.join(parts + self._repr_extra())})"

    def _repr_extra(self) -> list[str]:
        return []
