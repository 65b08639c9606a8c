"""Count what a training step costs a GPU's host, and how much of it BNP adds.

Counted with ``torch.profiler``, which sees the aten calls made *inside* other aten calls (a
``TorchDispatchMode`` does not): that is where hidden host reads and the per-tensor fallback of
``torch._foreach_*`` calls live. Per step, three counts:

* **host reads** — every ``aten::_local_scalar_dense`` (behind ``.item()``, ``int()``, ``bool()`` of a tensor,
  ``is_nonzero``) and ``equal``, nested ones included: on a GPU each waits for every queued kernel;
* **calls** — the calls that do work as a GPU would launch them: each top-level aten call, views, metadata and
  allocations apart; a ``torch._foreach_*`` call counts as the per-tensor calls it falls back to, unless every
  index of its tensor lists has one shape (ATen's fused multi-tensor path on CUDA, one launch);
* **allocations** — ``empty``, ``empty_like``, ``empty_strided`` calls anywhere (each a caching-allocator visit).

What BNP adds is the cost of a BNP step minus that of the same step without BNP — forward, backward,
``pre.step()`` and the optimizer step — at steady state (after ``warmup`` steps, once cached index tensors exist).

Run: ``python -m benchmarks.op_count`` prints the counts for the standard models.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from example_projects.models import cifar_resnet, fc_network
from example_projects.transformers import VOCAB, CharLM, ViT
from lightning_bnp.core import BNPPreconditioner

__all__ = ["StepCost", "added_cost", "profile_cost", "read_names", "standard_models"]

# the host reads: `.item()`, `int()`, `bool()`, `is_nonzero` all end in _local_scalar_dense; `equal` returns a bool
_READS = {"aten::_local_scalar_dense", "aten::equal"}
_READ_CALLERS = {"aten::item", "aten::is_nonzero"}  # counted through the read inside them
_ALLOCATIONS = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided"}
# metadata only: no kernel runs (views are found from the op schemas, these are the rest)
_METADATA = {"aten::size", "aten::stride", "aten::numel", "aten::dim", "aten::is_same_size", "aten::lift_fresh",
             "aten::_has_compatible_shallow_copy_type", "aten::result_type", "aten::set_", "aten::resize_"}  # fmt: skip
_VIEW_CACHE: dict[str, bool] = {}


def _is_view(name: str) -> bool:
    """Whether aten op ``name`` returns a view (or alias) of an input: no kernel runs."""
    found = _VIEW_CACHE.get(name)
    if found is None:
        packet = getattr(torch.ops.aten, name.removeprefix("aten::"), None)
        overloads = [getattr(packet, o) for o in packet.overloads()] if packet is not None else []
        found = _VIEW_CACHE[name] = any(o.is_view for o in overloads)
    return found


@dataclass
class StepCost:
    """What one profiled span costs: host reads, calls doing work, allocations, and the calls by name."""

    host_reads: int = 0
    calls: int = 0
    allocations: int = 0
    by_name: collections.Counter[str] = field(default_factory=collections.Counter)

    def __sub__(self, other: StepCost) -> StepCost:
        return StepCost(
            self.host_reads - other.host_reads,
            self.calls - other.calls,
            self.allocations - other.allocations,
            self.by_name - other.by_name,
        )


def _fused(children: list[Any]) -> bool:
    """Whether a ``_foreach_*`` call would take ATen's fused path on CUDA: its per-tensor calls on the CPU (which
    always falls back) show every index's tensors with one shape, none broadcast (the profiler records no shapes of
    a tensor list, so they are read from the per-tensor calls; 0-dim entries are the scalars)."""
    return bool(children) and all(len({tuple(s) for s in c.input_shapes if s}) == 1 for c in children)


def _launches(event: Any, cost: StepCost) -> None:
    name = event.name
    if name in _READS or name in _READ_CALLERS or name in _ALLOCATIONS or name in _METADATA or _is_view(name):
        return
    if name.startswith("aten::_foreach_"):
        children = [c for c in event.cpu_children if c.name.startswith("aten::")]
        if children and not _fused(children):
            for child in children:
                _launches(child, cost)
            return
    cost.calls += 1
    cost.by_name[name] += 1


def _walk(events: Iterable[Any]) -> Iterable[Any]:
    for event in events:
        yield event
        yield from _walk(event.cpu_children)


def read_names(events: Iterable[Any]) -> list[str]:
    """The host reads among profiled ``events`` (all of them, nested ones included), by aten name."""
    return [
        event.name
        for event in events
        if event.name == "aten::_local_scalar_dense"
        or (
            event.name == "aten::equal"
            and not any(c.name == "aten::_local_scalar_dense" for c in _walk(event.cpu_children))
        )
    ]


def profile_cost(run: Callable[[], None]) -> StepCost:
    """The :class:`StepCost` of ``run()`` on the CPU (the launches a GPU would make, counted on the host)."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        run()
    events = prof.events()
    cost = StepCost(host_reads=len(read_names(events)))
    cost.allocations = sum(event.name in _ALLOCATIONS for event in events)
    roots = [e for e in events if e.cpu_parent is None]
    for event in roots:
        if event.name.startswith("aten::"):
            _launches(event, cost)
        else:  # a record_function span: its aten children are the top-level calls
            for child in _walk(event.cpu_children):
                if child.name.startswith("aten::") and not _has_aten_ancestor(child):
                    _launches(child, cost)
    return cost


