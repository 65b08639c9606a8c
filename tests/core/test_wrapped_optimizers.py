"""``pre.step(optimizer)`` with an optimizer that a framework wraps, or one re-created at every step (issue 37,
items 1 and 2): the running statistics are stored whenever the optimizer inside steps, as with a plain one."""

from __future__ import annotations

import gc
import threading
from typing import Any

import pytest
import torch
from lightning.fabric.wrappers import _FabricOptimizer
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import nn

from lightning_bnp import BNPPreconditioner
from lightning_bnp.core.pending import unwrap_optimizer
from tests.helpers import make_data, make_mlp, seeded_batch

STEPS = 4


def _batches(batch_size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = make_data().tensors
    return [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, len(x), batch_size)]


class _Strategy:
    """What the wrappers ask of a strategy: the optimizer step itself."""

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Any = None, **kwargs: Any) -> Any:
        return optimizer.step(closure=closure, **kwargs) if closure is not None else optimizer.step(**kwargs)


_STRATEGY = _Strategy()  # LightningOptimizer holds a weak proxy of its strategy


def _lightning(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return LightningOptimizer._to_lightning_optimizer(opt, _STRATEGY)  # type: ignore[arg-type]


def _fabric(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return _FabricOptimizer(opt, _STRATEGY)  # type: ignore[arg-type,return-value]


def _twice(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return _fabric(_lightning(opt))


def _run(
    network: nn.Module, wrap: Any, *, new_optimizer_each_step: bool = False, steps: int = STEPS
) -> BNPPreconditioner:
    pre = BNPPreconditioner(network)
    opt = wrap(torch.optim.SGD(network.parameters(), lr=0.1))
    for x, y in _batches()[:steps]:
        if new_optimizer_each_step:
            del opt
            gc.collect()  # the previous optimizer is freed: the new one's id() is often the same
            opt = wrap(torch.optim.SGD(network.parameters(), lr=0.1))
        opt.zero_grad()
        nn.functional.cross_entropy(network(x), y).backward()
        pre.step(opt)
        opt.step()
    return pre


@pytest.mark.parametrize("wrap", [_lightning, _fabric, _twice], ids=["LightningOptimizer", "Fabric", "both"])
def test_a_wrapped_optimizer_stores_the_statistics_as_the_plain_one(wrap: Any) -> None:
    plain_net, wrapped_net = make_mlp(), make_mlp()
    plain = _run(plain_net, lambda opt: opt)
    wrapped = _run(wrapped_net, wrap)
    for name, layer in plain.layers.items():
        assert wrapped.layers[name].running.steps == layer.running.steps == STEPS
        torch.testing.assert_close(wrapped.layers[name].running.mu, layer.running.mu, rtol=0, atol=0)
        torch.testing.assert_close(wrapped.layers[name].running.var, layer.running.var, rtol=0, atol=0)
    for p, q in zip(wrapped_net.parameters(), plain_net.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize("wrap", [lambda opt: opt, _lightning], ids=["plain", "LightningOptimizer"])
def test_an_optimizer_made_anew_at_every_step_commits_every_step(wrap: Any) -> None:
    pre = _run(make_mlp(), wrap, new_optimizer_each_step=True, steps=8)
    assert [layer.running.steps for layer in pre.layers.values()] == [8] * len(pre.layers)


def test_a_freed_optimizer_leaves_no_entry() -> None:
    network = make_mlp()
    pre = BNPPreconditioner(network)
    opt = torch.optim.SGD(network.parameters(), lr=0.1)
    x, y = _batches()[0]
    nn.functional.cross_entropy(network(x), y).backward()
    pre.step(opt)
    assert pre._commits.pending(opt) is not None
    del opt
    gc.collect()
    assert len(pre._commits.entries) == 0


def test_unwrap_optimizer_follows_the_wrappers_to_the_torch_optimizer() -> None:
    opt = torch.optim.SGD(make_mlp().parameters(), lr=0.1)
    assert unwrap_optimizer(opt) is opt
    assert unwrap_optimizer(_lightning(opt)) is opt
    assert unwrap_optimizer(_twice(opt)) is opt


class _Slotted:
    """A wrapper-like object without a ``__dict__``."""

    __slots__ = ("_optimizer",)


class _WrapsAnother(torch.optim.SGD):
    """An optimizer that is also a wrapper (it keeps another optimizer as ``_optimizer``)."""


def test_unwrap_optimizer_stops_at_an_object_without_a_dict_and_at_a_cycle_of_wrappers() -> None:
    slotted = _Slotted()
    slotted._optimizer = torch.optim.SGD(make_mlp().parameters(), lr=0.1)
    assert unwrap_optimizer(slotted) is slotted  # type: ignore[arg-type]  # (no __dict__ to read the wrapped one from)
    outer = _WrapsAnother(make_mlp().parameters(), lr=0.1)
    inner = _WrapsAnother(make_mlp().parameters(), lr=0.1)
    outer.__dict__["_optimizer"], inner.__dict__["_optimizer"] = inner, outer  # each wraps the other
    assert unwrap_optimizer(outer) is inner  # followed once, then the cycle ends it
    assert unwrap_optimizer(inner) is outer
    start = _WrapsAnother(make_mlp().parameters(), lr=0.1)
    start.__dict__["_optimizer"] = outer  # a cycle further in: it ends there too (every optimizer passed is seen)
    found: list[Any] = []
    looking = threading.Thread(target=lambda: found.append(unwrap_optimizer(start)), daemon=True)
    looking.start()
    looking.join(timeout=10)
    assert found == [inner]


def test_an_optimizer_never_stepped_with_bnp_has_no_pending_update() -> None:
    pre = BNPPreconditioner(make_mlp())
    opt = torch.optim.SGD(pre.layers["0"].module.parameters(), lr=0.1)
    assert pre._commits.pending(opt) is None
    assert pre._commits.pending(_lightning(opt)) is None


def test_a_step_whose_optimizer_did_not_step_gives_way_to_the_next_backwards_step() -> None:
    """``pre.step(opt)`` after a step whose ``opt.step()`` did not run (a ``GradScaler`` skip: its update is still
    pending) and a new backward transforms the new gradient, of the layers ``opt`` owns only, and its update
    replaces the pending one: the run equals a twin that never had the skipped step, and the layer ``opt`` does not
    own keeps the plain gradient of a third copy."""
    model, twin, plain = make_mlp(), make_mlp(), make_mlp()
    pre, twin_pre = BNPPreconditioner(model), BNPPreconditioner(twin)
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    twin_opt = torch.optim.SGD(twin[0].parameters(), lr=0.1)
    (x0, y0), (x1, y1) = seeded_batch(0), seeded_batch(1)
    nn.functional.cross_entropy(model(x0), y0).backward()
    pre.step(opt)  # its opt.step() does not run
    assert pre._commits.pending(opt) is not None
    model.zero_grad()
    for net, p, o in ((model, pre, opt), (twin, twin_pre, twin_opt)):
        nn.functional.cross_entropy(net(x1), y1).backward()
        p.step(o)
        o.step()
    nn.functional.cross_entropy(plain(x1), y1).backward()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    first, twin_first = pre.layers["0"].running, twin_pre.layers["0"].running
    assert first.steps == twin_first.steps == 1
    torch.testing.assert_close(first.mu, twin_first.mu, rtol=0, atol=0)
    torch.testing.assert_close(first.var, twin_first.var, rtol=0, atol=0)
    torch.testing.assert_close(model[2].weight.grad, plain[2].weight.grad, rtol=0, atol=0)
