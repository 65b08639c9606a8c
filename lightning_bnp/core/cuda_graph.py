"""A whole training step — forward, loss, backward, BNP's step, the optimizer's step — captured once in a CUDA graph
(``torch.cuda.graph``) and replayed: every kernel of a step launched by one call, no Python per step.

BNP's step can be captured because it reads nothing back to the host and keeps its running statistics in fixed
device buffers that every step overwrites in place (:class:`~lightning_bnp.core.step_plan.StepPlan`). What runs in
Python runs once, at capture, and is frozen into the graph: the step's layers, q² (from the batch size), the
learning rate of an optimizer that reads it as a float. The non-finite / overflow checks keep running on the device:
replays fold them into a vector that :meth:`~lightning_bnp.core.preconditioner.BNPPreconditioner.flush_warnings`
reads (:mod:`~lightning_bnp.core.step_warnings`).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor
from torch.optim import Optimizer

from lightning_bnp.core.graph_runtime import CUDA_GRAPHS, GraphRuntime, ReplayableGraph
from lightning_bnp.core.pending import unwrap_optimizer
from lightning_bnp.core.preconditioner import BNPPreconditioner

__all__ = ["GraphedTrainingStep", "check_capturable"]


def check_capturable(optimizer: Optimizer) -> None:
    """Refuse an optimizer whose step a graph cannot replay: one with a ``capturable`` option left off (Adam's step
    count then lives on the host).

    Raises:
        ValueError: a param group with ``capturable=False``, named by its index.
    """
    for i, group in enumerate(optimizer.param_groups):
        if group.get("capturable") is False:
            raise ValueError(
                f"`optimizer` ({type(optimizer).__name__}) has capturable=False in param group {i}: a CUDA graph "
                f"replays its step only with capturable=True (e.g. torch.optim.Adam(..., capturable=True))"
            )


class GraphedTrainingStep:
    """``loss = loss_of(*batch)``, ``loss.backward()``, ``preconditioner.step(optimizer)``, ``optimizer.step()``:
    run eagerly for ``warmup_steps`` calls (on a side stream, as ``torch.cuda.graph`` asks), captured at the next
    call and replayed from then on. Every call is one real training step on its ``batch``.

    Args:
        loss_of: the forward and the loss, a function of the batch's tensors (the same shapes on every call).
        optimizer: steps the parameters; one with a ``capturable`` option (Adam, AdamW, …) must have it on. A
            wrapper is unwrapped; Lightning's (``self.optimizers()`` in manual optimization) counts every call as
            an optimizer step, so ``trainer.global_step`` advances as in an eager fit.
        preconditioner: BNP for the model ``loss_of`` runs (``None``: the step without BNP).
        warmup_steps: eager steps before the capture (≥ 1: BNP builds its step plan and buffers there).

    Returns (a call): the loss, a tensor the next call overwrites (``.item()`` or ``.clone()`` it to keep it).

    Raises:
        ValueError: ``warmup_steps`` < 1, or (on a machine with CUDA) an optimizer with ``capturable=False``;
            (a call) a batch whose tensors' shapes are not the captured ones.
        RuntimeError: no CUDA device (checked before the optimizer's options).
    """

    runtime: GraphRuntime = CUDA_GRAPHS  # (the test suite's CPU stand-in replaces it)

    def __init__(
        self,
        loss_of: Callable[..., Tensor],
        optimizer: Optimizer,
        preconditioner: BNPPreconditioner | None = None,
        *,
        warmup_steps: int = 3,
    ) -> None:
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"`warmup_steps` must be an int ≥ 1 (BNP plans its step there), got {warmup_steps!r}")
        if not self.runtime.available():  # before the optimizer's options, which only matter for a CUDA graph
            raise RuntimeError(
                "GraphedTrainingStep needs a CUDA device (torch.cuda.is_available() is False): a CUDA graph captures "
                "CUDA kernels. Without one, run the step eagerly: loss.backward(); pre.step(optimizer); "
                "optimizer.step()"
            )
        inner = unwrap_optimizer(optimizer)
        check_capturable(inner)
        self.loss_of, self.optimizer, self.preconditioner = loss_of, inner, preconditioner
        # a wrapper that counts optimizer steps around its step() (Lightning's LightningOptimizer in manual
        # optimization: trainer.global_step) counts every call, the replays too
        self.wrapper = optimizer if optimizer is not inner else None
        self.warmup_steps = warmup_steps
        self.calls = 0
        self.graph: ReplayableGraph | None = None
        self.static_batch: tuple[Tensor, ...] = ()
        self.static_loss: Tensor | None = None

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def _step(self, batch: tuple[Tensor, ...]) -> Tensor:
        loss = self.loss_of(*batch)
        loss.backward()
        if self.preconditioner is not None:
            self.preconditioner.step(self.optimizer)
        self.optimizer.step()
        return loss.detach()

    def __call__(self, *batch: Tensor) -> Tensor:
        # (read per call: the Lightning loop sets them for the length of a training step)
        before = getattr(self.wrapper, "_on_before_step", None)
        after = getattr(self.wrapper, "_on_after_step", None)
        if callable(before) and callable(after):
            before()
            loss = self._call(batch)
            after()
            return loss
        return self._call(batch)

    def _call(self, batch: tuple[Tensor, ...]) -> Tensor:
        self.calls += 1
        if self.graph is None and self.calls <= self.warmup_steps:
            with self.runtime.warmup():
                self.optimizer.zero_grad(set_to_none=True)
                loss = self._step(batch)
            return loss
        if self.graph is None:
            self.static_batch = tuple(t.clone() for t in batch)
            # the captured backward writes fresh gradients (not accumulated): its .grad tensors are made in capture
            self.optimizer.zero_grad(set_to_none=True)
            with self.runtime.capture() as graph:
                self.static_loss = self._step(self.static_batch)
            self.graph = graph  # (capture runs nothing: the replay below is this call's step)
        if len(batch) != len(self.static_batch) or any(
            tensor.shape != static.shape for static, tensor in zip(self.static_batch, batch)
        ):
            raise ValueError(
                f"`batch` has shapes {[tuple(t.shape) for t in batch]} but the graph was captured for "
                f"{[tuple(t.shape) for t in self.static_batch]}: a replay takes batches of the captured shapes "
                "(the last, smaller batch of an epoch: DataLoader(..., drop_last=True))"
            )
        for static, tensor in zip(self.static_batch, batch):
            static.copy_(tensor)
        self.graph.replay()
        assert self.static_loss is not None
        return self.static_loss
