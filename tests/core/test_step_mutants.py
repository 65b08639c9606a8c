"""Survivors of mutation testing in :mod:`lightning_bnp.core.step` (tests/MUTANTS.md, the fifth pass): what
``compile_step`` hands to ``torch.compile``, and what a copy of a preconditioner whose step is compiled carries.

``torch.compile`` is replaced here by a recorder that returns a local function around the function it is given
(mutation testing's selection runs no compilation, and no test name here says "compile"): like a real compiled
function (a wrapper named ``step_math`` that is not :func:`~lightning_bnp.core.step_math.step_math`), it does not
pickle, so a copy must build its own.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_bnp.core import BNPPreconditioner
from lightning_bnp.core.step import PreconditionerStep
from lightning_bnp.core.step_math import step_math
from lightning_bnp.core.step_warnings import StepWarnings
from tests.helpers import bnp_train, make_mlp, seeded_batch


class GraphRecorder:
    """Stands in for ``torch.compile``: records each function and options it is given, and returns a local
    function (unpicklable, as a real compiled one) that counts its calls and runs the function given."""

    def __init__(self) -> None:
        self.given: list[tuple[Any, dict[str, Any]]] = []
        self.runs = 0

    def __call__(self, fn: Any, **options: Any) -> Any:
        self.given.append((fn, options))

        def run(*args: Any) -> Any:
            self.runs += 1
            return fn(*args)

        return run


def sgd_steps(model: nn.Module, pre: BNPPreconditioner, seeds: range) -> None:
    """SGD (lr 0.1) with a BNP step before each update, on ``seeded_batch(seed)`` for each seed."""
    bnp_train(model, pre, torch.optim.SGD(model.parameters(), lr=0.1), seeds)


def assert_same_parameters(model: nn.Module, reference: nn.Module) -> None:
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=name)


def test_compile_step_gives_every_option_and_its_own_copy_of_step_math_named_step_math(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``compile_step(**options)`` passes every option on, with ``fullgraph=True``, and compiles a copy of
    ``step_math``: its own code object (Dynamo keeps compiled graphs per code object), named ``step_math``
    (``__name__`` as ``__qualname__``, which comes from the code), with ``step_math``'s globals, no defaults and
    no closure; the step then runs through the returned function and transforms as the eager step does."""
    recorder = GraphRecorder()
    monkeypatch.setattr(torch, "compile", recorder)
    model, reference = make_mlp(), make_mlp()
    pre, eager = BNPPreconditioner(model), BNPPreconditioner(reference)
    pre.compile_step(backend="aot_eager", mode="reduce-overhead", dynamic=False)
    [(fn, options)] = recorder.given
    assert options == {"fullgraph": True, "backend": "aot_eager", "mode": "reduce-overhead", "dynamic": False}
    assert fn is not step_math and fn.__code__ is not step_math.__code__
    assert fn.__code__.co_name == "step_math"
    assert (fn.__name__, fn.__qualname__) == ("step_math", "step_math")
    assert fn.__globals__ is step_math.__globals__
    assert fn.__defaults__ is None and fn.__kwdefaults__ is None and fn.__closure__ is None
    sgd_steps(model, pre, range(2))
    sgd_steps(reference, eager, range(2))
    assert recorder.runs == 2
    assert_same_parameters(model, reference)


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_a_copy_of_a_graph_stepped_preconditioner_builds_its_own_step_with_the_same_options(
    monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A compiled step function does not pickle: the state of a preconditioner whose step is compiled leaves it
    behind (a pickle of the model and its preconditioner succeeds), and the copy compiles its own with the
    original's options, which its later steps run through, stepping exactly as the original does."""
    recorder = GraphRecorder()
    monkeypatch.setattr(torch, "compile", recorder)
    model = make_mlp()
    pre = BNPPreconditioner(model).compile_step(backend="eager")
    sgd_steps(model, pre, range(2))
    assert recorder.runs == 2
    copier = copy.deepcopy if how == "deepcopy" else lambda obj: pickle.loads(pickle.dumps(obj))
    model_copy, pre_copy = copier((model, pre))
    assert pre_copy.step_compiled
    assert [options for _, options in recorder.given] == [{"fullgraph": True, "backend": "eager"}] * 2
    sgd_steps(model_copy, pre_copy, range(2, 4))
    assert recorder.runs == 4
    sgd_steps(model, pre, range(2, 4))
    assert recorder.runs == 6
    assert_same_parameters(model_copy, model)


def test_a_step_stores_its_running_statistics_update_unless_told_not_to() -> None:
    """``PreconditionerStep.precondition`` commits by default: after it each layer's running statistics have
    taken one step (those of a twin stepped by ``BNPPreconditioner.precondition()``), and the pending update it
    returns holds nothing left to store; with ``commit=False`` they are untouched until the update is committed."""
    for commit in (None, False):
        model, reference = make_mlp(), make_mlp()
        pre, twin = BNPPreconditioner(model, rho=0.5), BNPPreconditioner(reference, rho=0.5)
        step = PreconditionerStep(
            rho=0.5, eps1=pre.eps1, eps2=pre.eps2, statistics="running", bias_correction=False,
            sync_statistics=False, process_group=None, decay_offset=pre._decay_offset,
            warnings=StepWarnings(running=True),
        )  # fmt: skip
        for net in (model, reference):
            x, y = seeded_batch(0)
            F.cross_entropy(net(x), y).backward()
        layers = list(pre.layers.values())
        pending = step.precondition(layers, None) if commit is None else step.precondition(layers, None, commit=False)
        twin.precondition()
        if commit is None:
            assert pending.items == []
        else:
            assert [layer.running.steps for layer in layers] == [0, 0]
            assert len(pending.items) == 2
            pending.commit()
        for layer, other in zip(layers, twin.layers.values()):
            assert layer.running.steps == 1
            torch.testing.assert_close(layer.running.mean_acc, other.running.mean_acc, rtol=0, atol=0)
            torch.testing.assert_close(layer.running.var_acc, other.running.var_acc, rtol=0, atol=0)
