"""A CPU stand-in for CUDA graphs, so that captured training steps are tested on a machine without CUDA.

``RecordedGraphs`` is a :class:`~lightning_bnp.core.graph_runtime.GraphRuntime`. Its capture records every tensor
operation of the step at torch's dispatch level (below autograd, so the backward's operations too), and its replay
runs the recorded operations again, in order, on the very tensors they ran on. It keeps the rules of a CUDA graph
that a captured step must obey, so that a step which breaks them fails here as it would on a GPU:

- **nothing is read back to the host** during capture (``.item()``, ``bool(t)``, ``nonzero``, …): refused, as a
  capturing CUDA stream refuses a synchronization;
- **capture writes nothing**: an operation that writes into a tensor (``add_``, ``copy_``, an ``out=``) is recorded,
  and at capture it writes into a scratch copy instead, so that parameters, optimizer state and running statistics
  are as before the capture (a CUDA capture launches no kernel); its other results are computed, with the same
  shapes and dtypes (their values, like those of a CUDA capture, are not to be relied on);
- **no Python runs on replay**: what Python decided at capture (a learning rate read as a float, which layers take
  part) is frozen, and every result tensor of the capture is rewritten in place on replay, at the same address;
- a tensor that Python drops and replaces after the capture (instead of writing into it) is no longer the one the
  replay reads or writes, as on a GPU; one that Python gives other memory (``t.data = …``, ``set_``) is refused at
  the replay (a GPU's graph would go on reading the old address).

Not caught: host reads that do not pass through torch's dispatcher (``.tolist()``, ``.numpy()``), and a tensor made
outside the capture that Python drops while the graph still reads it (the recording keeps it alive; on a GPU its
memory would be reused).

Views are not replayed: they share their base's memory, which the replay rewrites.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["HostReadInCapture", "RecordedGraph", "RecordedGraphs"]

aten = torch.ops.aten

#: operations that read a tensor's values back to the host (or whose result shape depends on them)
HOST_READS = {
    aten._local_scalar_dense.default,
    aten.equal.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
}

#: operations that read back to the host when an index is a bool mask (its true positions)
MASK_INDEXING = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}

#: in-place operations that change a tensor's shape or strides, not its values: run at capture, not on replay
METADATA_WRITES = {"resize_", "resize_as_", "set_", "as_strided_", "squeeze_", "unsqueeze_", "t_", "transpose_"}


class HostReadInCapture(RuntimeError):
    """A captured step read a tensor back to the host (a CUDA capture fails there too)."""


@dataclass
class _Op:
    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    out: Any
    memory: list[tuple[torch.Tensor, int]]  # its tensors and the address of their memory at capture


def _written_arguments(func: Any) -> list[int | str]:
    """Positions (or keyword names) of the arguments ``func``'s schema marks as written (``Tensor(a!)``)."""
    return [
        (i if not a.kwarg_only else a.name)
        for i, a in enumerate(func._schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    ]


def _memory(*values: Any) -> list[tuple[torch.Tensor, int]]:
    """Every tensor among ``values`` with the address of its memory."""
    return [(t, t.untyped_storage().data_ptr()) for t in tree_flatten(values)[0] if isinstance(t, torch.Tensor)]


def _is_view(func: Any) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


@dataclass
class RecordedGraph:
    """The operations of one captured step; :meth:`replay` runs them again."""

    ops: list[_Op] = field(default_factory=list)
    replays: int = 0

    def replay(self) -> None:
        with torch.no_grad():
            for op in self.ops:
                for tensor, address in op.memory:
                    if tensor.untyped_storage().data_ptr() != address:
                        raise RuntimeError(
                            f"a tensor of shape {tuple(tensor.shape)} that the captured step's {op.func} used was "
                            "given other memory after the capture (`.data = …`, `set_`): a CUDA graph would go on "
                            "using the old memory"
                        )
                result = op.func(*op.args, **op.kwargs)
                returns = op.func._schema.returns
                recorded_all, fresh_all = (op.out, result) if len(returns) > 1 else ((op.out,), (result,))
                for ret, recorded, fresh in zip(returns, recorded_all, fresh_all):
                    if ret.alias_info is not None:
                        continue  # a written argument: the operation just wrote into it
                    for r, f in zip(tree_flatten(recorded)[0], tree_flatten(fresh)[0]):
                        if isinstance(r, torch.Tensor):
                            r.copy_(f)
        self.replays += 1


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: RecordedGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in HOST_READS or (func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None):
            raise HostReadInCapture(f"{func} reads a tensor back to the host during the capture of a step")
        if func in MASK_INDEXING and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in tree_flatten(args[1])[0]
        ):
            raise HostReadInCapture(
                f"{func} with a bool mask as an index reads it back to the host (its true positions)"
            )
        if func._schema.name.split("::")[-1] in METADATA_WRITES:
            return func(*args, **kwargs)  # (shapes and strides are Python's business: set once, at capture)
        if _is_view(func):
            return func(*args, **kwargs)
        written = _written_arguments(func)
        if not written:
            out = func(*args, **kwargs)
            self.graph.ops.append(_Op(func, args, kwargs, out, memory=_memory(args, kwargs, out)))
            return out
        # capture writes nothing: the operation writes into scratch copies of its written arguments
        scratch_args, scratch_kwargs = list(args), dict(kwargs)
        originals: dict[int, torch.Tensor] = {}
        for where in written:
            if isinstance(where, str):
                box: Any = scratch_kwargs
                if scratch_kwargs.get(where) is None:
                    continue
            else:
                box = scratch_args
                if where >= len(scratch_args) or scratch_args[where] is None:
                    continue
            original = box[where]
            box[where] = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, original)
            for o, c in zip(tree_flatten(original)[0], tree_flatten(box[where])[0]):
                if isinstance(o, torch.Tensor):
                    originals[id(c)] = o
        out = func(*scratch_args, **scratch_kwargs)
        # a result that is a written argument is the original, not its scratch copy
        out = tree_map(lambda t: originals.get(id(t), t) if isinstance(t, torch.Tensor) else t, out)
        self.graph.ops.append(_Op(func, args, kwargs, out, memory=_memory(args, kwargs, out)))
        return out


class RecordedGraphs:
    """The CPU stand-in runtime: warm-up steps run as they are, ``capture()`` records a :class:`RecordedGraph`."""

    name = "recorded CPU graphs"
    device_type = "cpu"

    def __init__(self) -> None:
        self.graphs: list[RecordedGraph] = []

    def available(self) -> bool:
        return True

    @contextmanager
    def warmup(self) -> Iterator[None]:
        yield

    @contextmanager
    def capture(self) -> Iterator[RecordedGraph]:
        graph = RecordedGraph()
        with _Recorder(graph):
            yield graph
        self.graphs.append(graph)
