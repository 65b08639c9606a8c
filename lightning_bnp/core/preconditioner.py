"""Batch Normalization Preconditioning for plain PyTorch (paper 000, Alg. 2 and Alg. 3).

:class:`BNPPreconditioner` is the front object: it selects the layers, builds the parts below and delegates to
them. It watches the inputs of a model's Linear/ConvNd layers with forward
hooks and, once per optimizer step, replaces each layer's gradient by (1/q²)·P·Pᵀ·g (eq. 15/23)
built from running statistics of those inputs. The network itself is never changed.

One step, for every managed layer with a gradient:

1. pool the input moments of every training forward call since the last step (micro-batches,
   repeated calls, and — with ``sync_statistics`` under ``torch.distributed`` — all ranks, in
   one flattened ``all_gather``) into (N, μ_H, σ²_H);
2. update the running statistics, μ ← ρμ + (1−ρ)μ_H, σ² ← ρσ² + (1−ρ)σ²_H (or use the batch
   statistics directly with ``statistics="batch"``);
3. σ̃² = σ² + ε1·max(σ²) + ε2 and q² from ``transform.q_squared``;
4. transform the gradients in place (``transform.precondition_``).

Batch size one (a single row of H): μ_H = h and σ²_H = (h − μ)² with the running μ *before*
this step's update (the paper's rule after Alg. 2; before any update μ = 0).

Layers without a bias have no centring direction: P = diag(1/σ̃), and σ² tracks the
*uncentred* second moment E[h²] = σ²_H + μ_H², i.e. the columns of the uncentred H are
equilibrated (μ is kept at 0 for them). A layer whose bias exists but has no gradient in a step
(a frozen bias) gets P·Pᵀ restricted to the weight block with g_b = 0: G_w ← G_w / (q² σ̃²).

Frozen layers (``weight.requires_grad`` false) record no statistics, and layers whose weight has
no gradient in a step are skipped and their statistics for that step dropped.

Which forward calls count. A forward call's statistics count for the step once a backward reaches
its output and accumulates the layer's weight gradient (:mod:`~lightning_bnp.core.reached`): a
forward whose output gets no gradient — a ``training_step`` that returns ``None`` after the forward,
an output used only for logging — adds nothing, nor does one whose backward accumulates nothing into
the weight (``torch.autograd.grad(loss, x)`` for adversarial examples or saliency); the forward that
non-reentrant activation checkpointing recomputes during the backward is not counted twice (its
recomputed graph is never back-propagated), and the one reentrant checkpointing recomputes counts
under the token mask and pause of the forward it recomputes (:mod:`~lightning_bnp.core.recompute`).

Non-finite statistics. A step whose pooled moments of a layer are not finite (a NaN or Inf sample)
does not update that layer's running statistics (nor its step count): P of that step is built from the
statistics committed before it. Finite inputs whose squares overflow the dtype (|h| ≳ 1.8e19 in float32)
give a σ²_H that is saturated at ``finfo.max·2⁻²⁴`` instead (the statistics keep following the data).
Neither needs the host: the choice is a ``torch.where`` on the device and the step never reads a value
back (no host synchronisation, so the host runs ahead of the device). The :class:`BNPWarning` that names
the layer and the cause (once per layer and cause) is raised by the *next* step, from a host copy of the
step's per-layer max σ²_H (non-blocking on CUDA, read only once it has arrived), or by
:meth:`BNPPreconditioner.flush_warnings` and ``detach()``.

Layers sharing one weight (``dec.weight = enc.weight``) are one layer for BNP, as a module called
twice is: their statistics are pooled and the shared gradient is transformed once. They must share
their bias too (or both have none), since P couples a weight with its bias (eq. 15).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Literal

from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_bnp.core import checkpoint
from lightning_bnp.core.arguments_repr import ArgumentsRepr
from lightning_bnp.core.kinds import layer_kinds
from lightning_bnp.core.late_layers import LateLayers
from lightning_bnp.core.layer_setup import manage_layers
from lightning_bnp.core.layers import BNPWarning, ManagedLayer, StepTransform
from lightning_bnp.core.parts import build_parts, checked_params, pickled_state, restore, step_with_optimizer
from lightning_bnp.core.pending import PendingUpdate
from lightning_bnp.core.selection import DEFAULT_LAYER_TYPES, validate_layer_types
from lightning_bnp.core.step import transforms_of
from lightning_bnp.core.validation import check_bool, check_choice, check_float, check_patterns

__all__ = [
    "DEFAULT_LAYER_TYPES",
    "BNPPreconditioner",
    "BNPWarning",
    "ManagedLayer",
    "PendingUpdate",
    "StepTransform",
    "validate_bnp_arguments",
]

StatisticsMode = Literal["running", "batch"]
ConvStatistics = Literal["channel", "column"]


def validate_bnp_arguments(
    rho: float,
    eps1: float,
    eps2: float,
    statistics: str,
    *,
    bias_correction: bool = False,
    layer_types: Sequence[str] | str = DEFAULT_LAYER_TYPES,
    include: Sequence[str] | str | None = None,
    exclude: Sequence[str] | str | None = None,
    sync_statistics: bool = True,
    conv_statistics: str = "channel",
    embeddings: bool = False,
) -> tuple[list[str], list[str] | None, list[str] | None]:
    """Shared constructor checks; messages name the argument and the value.

    Returns:
        ``(layer_types, include, exclude)`` as lists (a bare string is one entry).

    Raises:
        TypeError: an argument of the wrong type (a ``bool`` or string for a float, a non-bool flag).
        ValueError: an argument out of range or not finite, or an empty pattern list.
    """
    check_float("rho", rho, low=0.0, high=1.0, high_open=True)
    check_float("eps1", eps1, low=0.0, low_open=True)
    check_float("eps2", eps2, low=0.0, low_open=True)
    check_choice("statistics", statistics, ("running", "batch"))
    check_bool("bias_correction", bias_correction)
    check_bool("sync_statistics", sync_statistics)
    check_choice("conv_statistics", conv_statistics, ("channel", "column"))
    check_bool("embeddings", embeddings)
    return (
        validate_layer_types(layer_types, layer_kinds()),
        check_patterns("include", include),
        check_patterns("exclude", exclude),
    )


class BNPPreconditioner(ArgumentsRepr):
    """BNP gradient preconditioner for a model's Linear and ConvNd layers (and any registered layer kind).

    Args:
        model: the network; hooks are registered on its selected layers.
        rho: running-average factor ρ ∈ [0, 1).
        eps1: ε1 > 0, relative floor of σ̃² (times max σ²).
        eps2: ε2 > 0, absolute floor of σ̃².
        statistics: ``"running"`` (Alg. 2/3 step 2) or ``"batch"`` (this step's μ_H, σ²_H).
        bias_correction: divide the running averages by 1 − ρ^t (Adam-style warm start) instead
            of the paper's μ = 0, σ² = 1 start (the default, exactly Alg. 2/3), which dominates the first
            ~1/(1−ρ) steps like a learning-rate warm-up. The paper's start is the default because the
            bias-corrected one diverges at the paper's learning rate on the CNN
            (``benchmarks/RESULTS.md`` §5).
        layer_types: which layer kinds to manage: ``Linear`` (with its family: GPT-2's
            ``transformers.Conv1D``), ``Conv1d``, ``Conv2d``, ``Conv3d`` (each with its family: ``ConvTranspose1d``,
            ``ConvTranspose2d``, ``ConvTranspose3d``, which their own names select alone), or any name registered with
            :func:`~lightning_bnp.core.kinds.register_layer_kind`.
        include: glob patterns of layer names to manage (all when ``None``); a bare string is one pattern.
        exclude: glob patterns of layer names to leave alone (a bare string is one pattern).
        sync_statistics: under an initialised ``torch.distributed`` with several processes, pool
            the step's statistics over all ranks so that every rank applies the same P.
        process_group: the group to pool over (default: the world).
        conv_statistics: a convolution's μ, σ² per input channel (``"channel"``, eqs. 21–22: the paper's
            implementation of Alg. 3) or exactly per im2col column, one per input channel and kernel offset
            over the patches that offset sees, padding included (``"column"``, eqs. 19–20: Alg. 2 applied
            to the unfolded input, with Alg. 3's q² = max(c_in·k²/N, √(r·s))). README "What it computes".
        embeddings: also manage every ``nn.Embedding`` (the ``"Embedding"`` layer kind, which naming it in
            ``layer_types`` selects as well): a bias-free Linear on one-hot inputs, σ² each token's frequency,
            q² = max(V/N, 1) (README "Embeddings"). Off by default.
        grouped_kernels: step with the grouped Triton kernels where they can run (float32 statistics on a CUDA
            device with Triton importable): every layer's running state in one launch and every layer's transform in
            one more, instead of a few kernels per layer (docs "Cost"). Off by default: the kernels are tested against
            the pure-torch step under Triton's CPU interpreter, but not yet measured on a GPU. The pure-torch step is
            the CPU path and the reference.

    Raises:
        TypeError: an argument of the wrong type (e.g. ``rho="0.9"``, ``sync_statistics="false"``).
        ValueError: an argument outside its range or not finite, a pattern that matches no layer,
            two selected layers that share a weight but not their bias (or of different kinds: a tied embedding
            and output layer), a ``sparse=True`` embedding, an uninitialised lazy layer, or
            no layer left once the reparametrized ones BNP cannot follow are left alone (README
            "Reparametrized layers"; each of those gets a ``BNPWarning``).
        RuntimeError: a layer is already managed by another attached preconditioner.

    Example (``pre.step(opt)`` instead stores the statistics only if ``opt.step()`` runs)::

        pre = BNPPreconditioner(model)
        for x, y in loader:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            pre.step()
            opt.step()
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        rho: float = 0.99,
        eps1: float = 1e-2,
        eps2: float = 1e-4,
        statistics: StatisticsMode = "running",
        bias_correction: bool = False,
        layer_types: Sequence[str] = DEFAULT_LAYER_TYPES,
        include: Sequence[str] | None = None,
        exclude: Sequence[str] | None = None,
        sync_statistics: bool = True,
        process_group: Any = None,
        conv_statistics: ConvStatistics = "channel",
        embeddings: bool = False,
        grouped_kernels: bool = False,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"`model` must be a torch.nn.Module, got {type(model).__name__}")
        checked = validate_bnp_arguments(
            rho, eps1, eps2, statistics, bias_correction=bias_correction, layer_types=layer_types, include=include,
            exclude=exclude, sync_statistics=sync_statistics, conv_statistics=conv_statistics, embeddings=embeddings,
        )  # fmt: skip
        self.layer_types, self.include, self.exclude = checked
        self.grouped_kernels = check_bool("grouped_kernels", grouped_kernels)
        self.rho, self.eps1, self.eps2, self.statistics = rho, eps1, eps2, statistics
        self.bias_correction, self.conv_statistics, self.embeddings = bias_correction, conv_statistics, embeddings
        self.sync_statistics, self.process_group = sync_statistics, process_group
        # the paper's view folds ε2 into the running ρ^t: decay = ρ^t + ε2/(1 + ε1) (step_math's σ̃² floor)
        self._decay_offset = 0.0 if bias_correction else eps2 / (1.0 + eps1)
        self.layers, self.coverage = manage_layers(
            model, *checked, embeddings=embeddings, rho=rho, bias_correction=bias_correction,
            conv_statistics=conv_statistics, decay_offset=self._decay_offset,
        )  # fmt: skip
        self._layer_list = list(self.layers.values())
        self._warnings, self._masks, self._collection, self._commits, self._step = build_parts(self._layer_list, self)
        self._late: LateLayers | None = LateLayers(
            model, *checked, self._warnings, embeddings=embeddings, layers=self._layer_list
        )
        self.attach()

    _repr_skip = ("model",)
    _repr_if_set = ("conv_statistics", "embeddings", "grouped_kernels")

    def _repr_extra(self) -> list[str]:
        return [f"layers={list(self.layers)!r}", f"attached={self.attached}"]

    # ------------------------------------------------------------------ hooks
    def attach(self) -> None:
        """Register the forward hooks (idempotent).

        Raises:
            RuntimeError: a layer is already managed by another attached preconditioner (the
                gradient would be transformed twice); ``detach()`` that one first.
        """
        self._collection.attach()

    def detach(self) -> None:
        """Remove the forward hooks and the optimizers' commit hooks; drop statistics of an unfinished
        step (forwards that ran before this call never count). Raises the warnings that the last steps'
        statistics still owe (:meth:`flush_warnings`)."""
        self.flush_warnings()
        self._commits.clear()
        self._collection.detach()

    def __getstate__(self) -> dict[str, Any]:
        """For ``pickle`` and ``copy.deepcopy``: what a copy carries and what stays behind,
        :func:`~lightning_bnp.core.parts.pickled_state` (an attached one re-attaches: :meth:`__setstate__`)."""
        return pickled_state(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        restore(self, state)

    @property
    def skipped(self) -> dict[str, str]:
        """Every weight matrix (parameter with ≥ 2 dimensions, by ``named_parameters()`` name) of the model that
        BNP will not transform, with the reason (an unknown layer type, frozen, excluded, used through
        ``F.linear``, reparametrized, an embedding …), as found at construction; trainable ones first."""
        return dict(self.coverage.skipped)

    def report(self, limit: int = 5) -> str:
        """How many of the model's trainable weight matrices BNP transforms, and the first ``limit`` it leaves
        alone with their reasons (all of them in :attr:`skipped`)."""
        return self.coverage.summary(limit)

    @property
    def attached(self) -> bool:
        """Whether the forward hooks are registered (between :meth:`attach` and :meth:`detach`)."""
        return self._collection.attached

    @property
    def collecting(self) -> bool:
        """Whether training forward passes count for the next step now (false inside :meth:`paused`)."""
        return self._collection.collecting

    @property
    def pools_over_ranks(self) -> bool:
        """Whether a step pools its statistics over ranks: ``sync_statistics`` under an initialised
        ``torch.distributed`` whose group (``process_group``, default the world) has more than one rank."""
        return self._step.pools

    @property
    def current_token_mask(self) -> Tensor | None:
        """The token mask the next forward passes read, as given to :meth:`set_token_mask` or :meth:`token_mask`
        (``None``: none)."""
        return self._masks.mask

    @property
    def step_compiled(self) -> bool:
        """Whether :meth:`compile_step` has been called: the step's tensor work runs compiled."""
        return self._step.compiled

    def paused(self) -> AbstractContextManager[None]:
        """Forward passes inside this context do not contribute statistics."""
        return self._collection.paused()

    def token_mask(
        self, mask: Tensor | None, *, layers: Sequence[str] | str | None = None
    ) -> AbstractContextManager[None]:
        """Forward passes inside this context count only the real tokens of their (B, T, …) inputs: μ, σ² and
        N (so q²) of every managed layer are those of the rows ``mask`` marks, as if the padding were not
        there. The previous mask (or none) is restored on exit; :meth:`set_token_mask` sets one without a
        context. Arguments as :meth:`set_token_mask`.

        Example (HF-style ``attention_mask``: 1 = real token)::

            with pre.token_mask(batch["attention_mask"]):
                loss = model(batch["input_ids"], batch["attention_mask"]).loss
            loss.backward()
            pre.step()
        """
        return self._masks.applied(mask, layers=layers)

    def set_token_mask(self, mask: Tensor | None, *, layers: Sequence[str] | str | None = None) -> None:
        """Count only the real tokens in the forward passes from now on (until the next call; ``None``: every
        row counts again). Statistics of a forward are taken at the forward: what happens before the
        backward or the step does not matter.

        Args:
            mask: which positions are real: a bool tensor (True = real) or an integer one (nonzero = real, as
                Hugging Face's ``attention_mask``), shaped as the leading dimensions of each managed layer's
                input: (B, T) for a (B, T, F) input; (T, B) where the model is sequence-first. The *inverse* of
                ``nn.MultiheadAttention``'s ``key_padding_mask`` (True = padding): pass ``~key_padding_mask``.
                A ``nn.MultiheadAttention`` reads the mask in its own layout (its query's leading dimensions;
                ``out_proj`` takes the query's mask), and its key and value projections use the call's own
                ``key_padding_mask`` when it has one (cross-attention: the memory's padding), else the mask.
                ``None``: no mask.
            layers: glob patterns of layer or module names the mask applies to (default: every managed layer);
                the others count every row. E.g. ``"encoder.*"`` to leave out a classifier head that sees one
                pooled row per sequence.

        A jagged nested tensor (``torch.nested``, ``layout=torch.jagged``) needs no mask: its real rows are used.

        Raises:
            TypeError: ``mask`` is not a bool or integer tensor, or ``layers`` is not a string or list of strings.
            ValueError: a pattern matches no layer. At the forward: the mask does not fit a layer's input (the
                error names the layer and both shapes).
        """
        self._masks.set(mask, layers=layers)

    # ------------------------------------------------------------------- step
    def step(self, params: Iterable[Tensor] | Optimizer | None = None) -> None:
        """Precondition the gradients of the layers owning ``params`` (all when ``None``); store the running statistics.

        Given an optimizer, the layers in its parameter groups are transformed and the statistics
        are stored only when ``optimizer.step()`` really runs (from its step post-hook): a step that
        ``torch.amp.GradScaler`` skips for non-finite gradients leaves them untouched, as the
        Lightning callback does. Call it after ``scaler.unscale_(optimizer)``. The optimizer may be wrapped (Lightning's
        ``self.optimizers()``, Fabric's ``fabric.setup``) and may be a new one at every step. Called again for the same
        optimizer before its ``step()``, with no backward since (a ``training_step`` that steps the callback's
        preconditioner itself, and the callback at ``opt.step()``), it does nothing: one transform per step, whichever
        call comes first, and the statistics of the first are stored. Detached (after :meth:`detach`), it transforms
        nothing and warns so, once per detach. A step that finds forwards counted but no gradient in any stepped
        layer's ``.grad`` (``zero_grad()`` before it) transforms nothing and says so.

        Raises:
            TypeError: ``params`` is neither an optimizer, an iterable of parameters nor ``None`` (e.g. DeepSpeed's
                optimizer: DeepSpeed keeps the gradients elsewhere than ``param.grad`` and is not supported).
        """
        if not self.attached:  # (before `defer`: a detached preconditioner hooks no optimizer)
            self._warnings.warn_detached(self._collection.generation, "step")
        elif isinstance(params, Optimizer):
            step_with_optimizer(params, self._layer_list, self._step, self._commits, self._late, self.precondition)
        else:
            self.precondition(checked_params(params), commit=True)

    def compile_step(self, **options: Any) -> BNPPreconditioner:
        """Run the tensor work of every later step — the statistics update (Alg. 2/3 steps 1–3) and the
        transform of the gradients (steps 4–5) — as one ``torch.compile(fullgraph=True)`` graph per set of
        layers stepped together; what is left in Python is bookkeeping (which layers, the pending update).
        ``options`` go to ``torch.compile`` (e.g. ``backend``, ``mode``). Steps with statistics pooled over
        ranks stay eager. Returns ``self``."""
        self._step.compile(**options)
        return self

    def precondition(self, params: Iterable[Tensor] | None = None, *, commit: bool = True) -> PendingUpdate:
        """Transform the current gradients of the layers whose weight is in ``params``.

        Statistics pooled since the previous step are consumed. With ``commit=False`` the running
        statistics are updated only when the returned :class:`PendingUpdate` is committed. A
        gradient that the previous call transformed and no backward has changed since is left as it
        is (with a warning): the transform is applied once per gradient. A detached preconditioner (after
        :meth:`detach`, before :meth:`attach`) transforms nothing and says so, once per detach.
        """
        if not self.attached:
            self._warnings.warn_detached(self._collection.generation, "precondition")
            return PendingUpdate()
        return self._step.precondition(self._layer_list, checked_params(params), commit=commit)

    def flush_warnings(self) -> None:
        """Raise now the warnings about non-finite or overflowing statistics that the steps so far have
        found (normally raised by the next step); waits for the device."""
        self._warnings.flush()

    def step_transforms(self, params: Iterable[Tensor]) -> dict[str, tuple[ManagedLayer, StepTransform]]:
        """``{layer name: (layer, transform)}`` for the layers among ``params`` that the latest
        :meth:`precondition` transformed; parameters not listed have M = I. Several layers may feed row blocks
        of one weight (``nn.MultiheadAttention``'s q, k, v): each transform maps its own rows
        (:attr:`StepTransform.rows`, :attr:`StepTransform.bias_rows`)."""
        return transforms_of(self.layers, params)

    # ------------------------------------------------------------------ state
    def hyperparameters(self) -> dict[str, Any]:
        """The settings that shape the running statistics and P (saved with them); ``conv_statistics`` only
        when a convolution is managed (it shapes nothing else)."""
        return checkpoint.hyperparameters(self.layers, checkpoint.saved_settings(self))

    def state_dict(self) -> dict[str, Any]:
        """Running statistics per layer name (CPU tensors) and the :meth:`hyperparameters` they were made with."""
        return checkpoint.state_dict(self.layers, checkpoint.saved_settings(self))

    def load_state_dict(self, state: dict[str, Any], *, strict: bool = True) -> None:
        """Restore :meth:`state_dict` output: all of it, or nothing on an error. A state saved under another ρ keeps
        the ρ's it applied: μ, σ² of ``running`` and κ(D) stay those P uses.

        Args:
            state: :meth:`state_dict` output.
            strict: the saved layer names must be the managed ones; ``False`` loads the layers both have (the others
                keep their statistics) and names the rest in a ``BNPWarning``.

        Raises:
            ValueError: the saved layer names differ from the managed ones (``strict``), a saved layer was another
                kind (a Conv1d's statistics for a Conv2d), a layer's saved statistics have another length (e.g.
                per-channel ones saved under ``conv_statistics="channel"`` loaded into ``"column"``: they cannot be
                converted), or are not finite; the error names the layer, and nothing is loaded then.
        """
        checkpoint.load_state_dict(
            self.layers, state, checkpoint.saved_settings(self), strict=check_bool("strict", strict)
        )
