"""The warnings of steps captured in a CUDA graph, on the CPU: with ``_captured`` forced true, a step folds its
per-layer max σ²_H into its plan's device vector (elementwise maximum: a NaN and an Inf stick) instead of keeping a
host copy, and ``flush_warnings`` reads that vector, warns by layer and cause, and clears it. A copy of the warnings
(pickle) leaves the original's captured vectors behind, and one pickled before they existed loads. (The replays
themselves: ``test_cuda_graph.py``, on a GPU.)"""

from __future__ import annotations

import copy
import pickle
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import lightning_bnp.core.step_warnings as step_warnings
from lightning_bnp.core import BNPPreconditioner, BNPWarning
from lightning_bnp.core.step_warnings import StepWarnings


def _step(net: nn.Module, pre: BNPPreconditioner, x: torch.Tensor) -> None:
    net(x).sum().backward()
    pre.step()
    net.zero_grad(set_to_none=True)


def _messages(pre: BNPPreconditioner) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", BNPWarning)
        pre.flush_warnings()
    return [str(w.message) for w in caught if issubclass(w.category, BNPWarning)]


def test_captured_steps_fold_their_maxima_and_flush_names_each_layer_once_then_clears(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    pre = BNPPreconditioner(net)
    _step(net, pre, torch.randn(5, 3))  # (eager: the plan and its vector are made here)
    [plan] = pre._step.plans.values()
    monkeypatch.setattr(step_warnings, "_captured", lambda peak: True)
    x = torch.randn(5, 3)
    x[0, 1] = float("nan")
    _step(net, pre, x)  # NaN into the first layer (and from it into the second)
    assert torch.isnan(plan.alarm).all()
    _step(net, pre, torch.randn(5, 3))  # a finite step does not clear what was seen
    assert torch.isnan(plan.alarm).all()
    assert pre._warnings.owed == []  # no host copy while capturing
    messages = _messages(pre)
    assert [m.split(":")[0] for m in messages] == ["BNP layer '0' (Linear)", "BNP layer '1' (Linear)"]
    assert all("not finite" in m for m in messages)
    assert plan.alarm.tolist() == [0.0, 0.0]  # cleared by the flush


def test_an_overflow_in_a_captured_step_is_named_as_an_overflow(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    net = nn.Linear(3, 2)
    pre = BNPPreconditioner(net)
    _step(net, pre, torch.randn(5, 3))
    monkeypatch.setattr(step_warnings, "_captured", lambda peak: True)
    x = torch.randn(5, 3)
    x[:, 2] *= 1e30  # finite inputs whose squares overflow float32
    _step(net, pre, x)
    [plan] = pre._step.plans.values()
    assert plan.alarm.tolist() == [float("inf")]
    [message] = _messages(pre)
    assert message.startswith("BNP layer ")
    assert "overflows float32" in message


def test_a_copy_leaves_the_captured_vectors_behind_and_an_older_pickle_loads() -> None:
    original = StepWarnings(running=True)
    original.captured[1] = ([None], torch.full((1,), float("nan")))
    for clone in (copy.deepcopy(original), pickle.loads(pickle.dumps(original))):
        assert clone.captured == {} and clone.owed == [] and clone.running
    assert len(original.captured) == 1
    older = StepWarnings.__new__(StepWarnings)  # as pickled before captured steps existed
    older.__setstate__({"running": False, "warned": {("a", "non-finite")}, "owed": []})
    assert older.captured == {} and older.warned == {("a", "non-finite")} and not older.running
    older.flush()  # nothing owed, nothing captured
    newer = StepWarnings.__new__(StepWarnings)
    kept = ([None], torch.zeros(1))
    newer.__setstate__({"running": True, "warned": set(), "owed": [], "captured": {7: kept}})
    assert newer.captured == {7: kept}  # a state that has it keeps it


def test_each_set_of_layers_stepped_apart_keeps_its_own_captured_vector(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two optimizers' layers (two plans): each captured step folds into its own plan's vector, and the flush names
    the layers of both."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    pre = BNPPreconditioner(net)
    first, second = list(net[0].parameters()), list(net[1].parameters())

    def step(x: torch.Tensor) -> None:
        net(x).sum().backward()
        pre.step(first)
        pre.step(second)
        net.zero_grad(set_to_none=True)

    step(torch.randn(5, 3))
    monkeypatch.setattr(step_warnings, "_captured", lambda peak: True)
    x = torch.randn(5, 3)
    x[0, 1] = float("nan")
    step(x)
    assert len(pre._step.plans) == 2 and len(pre._warnings.captured) == 2
    names = [m.split(":")[0] for m in _messages(pre)]
    assert sorted(names) == ["BNP layer '0' (Linear)", "BNP layer '1' (Linear)"]


def _layer(name: str) -> SimpleNamespace:
    return SimpleNamespace(name=name, module=nn.Linear(1, 1))


def _warned_about(warner: StepWarnings, layers: list[SimpleNamespace | None], peaks: list[float]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", BNPWarning)
        warner._warn_about(layers, torch.tensor(peaks))  # type: ignore[arg-type]
    return [str(w.message) for w in caught]


def test_a_layer_not_to_be_named_does_not_hide_the_ones_after_it() -> None:
    """A step's maxima name each layer but the ``None`` ones (not to be named); a ``None`` first does not end the
    reading."""
    messages = _warned_about(StepWarnings(running=True), [None, _layer("b"), _layer("c")], [float("nan")] * 2 + [0.0])
    assert [m.split(" (")[0] for m in messages] == ["BNP layer 'b'"]


def test_the_causes_a_pickle_holds_still_count_as_warned_after_loading() -> None:
    """The (layer, cause) pairs already warned about travel in a pickled preconditioner (``warned``): one pickled
    after a non-finite and an overflowing step does not warn about the same layers again; other layers, and the
    same layers for the other cause, are warned about."""
    older = StepWarnings.__new__(StepWarnings)
    older.__setstate__({"running": True, "warned": {("a", "non-finite"), ("b", "overflow")}, "owed": []})
    nan, inf = float("nan"), float("inf")
    assert _warned_about(older, [_layer("a"), _layer("b")], [nan, inf]) == []
    messages = _warned_about(older, [_layer("a"), _layer("b"), _layer("c")], [inf, nan, nan])
    assert [m.split(" (")[0] for m in messages] == ["BNP layer 'a'", "BNP layer 'b'", "BNP layer 'c'"]
    assert "overflows float32" in messages[0] and "not finite" in messages[1]


class _Recorder:
    """Stands for a CUDA tensor or event on a machine without CUDA: records what is asked of it."""

    def __init__(self, calls: list[tuple[Any, ...]], name: str, **attributes: Any) -> None:
        self.calls, self.name = calls, name
        self.__dict__.update(attributes)

    def __getattr__(self, method: str) -> Any:
        return lambda *args, **kwargs: self.calls.append((self.name, method, args, kwargs))


def test_a_cuda_steps_maxima_are_copied_to_pinned_memory_without_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the host copy of a step's per-layer maxima never makes the host wait: a buffer of the vector's shape
    and dtype in pinned memory, a non-blocking copy into it, and an event recorded after the copy (``report`` reads
    the copy once the event has passed). Run here with stand-ins for the CUDA tensor and event (the copy itself:
    ``test_cuda_graph.py`` on a GPU); a CPU vector is its own host copy."""
    calls: list[tuple[Any, ...]] = []
    flat = SimpleNamespace(device=SimpleNamespace(type="cuda"), shape=torch.Size([3]), dtype=torch.float64)
    fake_torch = SimpleNamespace(
        empty=lambda *args, **kwargs: calls.append(("torch", "empty", args, kwargs)) or _Recorder(calls, "host"),
        cuda=SimpleNamespace(Event=lambda: _Recorder(calls, "event")),
    )
    monkeypatch.setattr(step_warnings, "torch", fake_torch)
    host, done = step_warnings._host_copy(flat)  # type: ignore[arg-type]
    assert isinstance(host, _Recorder) and host.name == "host" and isinstance(done, _Recorder)
    assert calls == [
        ("torch", "empty", (torch.Size([3]),), {"dtype": torch.float64, "pin_memory": True}),
        ("host", "copy_", (flat,), {"non_blocking": True}),
        ("event", "record", (), {}),
    ]
    monkeypatch.undo()
    cpu = torch.zeros(3)
    assert step_warnings._host_copy(cpu) == (cpu, None)


def test_flush_reads_a_captured_vector_through_a_host_copy_then_clears_it() -> None:
    """The maxima a captured step folds into a device vector are read back with ``.to("cpu", copy=True)`` (a copy
    also on the CPU: the vector is cleared next), then the vector is zeroed; a stand-in for a CUDA vector here."""
    calls: list[tuple[Any, ...]] = []

    class CudaVector(_Recorder):
        def to(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            calls.append(("alarm", "to", args, kwargs))
            return torch.tensor([float("nan")])

    warner = StepWarnings(running=True)
    warner.captured[1] = ([SimpleNamespace(name="a", module=nn.Linear(1, 1))], CudaVector(calls, "alarm"))  # type: ignore[list-item]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", BNPWarning)
        warner.flush()
    assert calls == [("alarm", "to", ("cpu",), {"copy": True}), ("alarm", "zero_", (), {})]
    assert [str(w.message).split(" (")[0] for w in caught] == ["BNP layer 'a'"]
