"""How :class:`~lightning_bnp.core.preconditioner.BNPPreconditioner` wires its parts: building them from its
settings, what a pickle or copy of it carries, and a step given an optimizer (which layers it owns, the layers made
after set-up, one transform per optimizer step however often it is asked for, the statistics stored only when the
optimizer's ``step()`` runs).

The front object keeps its public methods and their documentation; the code that connects the parts to one another
lives here, so that the front reads as the list of what a user can do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal, NamedTuple, Protocol

from torch import Tensor
from torch.optim import Optimizer

from lightning_bnp.core.collection import StatisticsCollection
from lightning_bnp.core.late_layers import LateLayers
from lightning_bnp.core.layers import ManagedLayer
from lightning_bnp.core.pending import OptimizerCommits, PendingUpdate, unwrap_optimizer
from lightning_bnp.core.step import PreconditionerStep
from lightning_bnp.core.step_warnings import StepWarnings
from lightning_bnp.core.token_masks import TokenMasks

__all__ = [
    "Front",
    "Parts",
    "Settings",
    "build_parts",
    "checked_params",
    "pickled_state",
    "restore",
    "step_with_optimizer",
]

NOT_PICKLABLE = (
    "a BNPPreconditioner with an explicit `process_group` cannot be pickled or copied (a process group is bound to "
    "this process); build a new one in the other process"
)
# what an object pickled before these attributes existed had: no embeddings, no grouped kernels, no offset in its
# running ρ^t, no late layers looked for
PICKLED_BEFORE: dict[str, Any] = {"embeddings": False, "grouped_kernels": False, "_decay_offset": 0.0, "_late": None}


class Settings(Protocol):
    """The settings of a preconditioner that its parts are built from (its constructor's arguments)."""

    rho: float
    eps1: float
    eps2: float
    statistics: Literal["running", "batch"]
    bias_correction: bool
    sync_statistics: bool
    process_group: Any
    grouped_kernels: bool
    _decay_offset: float


class Front(Settings, Protocol):
    """What :func:`pickled_state` and :func:`restore` use of the front object."""

    @property
    def attached(self) -> bool: ...

    _layer_list: list[ManagedLayer]

    def attach(self) -> None: ...


class Parts(NamedTuple):
    """The parts the front object delegates to (it keeps each as the attribute ``_<field>``)."""

    warnings: StepWarnings  # warnings and the deferred host copies they are read from
    masks: TokenMasks  # the token masks in force for the forward calls
    collection: StatisticsCollection  # the forward hooks and attach/detach
    commits: OptimizerCommits  # running-statistics updates waiting for an optimizer's step()
    step: PreconditionerStep  # the step: plan, math (eager or compiled), pooling over ranks


def build_parts(layers: list[ManagedLayer], settings: Settings, compile_options: dict[str, Any] | None = None) -> Parts:
    """The parts of a preconditioner with ``settings`` over ``layers`` (also for an object pickled before there were
    parts: ``compile_options``, its compiled step's options, compile the new step as its old one was)."""
    warnings = StepWarnings(running=settings.statistics == "running")
    masks = TokenMasks(layers)
    step = PreconditionerStep(
        rho=settings.rho, eps1=settings.eps1, eps2=settings.eps2, statistics=settings.statistics,
        bias_correction=settings.bias_correction, sync_statistics=settings.sync_statistics,
        process_group=settings.process_group, decay_offset=settings._decay_offset, warnings=warnings,
        grouped_kernels=settings.grouped_kernels,
    )  # fmt: skip
    if compile_options is not None:
        step.compile(**compile_options)
    return Parts(warnings, masks, StatisticsCollection(layers, masks), OptimizerCommits(), step)


def pickled_state(front: Front) -> dict[str, Any]:
    """What a pickle or copy (``copy.deepcopy``) of a preconditioner carries: its settings, layers and running
    statistics, and whether it was attached; hook handles, pending commits, plans, a compiled step and the current
    token mask stay behind (each part says what it keeps; a copy of the model carries no BNP hooks:
    ``core/copies.py``). A process group is bound to its process, so one with an explicit group is refused.

    Raises:
        TypeError: the preconditioner has an explicit ``process_group``.
    """
    if front.process_group is not None:
        raise TypeError(NOT_PICKLABLE)
    return {**front.__dict__, "_was_attached": front.attached}


def restore(front: Front, state: dict[str, Any]) -> None:
    """Unpickle :func:`pickled_state` output into ``front``: an attached preconditioner re-attaches to its copied
    modules (a state without that entry, pickled by an older version, comes back detached), and one pickled before
    there were parts gets them built (its settings and layers are all there)."""
    attached = state.pop("_was_attached", False)
    front.__dict__.update({**PICKLED_BEFORE, **state})
    if "_step" not in state:  # pickled by a version before the parts
        parts = build_parts(front._layer_list, front, state.get("_compile_options"))
        front.__dict__.update({f"_{name}": part for name, part in zip(Parts._fields, parts)})
    if attached:
        front.attach()


def step_with_optimizer(
    optimizer: Optimizer,
    layers: list[ManagedLayer],
    step: PreconditionerStep,
    commits: OptimizerCommits,
    late: LateLayers | None,
    precondition: Callable[..., PendingUpdate],
) -> None:
    """:meth:`BNPPreconditioner.step` given an optimizer (possibly wrapped: its commit follows the wrappers,
    :func:`~lightning_bnp.core.pending.unwrap_optimizer`): transform the gradients of the layers it owns with
    ``precondition(owned, commit=False)`` and defer the running-statistics update to its ``step()``. Asked again
    before that ``step()`` with no backward since, it does nothing."""
    optimizer = unwrap_optimizer(optimizer)  # (once: the parts below take the optimizer itself)
    owned = [p for group in optimizer.param_groups for p in group["params"]]
    if late is not None:
        late.check(optimizer, owned)  # layers made after set-up whose parameters it holds are named
    if commits.pending(optimizer) is not None and step.repeated(layers, owned):
        return  # asked for again before `optimizer.step()` (e.g. by the training_step and by the callback)
    commits.defer(optimizer, precondition(owned, commit=False))  # stored by the optimizer's step()


def checked_params(params: Any) -> Iterable[Tensor] | None:
    """``params`` of :meth:`BNPPreconditioner.step`/``precondition`` when it is not a ``torch.optim.Optimizer``.

    Raises:
        TypeError: an optimizer of another framework (DeepSpeed's, which keeps the gradients in buffers of its own:
            ``param.grad`` is None after ``engine.backward``) or anything else that is not an iterable of tensors.
    """
    if params is None or isinstance(params, (list, tuple)):
        return params
    kind = type(params)
    if any("deepspeed" in f"{c.__module__}.{c.__name__}".lower() for c in kind.__mro__):
        raise TypeError(
            f"BNPPreconditioner.step() got a {kind.__name__} ({kind.__module__}): DeepSpeed is not supported. Its "
            "engine reduces the gradients into buffers it owns (ZeRO stages 1-3; `param.grad` is None after "
            "`engine.backward`), so BNP would transform nothing. Use DDP or FSDP2 (`fully_shard`) instead."
        )
    if hasattr(params, "param_groups") or not hasattr(params, "__iter__"):
        raise TypeError(
            f"`params` must be a torch.optim.Optimizer (or a wrapper of one: Lightning's, Fabric's, Accelerate's), an "
            f"iterable of parameters, or None; got a {kind.__name__} ({kind.__module__}), which "
            + ("is not a torch.optim.Optimizer." if hasattr(params, "param_groups") else "is not iterable.")
        )
    return params
