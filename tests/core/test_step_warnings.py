"""Issue 27 (survivors of ``BNPPreconditioner._report``, ``precondition`` and ``step``): the warnings a step raises
about the statistics of an earlier one — read from a host copy of every layer's max σ²_H (and, with counts on the
device, its row count) once that copy has arrived, never waiting for it — and the step's other bookkeeping."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import Tensor, nn

import lightning_bnp.core.step_warnings as step_warnings
from lightning_bnp.core import BNPPreconditioner, BNPWarning

RUNNING = "its running statistics are not updated in such a step and P uses the ones stored before it"
BATCH = "with statistics='batch' that step's P, and so the layer's gradient, is not finite"


@contextmanager
def bnp_warnings() -> Iterator[list[str]]:
    """The messages of the BNPWarnings raised inside."""
    messages: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield messages
    messages.extend(str(w.message) for w in caught if issubclass(w.category, BNPWarning))


def nan_rows(n: int, seed: int) -> Tensor:
    x = torch.randn(n, 3, generator=torch.Generator().manual_seed(seed))
    x[1, 2] = float("nan")
    return x


@pytest.mark.parametrize(("statistics", "says"), [("running", RUNNING), ("batch", BATCH)], ids=["running", "batch"])
def test_a_layer_that_saw_no_row_is_skipped_and_the_non_finite_layer_after_it_is_named(
    statistics: str, says: str
) -> None:
    """A step with counts on the device: ``a``'s every token is padding (no row: a NaN σ²_H but nothing to report),
    ``b`` after it has a NaN in its batch. Only ``b`` is named, with what it means for this ``statistics``."""
    torch.manual_seed(0)
    net = nn.ModuleDict({"a": nn.Linear(3, 2), "b": nn.Linear(3, 2)})
    pre = BNPPreconditioner(net, statistics=statistics)
    mask = torch.zeros(2, 4, dtype=torch.bool)
    with pre.token_mask(mask, layers="a"):
        out_a = net["a"](torch.randn(2, 4, 3)).masked_fill(~mask[..., None], 0.0)
        (out_a.sum() + net["b"](nan_rows(5, 1)).sum()).backward()
    with bnp_warnings() as messages:
        pre.step()
        pre.flush_warnings()
    assert len(messages) == 1, messages
    assert messages[0].startswith("BNP layer 'b' (Linear): ") and says in messages[0], messages


def test_a_later_layout_group_is_reported_after_a_finite_one() -> None:
    """Two layers of other dtypes are two groups of one step, each with its own host copy: the NaN of the second
    (float64) is named by the next step, although the first (float32) was finite."""
    torch.manual_seed(0)
    net = nn.ModuleDict({"a": nn.Linear(3, 2), "b": nn.Linear(3, 2).double()})
    pre = BNPPreconditioner(net)

    def step(x_b: Tensor) -> list[str]:
        (net["a"](torch.randn(4, 3)).sum() + net["b"](x_b.double()).sum()).backward()
        with bnp_warnings() as messages:
            pre.step()
        net.zero_grad()
        return messages

    assert step(nan_rows(4, 1)) == []  # the step itself reads nothing back
    messages = step(torch.randn(4, 3))
    assert len(messages) == 1 and messages[0].startswith("BNP layer 'b' (Linear): ") and RUNNING in messages[0]


class Copy:
    """A device-to-host copy (a CUDA event on CUDA) that arrives when the test says so, or when waited for."""

    def __init__(self) -> None:
        self.arrived = False

    def query(self) -> bool:
        return self.arrived

    def synchronize(self) -> None:
        self.arrived = True


def test_a_step_never_waits_for_the_host_copy_of_an_earlier_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The warning about a NaN comes from the first step after its host copy has arrived: none while it is on the
    way (the step goes on without waiting), then ``flush_warnings`` waits for it and names the layer."""
    copies: list[Copy] = []

    def host_copy(flat: Tensor) -> tuple[Tensor, Copy]:
        copies.append(Copy())
        return flat, copies[-1]

    monkeypatch.setattr(step_warnings, "_host_copy", host_copy)
    torch.manual_seed(0)
    net = nn.Linear(3, 2)
    pre = BNPPreconditioner(net)
    steps: list[Callable[[], Tensor]] = [lambda: nan_rows(4, 1), lambda: torch.randn(4, 3)]
    with bnp_warnings() as messages:
        for x in steps:
            net(x()).sum().backward()
            pre.step()
            net.zero_grad()
    assert messages == [] and len(copies) == 2
    with bnp_warnings() as messages:
        pre.flush_warnings()
    assert len(messages) == 1 and RUNNING in messages[0], messages
    assert all(copy.arrived for copy in copies)


def test_a_layer_whose_forward_saw_no_row_is_left_alone_without_a_warning() -> None:
    """An empty batch: the layer has a (zero) gradient but no statistics; it is left as it is (M·0 = 0) and its
    running statistics keep their step count. Its forward ran: no "never ran" warning (nor any other)."""
    net = nn.Linear(3, 2)
    pre = BNPPreconditioner(net)
    net(torch.randn(0, 3)).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", BNPWarning)
        pre.step()
    assert pre.layers[""].running.steps == 0
    assert pre.layers[""].transform is None


def test_stepping_with_an_optimizer_registers_its_commit_hook_once() -> None:
    """``pre.step(optimizer)`` at every step: one step post-hook on the optimizer (not one more per step), which
    commits every step's statistics."""
    torch.manual_seed(0)
    net = nn.Linear(3, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    registered = []
    register = opt.register_step_post_hook

    def counting(hook: Callable[..., None]) -> object:
        registered.append(hook)
        return register(hook)

    opt.register_step_post_hook = counting  # type: ignore[method-assign]
    pre = BNPPreconditioner(net)
    for _ in range(3):
        opt.zero_grad()
        net(torch.randn(4, 3)).square().sum().backward()
        pre.step(opt)
        opt.step()
    assert len(registered) == 1
    assert pre.layers[""].running.steps == 3