def _has_aten_ancestor(event: Any) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def _step(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *, bnp: bool) -> Callable[[], None]:
    """One SGD step (zero_grad, forward, cross-entropy backward, [``pre.step()``], ``opt.step()``)."""
    pre = BNPPreconditioner(model) if bnp else None
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        out = model(inputs)  # (N, classes), or (N, T, vocab) for a language model with (N, T) targets
        nn.functional.cross_entropy(out.flatten(0, -2), targets.flatten()).backward()
        if pre is not None:
            pre.step()
        opt.step()

    return step


def added_cost(
    make_model: Callable[[], nn.Module], inputs: torch.Tensor, targets: torch.Tensor, warmup: int = 3
) -> tuple[StepCost, int]:
    """(what BNP adds to one step of ``make_model()``, managed layers L)."""
    costs = []
    for bnp in (False, True):
        torch.manual_seed(0)
        model = make_model().train()
        step = _step(model, inputs, targets, bnp=bnp)
        for _ in range(warmup):
            step()
        costs.append(profile_cost(step))
    layers = sum(isinstance(m, (nn.Linear, nn.modules.conv._ConvNd)) for m in model.modules())
    layers += 3 * sum(isinstance(m, nn.MultiheadAttention) for m in model.modules())  # its q, k, v blocks
    return costs[1] - costs[0], layers


def standard_models() -> dict[str, tuple[Callable[[], nn.Module], torch.Tensor, torch.Tensor]]:
    """The issue's two models, a small Transformer encoder and issue 24's two benchmark Transformers (rows ``vit``
    and ``charlm`` of ``benchmarks.overhead``) on small inputs (the count does not depend on the batch or image
    size)."""
    g = torch.Generator().manual_seed(0)
    return {
        "FC 784-100×3": (
            lambda: fc_network(28 * 28, hidden=100, norm="none"),
            torch.randn(8, 28 * 28, generator=g),
            torch.randint(10, (8,), generator=g),
        ),
        "Transformer encoder 2×(MHA + MLP)": (
            lambda: nn.Sequential(
                nn.TransformerEncoder(
                    nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2, enable_nested_tensor=False
                ),
                nn.Flatten(),
                nn.Linear(5 * 16, 10),
            ),
            torch.randn(4, 5, 16, generator=g),
            torch.randint(10, (4,), generator=g),
        ),
        "ViT d=64 ×2, no norm": (
            lambda: ViT(norm="none"),
            torch.randn(2, 1, 28, 28, generator=g),
            torch.randint(10, (2,), generator=g),
        ),
        "char-LM d=128 ×2 + LN": (
            CharLM,
            torch.randint(VOCAB, (2, 64), generator=g),
            torch.randint(VOCAB, (2, 64), generator=g),
        ),
        "ResNet-20 GN": (
            lambda: cifar_resnet(20, in_channels=3, norm="gn"),
            torch.randn(2, 3, 16, 16, generator=g),
            torch.randint(10, (2,), generator=g),
        ),
    }


def main() -> None:
    for name, (make, x, y) in standard_models().items():
        added, layers = added_cost(make, x, y)
        print(
            f"{name}: BNP adds {added.calls} calls, {added.host_reads} host reads and {added.allocations} "
            f"allocations per step for L = {layers} layers"
        )


if __name__ == "__main__":
    main()
