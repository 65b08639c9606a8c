"""Every optimizer step of a ``Trainer.fit`` in automatic optimization replayed from one CUDA graph: the closure
(``training_step``, ``zero_grad``, backward), the hooks before the optimizer's step (BNP's step among them), gradient
clipping and the optimizer's step, after ``warmup_steps`` eager steps on a side stream (docs "CUDA graphs").

How it sits in Lightning's loop. The loop calls the LightningModule's ``optimizer_step`` hook once per step with the
closure; this callback wraps that hook for the length of the fit. The warm-up steps call it as it is, on a side
stream; the next one is captured, and from then on each step copies its batch (as the batch hooks left it) into the
captured batch's tensors, replays the graph, and hands the loop a copy of the captured step's output (the loss the
replay wrote) as the closure's result, so that ``trainer.global_step``, ``on_train_batch_end`` and checkpoints see a
step as in an eager fit. What ran as Python in the captured step runs no more; ``self.log`` calls made in it are
recorded at capture and made again after every replay, with the values the replay wrote.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loops.optimization.automatic import ClosureResult
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map
from typing_extensions import override

from lightning_bnp.callbacks.bnp import BatchNormPreconditioning
from lightning_bnp.core.arguments_repr import ArgumentsRepr
from lightning_bnp.core.cuda_graph import check_capturable
from lightning_bnp.core.graph_runtime import CUDA_GRAPHS, GraphRuntime, ReplayableGraph
from lightning_bnp.core.pending import unwrap_optimizer
from lightning_bnp.core.validation import check_int

__all__ = ["GraphedSteps"]

# precisions whose step a graph can replay: no GradScaler (it reads whether the gradients are finite back to the
# host) and no autocast (its cast cache is not graph-safe: torch's make_graphed_callables refuses it too)
GRAPHABLE_PRECISIONS = (Precision, HalfPrecision, DoublePrecision)


class GraphedSteps(ArgumentsRepr, Callback):
    """Replay each optimizer step of a fit from a CUDA graph (automatic optimization, one CUDA device).

    The whole step — forward, loss, backward, the callbacks' ``on_before_optimizer_step`` (BNP's step), clipping,
    the optimizer's step — is captured once, after ``warmup_steps`` eager steps, and replayed for every later batch:
    one launch per step, no Python. Logging, ``trainer.global_step``, ``on_train_batch_end`` and checkpoints work as
    in an eager fit; validation runs eagerly. Batches must keep their shapes (``DataLoader(..., drop_last=True)``).

    What a replay cannot redo is refused by name when training starts: manual optimization (use
    :class:`~lightning_bnp.core.GraphedTrainingStep` in the ``training_step``), several devices, mixed precision
    (``"16-mixed"``, ``"bf16-mixed"``; ``"bf16-true"`` and ``"32-true"`` work), gradient accumulation, a
    ``training_step`` that takes ``dataloader_iter``, an optimizer with ``capturable=False``, a learning-rate
    scheduler whose optimizer reads ``lr`` as a Python float (give it a tensor:
    ``torch.optim.Adam(..., lr=torch.tensor(1e-3), capturable=True)``) or that cycles the momentum; and, at the
    capture, a token mask that ``BatchNormPreconditioning`` made from the batch before the step.

    Args:
        warmup_steps: eager steps before the capture (≥ 1: optimizers create their state, BNP plans its step).

    Raises:
        TypeError, ValueError: ``warmup_steps`` not an int ≥ 1; (when training starts) a setting above that a
            replay cannot follow; (during the fit) a batch whose structure, shapes or dtypes are not the captured
            batch's, a ``training_step`` that returned ``None`` in the captured step, a ``torchmetrics.Metric``
            logged in it, or a token mask made before it.
        RuntimeError: (when training starts) no CUDA device, or the model is not on it.

    Example::

        trainer = Trainer(accelerator="cuda", devices=1, callbacks=[BatchNormPreconditioning(), GraphedSteps()])
    """

    runtime: GraphRuntime = CUDA_GRAPHS  # (the test suite's CPU stand-in replaces it)

    def __init__(self, *, warmup_steps: int = 3) -> None:
        check_int("warmup_steps", warmup_steps, low=1)
        self.warmup_steps = warmup_steps
        self._reset()

    def _reset(self) -> None:
        self.steps = 0  # optimizer steps of this fit that went through the hook (warm-up, capture, replays)
        self.graph: ReplayableGraph | None = None
        self._batch: Any = None
        self._static: list[Any] = []  # the captured batch's leaves (its tensors are the graph's inputs)
        self._static_spec: Any = None
        self._result: Any = None  # the captured step's closure result (its tensors are rewritten by each replay)
        self._logs: list[tuple[Optional[str], str, Any, dict[str, Any]]] = []
        self._grads: list[tuple[Tensor, Tensor]] = []  # the gradients the graph writes, by parameter
        self._module: pl.LightningModule | None = None

    @property
    def captured(self) -> bool:
        """Whether this fit's step has been captured (``False`` again after the fit: the graph is dropped)."""
        return self.graph is not None

    # ------------------------------------------------------------------ checks and wrapping
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # here, not at fit start: a resumed fit's optimizer state (its param groups' lr) is restored in between
        self._reset()
        self._check(trainer, pl_module)
        original_step, original_log = pl_module.optimizer_step, pl_module.log

        def optimizer_step(
            epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Optional[Callable[[], Any]] = None
        ) -> None:
            self._optimizer_step(pl_module, original_step, original_log, epoch, batch_idx, optimizer, optimizer_closure)

        pl_module.optimizer_step = optimizer_step  # type: ignore[method-assign]
        self._module = pl_module

    def _check(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        runtime = self.runtime
        if not runtime.available():
            raise RuntimeError(
                f"GraphedSteps needs a {runtime.name} device to capture steps on, and this machine has none: "
                "remove the callback to train eagerly"
            )
        device = trainer.strategy.root_device
        if not isinstance(trainer.strategy, SingleDeviceStrategy) or device.type != runtime.device_type:
            raise RuntimeError(
                f"GraphedSteps captures the steps of one {runtime.device_type} device; this fit runs on "
                f"{type(trainer.strategy).__name__} ({device}): use Trainer(accelerator={runtime.device_type!r}, "
                "devices=1) (a multi-device strategy's collectives are not captured by this callback)"
            )
        if not pl_module.automatic_optimization:
            raise ValueError(
                "GraphedSteps wraps the optimizer steps of automatic optimization, and this LightningModule sets "
                "automatic_optimization=False: call lightning_bnp.core.GraphedTrainingStep from its training_step "
                "instead (docs 'CUDA graphs')"
            )
        if is_param_in_hook_signature(pl_module.training_step, "dataloader_iter", explicit=True):
            raise ValueError(
                "GraphedSteps cannot replay a training_step that takes `dataloader_iter`: it draws its batch inside "
                "the step, which a replay does not run (every replay would train on the captured batch); take "
                "`batch` instead"
            )
        precision = trainer.precision_plugin
        if type(precision) not in GRAPHABLE_PRECISIONS:
            raise ValueError(
                f"GraphedSteps cannot replay steps with precision={trainer.precision!r} "
                f"({type(precision).__name__}): a GradScaler reads whether the gradients are finite back to the host "
                "at every step, and autocast's cast cache is not graph-safe. Use '32-true' or 'bf16-true'"
            )
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"GraphedSteps replays whole optimizer steps, and accumulate_grad_batches="
                f"{trainer.accumulate_grad_batches} runs the other micro-batches' backward outside them (they "
                "re-create the gradient tensors the graph writes): use accumulate_grad_batches=1"
            )
        for optimizer in trainer.optimizers:
            check_capturable(unwrap_optimizer(optimizer))
        for config in trainer.lr_scheduler_configs:
            if getattr(config.scheduler, "cycle_momentum", False):
                raise ValueError(
                    f"GraphedSteps: the learning-rate scheduler {type(config.scheduler).__name__} cycles the momentum "
                    "(cycle_momentum=True), a Python float of the optimizer that a replay keeps at its captured "
                    "value: pass cycle_momentum=False"
                )
            inner = unwrap_optimizer(config.scheduler.optimizer)
            for i, group in enumerate(inner.param_groups):
                if not isinstance(group["lr"], Tensor):
                    raise ValueError(
                        f"GraphedSteps: the learning-rate scheduler {type(config.scheduler).__name__} changes the lr "
                        f"of param group {i} of {type(inner).__name__}, which reads it as a Python float "
                        f"(lr={group['lr']!r}) that a replay keeps at its captured value: give the optimizer a "
                        "tensor lr (torch.optim.Adam(..., lr=torch.tensor(1e-3), capturable=True))"
                    )

    # ------------------------------------------------------------------ batches
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # (read at the step: the hooks that run after this one, the LightningModule's among them, may change it)
        self._batch = batch

    def _copy_batch(self, batch_idx: int) -> None:
        """This step's batch into the captured batch's tensors (the graph's inputs)."""
        leaves, spec = tree_flatten(self._batch)
        if spec != self._static_spec:
            raise ValueError(
                f"`batch` {batch_idx} is not built as the captured batch was: {spec} != {self._static_spec}"
            )
        for i, (static, leaf) in enumerate(zip(self._static, leaves)):
            if not isinstance(static, Tensor):
                if leaf != static:
                    raise ValueError(
                        f"`batch` {batch_idx}: its leaf {i} is {leaf!r}, the captured step's was {static!r} "
                        "(a value that is not a tensor is frozen into the graph)"
                    )
                continue
            if not isinstance(leaf, Tensor) or leaf.shape != static.shape or leaf.dtype != static.dtype:
                got = f"{tuple(leaf.shape)} {leaf.dtype}" if isinstance(leaf, Tensor) else repr(leaf)
                raise ValueError(
                    f"`batch` {batch_idx}: its tensor {i} is {got}, the captured step's was {tuple(static.shape)} "
                    f"{static.dtype}: a replay takes batches of the captured shapes (the last, smaller batch of an "
                    "epoch: DataLoader(..., drop_last=True))"
                )
            if leaf is not static:
                static.copy_(leaf)

    def _check_token_masks(self, trainer: pl.Trainer) -> None:
        """The token mask BNP's callback set for this batch must be one of the batch's tensors (which each step
        copies into the graph's inputs), not one made from it in a hook before the step."""
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if not isinstance(callback, BatchNormPreconditioning) or callback.preconditioner is None:
                continue
            mask = callback.preconditioner.current_token_mask
            if mask is not None and not any(mask is leaf for leaf in self._static):
                raise ValueError(
                    f"GraphedSteps: BatchNormPreconditioning(token_mask={callback.token_mask!r}) gave a mask that is "
                    "not one of the batch's tensors (a function of the batch made it before the step): every replay "
                    "would read the captured batch's. Give token_mask the batch's key or attribute, or a function "
                    "that returns one of its tensors (an integer mask is fine)"
                )

    # ------------------------------------------------------------------ the step
    def _optimizer_step(
        self,
        pl_module: pl.LightningModule,
        original_step: Callable[..., None],
        original_log: Callable[..., None],
        epoch: int,
        batch_idx: int,
        optimizer: Any,
        closure: Any,  # Lightning's step closure (its `_result` is what the loop reads after the step)
    ) -> None:
        self.steps += 1
        if self.graph is None and self.steps <= self.warmup_steps:
            with self.runtime.warmup():
                original_step(epoch, batch_idx, optimizer, closure)
            return
        if self.graph is None:
            self._static, self._static_spec = tree_flatten(self._batch)
            self._check_token_masks(pl_module.trainer)
            pl_module.log = self._recorded_log(pl_module)  # type: ignore[method-assign]
            try:
                with self.runtime.capture() as graph:
                    original_step(epoch, batch_idx, optimizer, closure)
            finally:
                del pl_module.log  # (the class's method again)
            self._result = closure._result
            if self._result is None or self._result.loss is None:
                raise ValueError(
                    "GraphedSteps: the captured step's training_step returned None (a skipped step); every replay "
                    "would skip it too"
                )
            self.graph = graph
            self._grads = [(p, p.grad) for p in pl_module.parameters() if p.grad is not None]
        else:
            self._copy_batch(batch_idx)
        self._batch = None
        self.graph.replay()
        # the loop's copy of the step's output: the captured tensors are rewritten by the next replay
        copied = tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, self._result.extra)
        closure._result = ClosureResult(self._result.closure_loss, extra=copied)
        for fx, name, value, kwargs in self._logs:  # the captured step's logging, with this replay's values
            before, pl_module._current_fx_name = pl_module._current_fx_name, fx
            try:
                original_log(name, value, **kwargs)
            finally:
                pl_module._current_fx_name = before

    def _recorded_log(self, pl_module: pl.LightningModule) -> Callable[..., None]:
        def log(name: str, value: Any, **kwargs: Any) -> None:
            from torchmetrics import Metric  # (a dependency of Lightning)

            leaves = tree_flatten(value)[0]
            if any(isinstance(leaf, Metric) for leaf in leaves):
                raise ValueError(
                    f"GraphedSteps: self.log({name!r}, <Metric>) in the captured step: a torchmetrics Metric "
                    "updates and resets its state in Python, which a replay does not run; log the metric from "
                    "on_train_batch_end with the step's outputs, or a tensor computed in the step"
                )
            if not all(isinstance(leaf, Tensor) for leaf in leaves):
                rank_zero_warn(
                    f"GraphedSteps: self.log({name!r}, {value!r}) logs a Python value in the captured step; every "
                    "replay logs that same value again (log a tensor to see each step's)"
                )
            self._logs.append((pl_module._current_fx_name, name, value, kwargs))

        return log

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning sets the gradients to None before validation; the graph still writes its own: show them again
        for p, grad in self._grads:
            p.grad = grad

    # ------------------------------------------------------------------ the end of a fit
    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._unwrap()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._unwrap()

    def _unwrap(self) -> None:
        if self._module is not None and "optimizer_step" in vars(self._module):
            del self._module.optimizer_step  # (the class's method again)
        self._reset()  # (drops the graph and the tensors it reads)
