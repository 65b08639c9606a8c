"""Only the forward calls behind the gradient count (issue 45, item 1): a backward that reaches a forward's output
but accumulates nothing into the weight — ``torch.autograd.grad(loss, x)`` for FGSM/PGD or a saliency map,
``autograd.grad`` with respect to the parameters, ``backward(inputs=...)`` without the weight — adds none of its
rows. Each case is compared with the same run without that forward (or with a plain-torch reduction of the rows
that are behind the gradient), exactly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_bnp import BNPPreconditioner
from lightning_bnp.core import BNPWarning, reached, recompute
from tests.core.test_token_masks import check_moments
from tests.helpers import spy_moments

STEPS, BATCH = 3, 5
ROOT = Path(__file__).resolve().parents[2]


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _batch(step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, 4, generator=g, dtype=torch.float64) * torch.tensor([0.1, 1.0, 3.0, 10.0]) + 0.5
    return x, torch.randint(0, 3, (BATCH,), generator=g)


def _fgsm(net: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    x = x.clone().requires_grad_()
    (grad,) = torch.autograd.grad(F.cross_entropy(net(x), y), x)
    return (x + 0.1 * grad.sign()).detach()


def _sgd(net: nn.Module) -> None:
    with torch.no_grad():
        for p in net.parameters():
            p -= 0.1 * p.grad  # type: ignore[operator]


def _adversarial(*, hidden_from_bnp: bool) -> tuple[nn.Module, BNPPreconditioner]:
    """FGSM adversarial training; ``hidden_from_bnp``: the reference, whose attack runs with BNP paused."""
    net = _net()
    pre = BNPPreconditioner(net)
    for step in range(STEPS):
        x, y = _batch(step)
        if hidden_from_bnp:
            with pre.paused():
                x = _fgsm(net, x, y)
        else:
            x = _fgsm(net, x, y)  # train mode, the hooks see it: its backward reaches every output
        net.zero_grad()
        F.cross_entropy(net(x), y).backward()
        pre.step()
        _sgd(net)
    return net, pre


def _assert_same(a: tuple[nn.Module, BNPPreconditioner], b: tuple[nn.Module, BNPPreconditioner]) -> None:
    for p, q in zip(a[0].parameters(), b[0].parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    for layer, ref in zip(a[1].layers.values(), b[1].layers.values()):
        assert layer.running.steps == ref.running.steps == STEPS
        torch.testing.assert_close(layer.running.mu, ref.running.mu, rtol=0, atol=0)
        torch.testing.assert_close(layer.running.var, ref.running.var, rtol=0, atol=0)


def test_fgsm_adversarial_training_counts_only_the_training_forward() -> None:
    """The attack's ``autograd.grad(loss, x)`` reaches every layer's output but accumulates no weight's gradient:
    the run equals one whose attack BNP never saw (before the fix the attack's rows doubled N)."""
    _assert_same(_adversarial(hidden_from_bnp=False), _adversarial(hidden_from_bnp=True))


FIRST_BACKWARD = """
import torch
from tests.core.test_gradient_reach import _adversarial, _assert_same

tasks = []
hook = torch.nn.modules.module.register_module_full_backward_hook(
    lambda module, grad_in, grad_out: tasks.append(torch._C._current_graph_task_id())
)
seen = _adversarial(hidden_from_bnp=False)
hook.remove()
assert tasks and tasks[0] == 0, tasks
_assert_same(seen, _adversarial(hidden_from_bnp=True))
"""


def test_an_attack_that_is_the_first_backward_of_a_process_counts_nothing() -> None:
    """Autograd numbers its graph tasks from 0: FGSM's first ``autograd.grad(loss, x)`` in a fresh interpreter is
    task 0, a backward like any other, whose forward waits for a weight's gradient (and so counts nothing)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", FIRST_BACKWARD], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]


def _layer_moments(net: nn.Sequential, seen: dict, x: Tensor) -> None:  # type: ignore[type-arg]
    """The moments each layer brought to the latest step are those of ``x``'s forward alone (plain torch)."""
    inputs = {"0": x, "2": torch.tanh(net[0](x))}
    for name, h in inputs.items():
        m = seen[name]
        assert int(m.rows) == BATCH
        torch.testing.assert_close(m.mean, h.detach().mean(0), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(m.var, h.detach().var(0, unbiased=False), rtol=1e-12, atol=1e-12)


def test_a_saliency_probe_between_steps_adds_nothing() -> None:
    """An input-gradient probe in train mode after a step (a callback's saliency map): the next step's moments
    are those of its own batch."""
    net = _net()
    pre = BNPPreconditioner(net)
    seen = spy_moments(pre)
    probe = _batch(10)[0].requires_grad_()
    for step in range(2):
        x, y = _batch(step)
        (saliency,) = torch.autograd.grad(net(probe).max(1).values.sum(), probe)
        assert saliency.shape == probe.shape
        net.zero_grad()
        F.cross_entropy(net(x), y).backward()
        pre.step()
        _layer_moments(net, seen, x)
        _sgd(net)


def test_autograd_grad_of_the_parameters_counts_nothing_and_a_later_backward_counts_once() -> None:
    """``autograd.grad`` with respect to the parameters returns the gradient instead of accumulating it: nothing
    counts; back-propagating the same graph again (``retain_graph``) with ``backward()`` counts its rows once,
    as does a third pass."""
    net = _net()
    pre = BNPPreconditioner(net)
    seen = spy_moments(pre)
    x, y = _batch(0)
    loss = F.cross_entropy(net(x), y)
    torch.autograd.grad(loss, list(net.parameters()), retain_graph=True)
    assert all(layer.moments is None for layer in pre.layers.values())
    loss.backward(retain_graph=True)
    loss.backward()
    pre.step()
    _layer_moments(net, seen, x)


def test_a_gradient_penalty_counts_its_forward_once() -> None:
    """``autograd.grad(..., x, create_graph=True)`` then ``backward()`` of a loss with that gradient in it (WGAN-GP,
    input-gradient regularisation): the first pass accumulates nothing, the second counts the forward once."""
    net = _net()
    pre = BNPPreconditioner(net)
    seen = spy_moments(pre)
    x, y = _batch(0)
    x.requires_grad_()
    loss = F.cross_entropy(net(x), y)
    (grad,) = torch.autograd.grad(loss, x, create_graph=True)
    (loss + grad.square().sum()).backward()
    pre.step()
    _layer_moments(net, seen, x)


def test_a_backward_that_leaves_the_weight_out_drops_its_forward() -> None:
    """``loss.backward(inputs=[first layer's parameters])`` reaches the last layer's output but gives its weight no
    gradient: the last layer's statistics stay empty, the first layer's count."""
    net = _net()
    pre = BNPPreconditioner(net)
    x, y = _batch(0)
    F.cross_entropy(net(x), y).backward(inputs=list(net[0].parameters()))
    assert net[2].weight.grad is None and net[0].weight.grad is not None
    assert pre.layers["2"].moments is None
    assert pre.layers["0"].moments is not None and int(pre.layers["0"].moments.rows) == BATCH
    torch.testing.assert_close(pre.layers["0"].moments.mean, x.mean(0), rtol=1e-12, atol=1e-12)


def test_a_layer_frozen_at_construction_counts_once_trainable() -> None:
    """A weight frozen when BNP attached (no gradient hook then) that is made trainable later (fine-tuning that
    unfreezes a backbone) counts its forwards as any other."""
    net = _net()
    net[0].requires_grad_(False)
    pre = BNPPreconditioner(net)
    seen = spy_moments(pre)
    net[0].requires_grad_(True)
    x, y = _batch(0)
    F.cross_entropy(net(x), y).backward()
    pre.step()
    _layer_moments(net, seen, x)


def test_a_gradient_from_autograd_grad_assigned_to_grad_is_named_at_the_step() -> None:
    """A loop that computes the gradient with ``autograd.grad`` and assigns it to ``.grad``: no backward accumulated
    the weights' gradients, so no statistics count; the step names each layer and the cause, and transforms
    nothing."""
    net = _net()
    pre = BNPPreconditioner(net)
    x, y = _batch(0)
    params = list(net.parameters())
    for p, g in zip(params, torch.autograd.grad(F.cross_entropy(net(x), y), params)):
        p.grad = g
    with pytest.warns(BNPWarning, match=r"torch\.autograd\.grad, which accumulates nothing") as caught:
        pre.step()
    assert sorted(name for name in pre.layers if any(f"'{name}'" in str(w.message) for w in caught)) == ["0", "2"]
    assert all(layer.transform is None for layer in pre.layers.values())


def test_without_graph_task_ids_a_forward_counts_as_soon_as_a_backward_reaches_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A torch without ``torch._C._current_graph_task_id`` (BNP's fallback: no backward is ever running): nothing
    waits for a backward that may never accumulate the weight, so a forward counts when a backward reaches it —
    the FGSM attack's forward too, as before BNP told them apart (5 + 5 rows, not 5)."""
    monkeypatch.setattr(reached, "current_task", reached._no_task)
    monkeypatch.setattr(recompute, "current_task", reached._no_task)
    net = _net()
    pre = BNPPreconditioner(net, statistics="batch")
    seen = spy_moments(pre)
    x, y = _batch(0)
    adversarial = _fgsm(net, x, y)
    net.zero_grad()
    F.cross_entropy(net(adversarial), y).backward()
    pre.step()
    check_moments(seen["0"], torch.cat([x, adversarial]))


def test_a_layer_paused_in_a_backward_that_counts_another_counts_nothing() -> None:
    """The backward accumulates layer 0's gradient but reached no forward of it (paused): nothing is counted for
    it (the step names it), and layer 2's rows count."""
    net = _net()
    pre = BNPPreconditioner(net, statistics="batch")
    seen = spy_moments(pre)
    x, y = _batch(0)
    with pre.paused():
        h = net[0](x)
    F.cross_entropy(net[2](net[1](h)), y).backward()
    with pytest.warns(BNPWarning, match=r"BNP layer '0' \(Linear\): has a gradient but its forward never ran"):
        pre.step()
    assert sorted(seen) == ["2"]
    check_moments(seen["2"], torch.tanh(h).detach())


def _raising_backward(net: nn.Module, x: Tensor, y: Tensor) -> None:
    h = net[1](net[0](x))

    def stop(grad: Tensor) -> Tensor:
        raise RuntimeError("stop")

    h.register_hook(stop)  # after the pre-hooks of layer 2's output node held its forward
    with pytest.raises(RuntimeError, match="stop"):
        F.cross_entropy(net[2](h), y).backward()


def test_what_a_backward_held_is_dropped_when_it_ends_and_at_most_64_backwards_that_raised_are_kept() -> None:
    """A saliency backward reaches every output and accumulates nothing: its holds are dropped when it ends. A
    backward that raised never ends: its holds are kept, the oldest dropped past 64 such backwards."""
    net = _net()
    pre = BNPPreconditioner(net)
    held = pre._collection.tasks.held
    x, y = _batch(0)
    probe = x.clone().requires_grad_()
    torch.autograd.grad(net(probe).max(1).values.sum(), probe)
    assert held == {}
    for _ in range(70):
        _raising_backward(net, x, y)
    assert len(held) == 64


def test_a_preconditioner_detached_during_a_backward_lets_that_backward_end() -> None:
    """``detach()`` from a hook in the middle of a backward (after BNP held what it reached): the backward ends
    as without BNP, and nothing is counted."""
    net = _net()
    pre = BNPPreconditioner(net, statistics="batch")
    x, y = _batch(0)
    h = net[1](net[0](x))
    h.register_hook(lambda grad: pre.detach())
    F.cross_entropy(net[2](h), y).backward()
    assert all(p.grad is not None for p in net.parameters())
    assert all(layer.moments is None for layer in pre.layers.values())
