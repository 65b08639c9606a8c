"""The suite's CPU stand-in for CUDA graphs keeps a CUDA graph's rules: a capture writes nothing and reads nothing back
to the host, a replay reruns the step's tensor work (the backward's too) on the same tensors and no Python, and a
tensor that Python replaces after the capture is not the one the replay writes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.recorded_graphs import HostReadInCapture, RecordedGraphs


def test_a_capture_writes_nothing_and_each_replay_runs_the_step_once() -> None:
    runtime = RecordedGraphs()
    w = torch.ones(3)
    with runtime.capture() as graph:
        w.mul_(2.0).add_(1.0)
    assert torch.equal(w, torch.ones(3))  # (as a CUDA capture: no kernel ran)
    graph.replay()
    assert torch.equal(w, torch.full((3,), 3.0))
    graph.replay()
    assert torch.equal(w, torch.full((3,), 7.0))
    assert runtime.graphs == [graph] and graph.replays == 2


def test_a_replay_reruns_forward_and_backward_on_the_captured_tensors_and_no_python() -> None:
    runtime = RecordedGraphs()
    layer = nn.Linear(4, 1, bias=False)
    x = torch.zeros(2, 4)
    python_calls = []
    with runtime.capture() as graph:
        python_calls.append(1)
        layer(x).sum().backward()  # .grad is made in the capture, as a CUDA graph makes it in its pool
    assert layer.weight.grad is not None
    x.copy_(torch.arange(8.0).view(2, 4))  # the next "batch", written into the captured input
    graph.replay()
    torch.testing.assert_close(layer.weight.grad, torch.tensor([[4.0, 6.0, 8.0, 10.0]]))
    assert python_calls == [1]


@pytest.mark.parametrize("read", [lambda t: t.sum().item(), lambda t: bool(t.sum() > 0), lambda t: t.nonzero()])
def test_reading_a_tensor_back_to_the_host_in_a_capture_is_refused(read: object) -> None:
    t = torch.ones(3)
    with pytest.raises(HostReadInCapture, match="back to the host"):
        with RecordedGraphs().capture():
            read(t)  # type: ignore[operator]


def test_a_tensor_replaced_after_the_capture_is_not_the_one_the_replay_writes() -> None:
    holder = {"t": torch.zeros(2)}
    with RecordedGraphs().capture() as graph:
        holder["t"].add_(1.0)
    captured = holder["t"]
    holder["t"] = torch.zeros(2)  # replaced, not written into
    graph.replay()
    assert torch.equal(holder["t"], torch.zeros(2)) and torch.equal(captured, torch.ones(2))


def test_indexing_with_a_bool_mask_in_a_capture_is_refused() -> None:
    t, mask = torch.arange(4.0), torch.tensor([True, False, True, False])
    with pytest.raises(HostReadInCapture, match="bool mask as an index"):
        with RecordedGraphs().capture():
            t[mask]
    with pytest.raises(HostReadInCapture, match="bool mask as an index"):
        with RecordedGraphs().capture():
            t[mask] = 0.0
    with RecordedGraphs().capture():
        t[torch.tensor([0, 2])]  # (integer indices read nothing back)


def test_a_tensor_given_other_memory_after_the_capture_is_refused_at_the_replay() -> None:
    w = torch.zeros(3)
    with RecordedGraphs().capture() as graph:
        w.add_(1.0)
    w.data = torch.zeros(3)
    with pytest.raises(RuntimeError, match=r"shape \(3,\) that the captured step's aten\.add_\.Tensor used was given"):
        graph.replay()
