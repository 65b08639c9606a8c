"""Count the values a piece of code reads back from tensors to the host (issue 28).

A read waits for every kernel queued before it: on a GPU the host can no longer run ahead of the device, and
a step that reads cannot be captured in a CUDA graph. Counted: the aten ops that produce a host value
(``_local_scalar_dense`` behind ``.item()``, ``int()``, ``float()``, ``bool()``; ``is_nonzero``; ``equal``)
and the Python-level ``Tensor.item``, ``Tensor.tolist`` and ``Tensor.__bool__`` (``tolist`` does not go
through the dispatcher).
"""

from __future__ import annotations

import collections
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostReads"]

_READ_OPS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.equal.default,
}
_PATCHED = ("item", "tolist", "__bool__")


class HostReads(TorchDispatchMode):
    """``with HostReads() as reads: ...`` then ``reads.total`` (and ``reads.reads``, a Counter by name)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: collections.Counter[str] = collections.Counter()
        self._originals: dict[str, Any] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _READ_OPS:
            self.reads[str(func)] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> HostReads:
        for name in _PATCHED:
            original = self._originals[name] = getattr(torch.Tensor, name)

            def counted(tensor: torch.Tensor, *args: Any, _name: str = name, _original: Any = original) -> Any:
                self.reads[f"Tensor.{_name}"] += 1
                return _original(tensor, *args)

            setattr(torch.Tensor, name, counted)
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)

    @property
    def total(self) -> int:
        return sum(self.reads.values())
