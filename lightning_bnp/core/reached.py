"""Which forward calls' statistics join a step: those whose output's gradient reaches the layer's weight in a
backward that accumulates it.

A backward can reach a forward's output and still give the weight no gradient: ``torch.autograd.grad(loss, x)``
for FGSM/PGD adversarial examples or a saliency map (it accumulates nothing), ``torch.autograd.grad`` with respect
to the parameters (it returns the gradients instead of accumulating them), ``loss.backward(inputs=[...])``
without this weight. The rows of such a forward are not in the gradient the optimizer uses, so they must not be in
the statistics either (they would double N, halve q² and move μ and σ²).

So a forward call's moments are *held* when a backward reaches its output (a pre-hook on the output's autograd
node), under that backward's graph task (``torch._C._current_graph_task_id()``), and *counted* when the same
backward accumulates the weight's gradient (a post-accumulate-grad hook on the weight, which autograd runs after
every node that feeds the weight in that backward): :meth:`BackwardTasks.take`. What a backward held and did not
count is dropped when that backward ends (a callback queued on the autograd engine). A forward counts once,
however often its graph is back-propagated (``retain_graph=True``): a first backward that does not accumulate the
weight leaves it for a later one that does (a gradient penalty's ``autograd.grad(..., create_graph=True)``, then
``loss.backward()``).

Only Python objects are touched (no tensor value, no host read), so a step captured in a CUDA graph is unchanged.
"""

from __future__ import annotations

from functools import partial

import torch
from torch.autograd import Variable

from lightning_bnp.core.statistics import Moments

__all__ = ["BackwardTasks", "Reached", "current_task"]

# graph tasks whose end callback never ran (a backward that raised) are dropped past this many, oldest first
_MAX_TASKS = 64


def _no_task() -> int:
    return -1


# the running backward's graph task id, -1 outside one (a torch without it: every reached forward counts at once)
current_task = getattr(torch._C, "_current_graph_task_id", _no_task)


class Reached:
    """One forward call's moments, reached by a backward and waiting for it to accumulate the weight's gradient.

    Args:
        part: the call's moments.
        foreign: the call ran with another tensor than the weight leaf BNP manages
            (:attr:`~lightning_bnp.core.layers.ManagedLayer.foreign_weight`).
    """

    __slots__ = ("counted", "foreign", "part")

    def __init__(self, part: Moments, foreign: bool) -> None:
        self.part, self.foreign, self.counted = part, foreign, False


class BackwardTasks:
    """The forward calls each running backward (graph task) has reached, per layer name, not counted yet."""

    def __init__(self) -> None:
        self.held: dict[int, dict[str, list[Reached]]] = {}

    def hold(self, name: str, reached: Reached) -> bool:
        """Hold ``reached`` for layer ``name`` until the running backward accumulates its weight's gradient or ends;
        False outside a graph task (the caller counts it at once)."""
        task = current_task()
        if task < 0:
            return False
        held = self.held.get(task)
        if held is None:
            if len(self.held) >= _MAX_TASKS:
                del self.held[min(self.held)]
            held = self.held[task] = {}
            Variable._execution_engine.queue_callback(partial(self._end, task))  # run when that backward ends
        held.setdefault(name, []).append(reached)
        return True

    def _end(self, task: int) -> None:
        self.held.pop(task, None)  # what it reached and did not count is dropped

    def take(self, name: str) -> list[Reached]:
        """What the running backward reached of layer ``name`` (called when it accumulates the weight's gradient)."""
        held = self.held.get(current_task())
        return [] if held is None else held.pop(name, [])

    def clear(self) -> None:
        self.held.clear()
