"""A dict that keeps at most a given number of entries: the one bounded cache of the core."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

__all__ = ["BoundedCache"]

K = TypeVar("K")
V = TypeVar("V")


class BoundedCache(dict[K, V]):
    """A ``dict`` of at most ``size`` entries: storing a new key when it is full first drops the earliest stored
    one (first in, first out; a lookup does not refresh an entry). For values built once per distinct key that
    rarely changes from step to step (a layout per set of layers, a per-layer vector per tuple of values), where
    a key that stops recurring must not keep its value alive for good.

    Args:
        size: the most entries kept (≥ 1).

    Example::

        cache: BoundedCache[tuple[float, ...], Tensor] = BoundedCache(8)
        vector = cache.get_or_make(key, lambda: torch.tensor(key))
    """

    def __init__(self, size: int) -> None:
        super().__init__()
        if size < 1:
            raise ValueError(f"`size` must be at least 1, got {size}")
        self.size = size

    def __setitem__(self, key: K, value: V) -> None:
        if key not in self and len(self) >= self.size:
            del self[next(iter(self))]
        super().__setitem__(key, value)

    def get_or_make(self, key: K, make: Callable[[], V]) -> V:
        """The value stored under ``key``, or ``make()`` stored under it (dropping the earliest entry when full)."""
        found = self.get(key)
        if found is None:
            found = self[key] = make()
        return found

    def __reduce__(self) -> tuple[Any, tuple[int], None, None, Iterator[tuple[K, V]]]:
        # pickle / deepcopy: rebuilt with its size, then filled (a dict subclass's items are set before its state)
        return type(self), (self.size,), None, None, iter(self.items())
