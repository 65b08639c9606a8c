"""What a captured training step needs of CUDA graphs, in three calls: eager warm-up steps on a side stream, the capture
of one step into a graph, and the graph's replay (torch's "whole network capture" recipe, docs "CUDA graphs").

:class:`~lightning_bnp.core.cuda_graph.GraphedTrainingStep` and the :class:`~lightning_bnp.GraphedSteps` callback
reach CUDA only through a :class:`GraphRuntime`, so that the test suite can run both on a machine without CUDA: its
stand-in (``tests/recorded_graphs.py``) records a step's tensor operations at capture, with a CUDA graph's rules
(nothing read back to the host, nothing written at capture), and replays them on the same tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

import torch

__all__ = ["CUDA_GRAPHS", "CUDAGraphs", "GraphRuntime", "ReplayableGraph"]


class ReplayableGraph(Protocol):
    """A captured step: :meth:`replay` runs its kernels again, on the tensors they ran on at capture."""

    def replay(self) -> None: ...


class GraphRuntime(Protocol):
    """Where captured steps run: ``available()``, ``warmup()`` around each eager warm-up step, ``capture()`` around
    the one step that is captured (it yields the graph, which runs nothing until its first replay)."""

    name: str
    device_type: str  # the device its steps' tensors are on

    def available(self) -> bool: ...

    def warmup(self) -> AbstractContextManager[None]: ...

    def capture(self) -> AbstractContextManager[ReplayableGraph]: ...


class CUDAGraphs:
    """The runtime of a CUDA device: ``torch.cuda.CUDAGraph`` captured on torch's capture stream, with warm-up steps
    on a side stream that the current stream then waits for (as ``torch.cuda.graph``'s documentation asks)."""

    name = "CUDA"
    device_type = "cuda"

    def available(self) -> bool:
        return torch.cuda.is_available()

    @contextmanager
    def warmup(self) -> Iterator[None]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            yield
        torch.cuda.current_stream().wait_stream(side)

    @contextmanager
    def capture(self) -> Iterator[ReplayableGraph]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            yield graph


CUDA_GRAPHS = CUDAGraphs()
