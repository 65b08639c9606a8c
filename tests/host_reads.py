"""Count the values a piece of code reads back from tensors to the host, nested calls included.

A read waits for every kernel queued before it: on a GPU the host can no longer run ahead of the device, and
a step that reads cannot be captured in a CUDA graph. Counted with ``torch.profiler``, which sees the aten calls
made inside other aten calls (a ``TorchDispatchMode`` does not: ``torch.segment_reduce`` checks its lengths with
two hidden ``.item()`` calls): every ``_local_scalar_dense`` (behind ``.item()``, ``int()``, ``float()``,
``bool()``, ``is_nonzero``) and ``equal`` (:mod:`benchmarks.op_count`), plus the Python-level ``Tensor.tolist``
(no aten call).
"""

from __future__ import annotations

import collections
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.op_count import read_names

__all__ = ["HostReads"]


class HostReads:
    """``with HostReads() as reads: ...`` then ``reads.total`` (and ``reads.reads``, a Counter by name)."""

    def __init__(self) -> None:
        self.reads: collections.Counter[str] = collections.Counter()
        self._profile = profile(activities=[ProfilerActivity.CPU])
        self._tolist: Any = None

    def __enter__(self) -> HostReads:
        original = self._tolist = torch.Tensor.tolist

        def tolist(tensor: torch.Tensor) -> Any:
            self.reads["Tensor.tolist"] += 1
            return original(tensor)

        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
        self._profile.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._profile.__exit__(*exc)
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
        self.reads.update(read_names(self._profile.events()))

    @property
    def total(self) -> int:
        return sum(self.reads.values())
