"""Batch Normalization Preconditioning for plain PyTorch (paper 000, Alg. 2 and Alg. 3).

:class:`BNPPreconditioner` watches the inputs of a model's Linear/ConvNd layers with forward
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

Which forward calls count. A forward call's statistics count for the step once the backward pass
reaches its output (a pre-hook on the output's autograd node): a forward whose output gets no
gradient — a ``training_step`` that returns ``None`` after the forward, an output used only for
logging — adds nothing, and the forward that non-reentrant activation checkpointing recomputes
during the backward is not counted twice (its recomputed graph is never back-propagated).

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

import math
import types
import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_bnp.core.arguments_repr import ArgumentsRepr
from lightning_bnp.core.attention import capturing, stop_capturing
from lightning_bnp.core.copies import register_forward_hook, register_forward_pre_hook
from lightning_bnp.core.coverage import Coverage, coverage
from lightning_bnp.core.kinds import EMBEDDING, layer_kinds, select_layer_kinds
from lightning_bnp.core.layers import NO_LEAF, BNPWarning, ManagedLayer, StepTransform, make_layers
from lightning_bnp.core.layout import FeatureLayout
from lightning_bnp.core.model_scan import scan_model
from lightning_bnp.core.reparametrization import manageable, unsupported
from lightning_bnp.core.selection import DEFAULT_LAYER_TYPES, validate_layer_types
from lightning_bnp.core.stack import user_stacklevel
from lightning_bnp.core.statistics import Moments, RunningStatistics, ema_update
from lightning_bnp.core.transform import precondition_scaled_, q_squared, var_tilde
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


# module → the attached preconditioner that manages it (so that a second one is refused)
_OWNERS: weakref.WeakKeyDictionary[nn.Module, weakref.ref[BNPPreconditioner]] = weakref.WeakKeyDictionary()


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


@dataclass
class PendingUpdate:
    """Running-statistics updates computed by a step but not yet stored.

    The Lightning callback commits them from the optimizer's step post-hook, so a step that the
    ``GradScaler`` skips (non-finite gradients) leaves the statistics untouched.
    """

    # (statistics, (m, v, t, ρ^t)): t and ρ^t as (1,) device tensors
    items: list[tuple[RunningStatistics, tuple[Tensor, Tensor, Tensor, Tensor]]] = field(default_factory=list)

    def commit(self) -> None:
        for running, state in self.items:
            running.assign(*state)
        self.items.clear()


_NEVER_RAN = (
    "has a gradient but its forward never ran in training mode, or the backward never reached its output, "
    "since the last step (e.g. its parent uses its weight through F.linear: teach BNP with "
    "lightning_bnp.core.attention.register_functional_linear; or "
    "torch.compile reused a graph compiled without BNP's hooks: README 'Cost'); its gradient is left "
    "untransformed (with statistics pooled over ranks, `sync_statistics`: transformed with the statistics of the "
    "ranks that ran it, untransformed only if none did). Exclude it with `exclude` to silence this warning."
)
_TWICE = (
    "its gradient was already preconditioned by the previous step() and no backward has changed it "
    "since; it is left as it is (one transform per gradient). Call step() once per backward."
)
_REPARAMETRIZED = (
    "was reparametrized after BNP was set up, and BNP leaves it alone from this step on (its gradient is "
    "not transformed and its statistics are not updated)"
)
_NON_FINITE = (
    "a step's input statistics were not finite (a NaN or Inf in the batch); its running statistics "
    "are not updated in such a step and P uses the ones stored before it."
)
_NON_FINITE_BATCH = (
    "a step's input statistics were not finite (a NaN or Inf in the batch); with statistics='batch' that "
    "step's P, and so the layer's gradient, is not finite."
)


_OVERFLOW = (
    "the step's input variance σ²_H overflows {dtype} (finite inputs of magnitude above ~{root:.1e}, whose "
    "squares are not representable); it is saturated at {ceiling:.1e} for that step, so σ² and P of this layer "
    "are not exact while inputs stay that large. Rescale the layer's input (normalize the data), or use float64."
)


def _ceiling(dtype: torch.dtype) -> float:
    """The largest σ²_H a step stores: far enough below the dtype's maximum that σ̃² and q²·σ̃² stay finite
    (q² up to 2^24)."""
    return torch.finfo(dtype).max * 2.0**-24


def _is_zero(count: int | Tensor) -> bool:
    """Whether a local count is 0 (local counts are host ints; a tensor one is never read)."""
    return isinstance(count, int) and count == 0


def _host_copy(flat: Tensor) -> tuple[Tensor, torch.cuda.Event | None]:
    """A host copy of a small device vector that never makes the host wait: on CUDA a non-blocking copy
    into pinned memory and an event that says when it has arrived; on the CPU the vector itself."""
    if flat.device.type != "cuda":
        return flat, None
    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done


@dataclass(frozen=True)
class _StepConfig:
    """What shapes a step's tensor work besides its tensors (constants of a compiled step)."""

    running: bool
    bias_correction: bool
    rho: float
    eps1: float
    eps2: float
    one_row: tuple[int, ...]  # layers whose σ²_H follows the N = 1 rule (or may, where the count is pooled)
    # the transform's entries: (first layer, layers) each, a run of n > 1 layers being the n row blocks of one
    # weight (LayerKind.row_block); their features and groups (n for such a run)
    spans: tuple[tuple[int, int], ...]
    sizes: tuple[int, ...]
    groups: tuple[int, ...]


def _count(count: int | Tensor, device: torch.device) -> Tensor:
    return torch.as_tensor(count, dtype=torch.float64, device=device)


def _step_math(
    layout: FeatureLayout,
    config: _StepConfig,
    means: list[Tensor],
    variances: list[Tensor],
    running_mus: list[Tensor],
    before: Tensor | None,
    steps_before: Tensor | None,
    counts: Tensor | None,
    fan_in: Tensor | None,
    q2_flat: Tensor | None,
    q2s: list[Any],
    grads_w: list[Tensor],
    grads_b: list[Tensor | None],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The tensor work of one step for a group of layers (Alg. 2/3 steps 1–5), without a single read back to
    the host, and traceable whole by ``torch.compile(fullgraph=True)``.

    The running state is one vector ``[m ; v ; d]`` (d = ρ^t + κ per layer, κ = ε2/(1 + ε1) in the paper's view
    and 0 with bias correction: :class:`~lightning_bnp.core.statistics.RunningStatistics`) with step counts
    ``steps_before``.
    ``counts``: (rows, samples, out positions) per layer when they were pooled over ranks (then q² is built
    here, and a layer that no rank ran keeps its state and gets M = I); else ``q2_flat`` and ``q2s`` are given.
    ``grads_w``, ``grads_b`` and ``q2s`` are per entry of the transform (``config.spans``): one per layer, or
    one for the n row blocks of one weight (the whole gradient and bias gradient, q² one float or (n, 1)).

    Returns:
        (μ, σ̃², state after, steps after, per-layer max σ²_H before saturation, q² per layer when pooled);
        the gradients are transformed in place.
    """
    total = layout.total
    # [μ_H ; σ²_H ; κ] of every layer (κ: the batch value of d = ρ^t + κ, so that d − κ ← ρ·(d − κ) in the same update)
    batch = torch.cat(means + variances + ([layout.decay_target] if config.running else []))
    mu_h, var_h = batch[:total], batch[total : 2 * total]
    for i, running_mu in zip(config.one_row, running_mus):  # N = 1: σ²_H = (h − μ)², μ before the update
        part = layout.slice(i)
        one_row = (mu_h[part] - running_mu.to(mu_h.dtype)).square()
        # pooled over ranks the count is on the device: the rule applies where it is 1
        var_h[part] = one_row if counts is None else torch.where(counts[i, 0] == 1, one_row, var_h[part])
    if layout.uncentred_mask is not None:  # no bias: uncentred second moment σ²_H + μ_H², and μ stays 0
        mu_uncentred = mu_h * layout.uncentred_mask
        var_h.addcmul_(mu_uncentred, mu_uncentred)
        mu_h.sub_(mu_uncentred)
    ran = None
    if counts is not None:  # pooled over ranks: a layer no rank ran keeps its state and gets M = I
        ran = (counts[:, 0] > 0).index_select(0, layout.owner)
        var_h.copy_(torch.where(ran, var_h, math.nan))
    # per layer max σ²_H: NaN when a sample was NaN or ±Inf (σ²_H is computed from centred values, so a
    # non-finite μ_H makes it NaN too), +Inf when finite inputs' squares overflow the dtype
    peak = layout.segment_max(var_h)
    var_h.clamp_(max=layout.ceiling)  # an overflowed σ²_H saturates (the warning says so): _ceiling
    if not config.running:
        mu, var_t = mu_h, var_tilde(var_h, config.eps1, config.eps2, maxima=layout.layer_max(var_h))
        after = steps = peak
    else:
        assert before is not None and steps_before is not None
        after = ema_update(before, batch, config.rho)  # [m ; v ; d] ← ρ[m ; v ; d] + (1−ρ)[μ_H ; σ²_H ; κ]
        # a layer whose moments are not finite keeps its state (and step count): P uses what was stored
        finite = torch.eq(peak, peak)
        after = torch.where(finite.index_select(0, layout.state_owner), after, before)
        steps = steps_before + finite
        mean_acc, var_acc, decay = after[:total], after[total : 2 * total], after[2 * total :]
        if config.bias_correction:  # μ = m/(1 − ρ^t), σ² = v/(1 − ρ^t)
            scale = torch.reciprocal(1.0 - decay).index_select(0, layout.owner)
            mu, var = mean_acc * scale, var_acc * scale
            var_t = var_tilde(var, config.eps1, config.eps2, maxima=layout.layer_max(var))
        else:  # the paper's view σ² = v + ρ^t; σ̃² = σ² + ε1·max σ² + ε2 = v + ε1·(max v + ρ^t·(1 + ε1)/ε1 + ε2/ε1)
            # = v + ε1·(max v + d·(1 + ε1)/ε1) with d = ρ^t + ε2/(1 + ε1): the ε2 term rides in d (one op less)
            floor = torch.add(layout.segment_max(var_acc), decay, alpha=(1.0 + config.eps1) / config.eps1)
            mu, var_t = mean_acc, torch.add(var_acc, floor.index_select(0, layout.owner), alpha=config.eps1)
    q2_out = peak
    if counts is not None:
        assert ran is not None and fan_in is not None
        per_sample = counts[:, 1].clamp_min(1.0)
        q2 = torch.maximum(fan_in / per_sample, (counts[:, 2] / per_sample).sqrt())
        q2_out = torch.where(counts[:, 0] > 0, q2, 1.0).to(mu.dtype)
        q2_flat = q2_out.index_select(0, layout.owner)
        q2s = [q2_out[i] if n == 1 else q2_out[i : i + n].view(n, 1) for i, n in config.spans]
        mu, var_t = torch.where(ran, mu, 0.0), torch.where(ran, var_t, 1.0)
        # no rank ran it (or it saw no row, e.g. an embedding fed only padding): nothing was not finite
        peak = torch.where(counts[:, 0] > 0, peak, 0.0)
    assert q2_flat is not None
    mus = [m if grad_b is not None else None for m, grad_b in zip(mu.split_with_sizes(config.sizes), grads_b)]
    scales = (var_t * q2_flat).split_with_sizes(config.sizes)  # q²σ̃², all layers in one product
    precondition_scaled_(grads_w, grads_b, mus, scales, q2s, list(config.groups))
    return mu, var_t, after, steps, peak, q2_out


def _whole_bias_grad(layer: ManagedLayer) -> Tensor | None:
    bias = layer.kind.bias(layer.module) if layer.has_bias else None
    return None if bias is None else bias.grad


def _row_block_runs(layers: list[ManagedLayer]) -> tuple[tuple[int, int], ...]:
    """Runs (first layer, n) of ``layers`` that are the n row blocks of one weight in order
    (:meth:`LayerKind.row_block`, the q, k, v of a MultiheadAttention): fixed for a set of layers."""
    runs, i = [], 0
    while i < len(layers):
        layer = layers[i]
        block = None if layer.kind.same_rows else layer.kind.row_block(layer.module)
        n = block[1] if block is not None and block[0] == 0 else 1
        run = layers[i : i + n]
        if n > 1 and len(run) == n:
            if all(
                other.module is layer.module and other.kind.row_block(other.module) == (j, n)
                for j, other in enumerate(run)
            ):
                runs.append((i, n))
                i += n
                continue
        i += 1
    return tuple(runs)


def _row_block_spans(
    runs: tuple[tuple[int, int], ...],
    ready: list[tuple[ManagedLayer, Moments, Tensor]],
    grads_b: list[Tensor | None],
    q2s: list[float] | None,
) -> tuple[tuple[int, int], ...]:
    """The transform's entries as (first layer, layers): one per layer, except a run of n row blocks of one weight
    (``runs``, :func:`_row_block_runs`), which the step transforms as one grouped matrix, each block with its own μ
    and σ̃² (exact whatever their statistics are). Such a run needs one plain gradient tensor for its blocks, bias
    gradients for all blocks or none (then one plain tensor of n·out rows), and, where q² is a host float
    (``q2s``), one q² for the n blocks (the bias update's scalar)."""
    if not runs:
        return tuple((i, 1) for i in range(len(ready)))
    spans: list[tuple[int, int]] = []
    i = 0
    for first, n in runs:
        spans.extend((j, 1) for j in range(i, first))
        i = first + n
        if _row_blocks_fit(ready[first:i], grads_b[first:i], None if q2s is None else q2s[first:i]):
            spans.append((first, n))
        else:
            spans.extend((j, 1) for j in range(first, i))
    spans.extend((j, 1) for j in range(i, len(ready)))
    return tuple(spans)


def _row_blocks_fit(
    run: list[tuple[ManagedLayer, Moments, Tensor]], grads_b: list[Tensor | None], q2s: list[float] | None
) -> bool:
    first, _, grad = run[0]
    if type(grad) is not Tensor or grad.dim() != 2 or any(g is not grad for _, _, g in run):
        return False
    if q2s is not None and any(q2 != q2s[0] for q2 in q2s):
        return False
    if all(grad_b is None for grad_b in grads_b):
        return True
    whole = _whole_bias_grad(first)
    return (
        all(grad_b is not None for grad_b in grads_b)
        and type(whole) is Tensor
        and tuple(whole.shape) == (grad.shape[0],)
        and all(_whole_bias_grad(layer) is whole for layer, _, _ in run)
    )


def _shared_moments(shared: list[Any], kind: Any, module: nn.Module, h: Tensor, out: Tensor) -> Moments:
    """Moments of ``h``, reduced once for the q, k and v layers of a self-attention (one tensor, one reduction
    of the same kind class): ``shared[0]`` keeps the latest with a weak reference to its input and version."""
    last, reduce = shared[0], type(kind).moments
    if last is not None and last[0]() is h and last[1] == h._version and last[2] is reduce and last[3] is module:
        return last[4]
    part = kind.moments(module, h, out)
    shared[0] = (weakref.ref(h), h._version, reduce, module, part)
    return part


def _names_of(layer: ManagedLayer) -> tuple[str, ...]:
    """A layer's name, its module's (``attn`` for ``attn.q``) and those of modules tied to it."""
    suffix = layer.kind.suffix
    module = layer.name[: -len(suffix)] if suffix and layer.name.endswith(suffix) else layer.name
    return (layer.name, module, *layer.tied)


def _jagged_rows(layer: ManagedLayer, module: nn.Module, h: Tensor) -> Tensor:
    """The real rows of a nested input: a jagged nested tensor's ``values()`` (Σ lengths, …, F), every row a
    token, no padding.

    Raises:
        ValueError: a nested tensor of another layout (torch.strided), or a layer whose rows are not tokens.
    """
    if h.layout != torch.jagged or not layer.kind.dense:
        raise ValueError(
            f"BNP layer {layer.name!r} ({type(module).__name__}) got a nested tensor of layout {h.layout} "
            f"({h.size(0)} sequences); BNP reads the real rows of a jagged one (torch.nested.nested_tensor(..., "
            "layout=torch.jagged)) into a dense layer (Linear and its kinds). Pass a jagged nested tensor, or a "
            "padded tensor with `token_mask`, or exclude the layer with `exclude`"
        )
    return h.values()


def _local_rows(layer: ManagedLayer, grad: Tensor) -> Tensor:
    """The rows of a gradient this rank holds: ``grad`` itself, or for a ``DTensor`` (FSDP2's ``fully_shard``) its
    local shard — rows of the weight (``Shard(0)``: BNP's transform is row-local and uses the full-width statistics
    pooled over ranks, README "Large models") or all of it (``Replicate``). In-place updates of the shard update the
    DTensor.

    Raises:
        ValueError: another sharding (tensor parallelism splits a row over ranks, or shards the rows of a layer
            whose rows are not its weight's dim 0: a transposed weight, a grouped convolution).
    """
    to_local = getattr(grad, "to_local", None)
    if to_local is None:
        return grad
    placements = getattr(grad, "placements", ())
    sharded = [p for p in placements if not p.is_replicate()]
    if sharded and (
        any(not p.is_shard(0) for p in sharded) or not layer.kind.same_rows or layer.groups != 1 or len(sharded) > 1
    ):
        raise ValueError(
            f"BNP layer {layer.name!r} ({type(layer.module).__name__}): its gradient is a DTensor with placements "
            f"{tuple(placements)}; BNP transforms a layer sharded by rows (FSDP2's fully_shard: Shard(0) of an "
            "nn.Linear or ungrouped ConvNd weight, on a 1-D data-parallel mesh) or replicated. Tensor parallelism, "
            "a transposed weight (GPT-2's Conv1D) or a grouped convolution sharded by rows are not supported: "
            "exclude the layer with `exclude`, or shard it with fully_shard only."
        )
    with torch.no_grad():
        local: Tensor = to_local()
    return local


def _parameters(optimizer: Optimizer) -> list[Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


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
            ``transformers.Conv1D``), ``Conv1d``, ``Conv2d``, ``Conv3d``, or any name registered with
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
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"`model` must be a torch.nn.Module, got {type(model).__name__}")
        layer_types, include, exclude = validate_bnp_arguments(
            rho,
            eps1,
            eps2,
            statistics,
            bias_correction=bias_correction,
            layer_types=layer_types,
            include=include,
            exclude=exclude,
            sync_statistics=sync_statistics,
            conv_statistics=conv_statistics,
            embeddings=embeddings,
        )
        self.rho, self.eps1, self.eps2 = rho, eps1, eps2
        self.embeddings = embeddings
        self.conv_statistics = conv_statistics
        self.layer_types, self.include, self.exclude = layer_types, include, exclude
        self.statistics = statistics
        self.bias_correction = bias_correction
        self.sync_statistics = sync_statistics
        self.process_group = process_group
        if embeddings and EMBEDDING not in layer_types:
            layer_types = [*layer_types, EMBEDDING]
        scan = scan_model(model, layer_types)  # the model read once: kinds and claims, for all three below
        chosen = select_layer_kinds(scan, include, exclude)
        kept = manageable({name: module for name, (module, _) in chosen.items()}, BNPWarning)
        selected = {name: chosen[name] for name in kept}
        # the paper's view folds ε2 into the running ρ^t: decay = ρ^t + ε2/(1 + ε1) (_step_math's σ̃² floor)
        self._decay_offset = 0.0 if bias_correction else eps2 / (1.0 + eps1)
        self.layers: dict[str, ManagedLayer] = make_layers(
            scan,
            selected,
            rho=rho,
            bias_correction=bias_correction,
            conv_statistics=conv_statistics,
            decay_offset=self._decay_offset,
        )
        self._layer_list = list(self.layers.values())
        self.coverage: Coverage = coverage(scan, self._layer_list, include, exclude)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._collecting = True
        self._generation = 0  # bumped by detach(): forwards from before it never count
        self._warned: set[tuple[str, str]] = set()
        self._pending: dict[int, PendingUpdate] = {}  # per optimizer, committed by its step post-hook
        self._commit_hooks: dict[int, torch.utils.hooks.RemovableHandle] = {}
        self._layouts: dict[tuple[Any, ...], FeatureLayout] = {}
        # per step: the layers and a host copy of their per-layer max σ²_H, read by a later step (_report)
        self._unreported: list[tuple[list[ManagedLayer | None], tuple[Tensor, torch.cuda.Event | None]]] = []
        self._not_run_here: set[str] = set()  # this step's layers whose forward did not run on this rank
        self._compiled: Any = None  # _step_math compiled (compile_step), or None: eager
        self._compile_options: dict[str, Any] | None = None  # compile_step's options (a copy compiles its own)
        self._token_mask: Tensor | None = None  # set_token_mask / token_mask: True = a real token
        self._mask_layers: frozenset[str] | None = None  # the layers it applies to (None: all)
        self._mask_layer_sets: dict[tuple[str, ...], frozenset[str]] = {}  # `layers` patterns → layer names
        self.attach()

    _repr_skip = ("model",)
    _repr_if_set = ("conv_statistics", "embeddings")
    # class defaults for an object pickled before these existed (its running ρ^t has no offset)
    embeddings = False
    _decay_offset = 0.0

    def _repr_extra(self) -> list[str]:
        return [f"layers={list(self.layers)!r}", f"attached={self.attached}"]

    # ------------------------------------------------------------------ hooks
    def attach(self) -> None:
        """Register the forward hooks (idempotent).

        Raises:
            RuntimeError: a layer is already managed by another attached preconditioner (the
                gradient would be transformed twice); ``detach()`` that one first.
        """
        if self._handles:
            return
        taken = {
            name: owner
            for layer in self.layers.values()
            for name, module in layer.modules.items()
            if (owner := _OWNERS.get(module)) is not None and owner() is not None and owner() is not self
        }
        if taken:
            raise RuntimeError(
                f"layers {sorted(taken)} are already managed by another attached BNPPreconditioner (or "
                "BatchNormPreconditioning callback); two would transform the gradients twice. Call "
                "`.detach()` on the other one first."
            )
        shared: list[Any] = [None]  # attention's q, k, v layers share one reduction of one tensor
        for layer in self.layers.values():
            for module in layer.modules.values():
                _OWNERS[module] = weakref.ref(self)
                if layer.kind.captures or not layer.kind.default_calls:  # attention (core/attention.py)
                    self._handles.extend(self._register_calls_hooks(layer, module, shared))
                    continue
                self._handles.append(register_forward_hook(module, self._make_hook(layer), with_kwargs=True))

    def detach(self) -> None:
        """Remove the forward hooks and the optimizers' commit hooks; drop statistics of an unfinished
        step (forwards that ran before this call never count). Raises the warnings that the last steps'
        statistics still owe (:meth:`flush_warnings`)."""
        self.flush_warnings()
        for handle in [*self._handles, *self._commit_hooks.values()]:
            handle.remove()
        self._handles.clear()
        self._commit_hooks.clear()
        self._pending.clear()
        self._generation += 1
        for layer in self.layers.values():
            layer.moments = None
            for module in layer.modules.values():
                owner = _OWNERS.get(module)
                if owner is not None and owner() is self:
                    del _OWNERS[module]

    def __getstate__(self) -> dict[str, Any]:
        """For ``pickle`` and ``copy.deepcopy``: hook handles, pending commits and caches stay behind (a copy of the
        model carries no BNP hooks: ``core/copies.py``); an attached preconditioner re-attaches to its copied
        modules in :meth:`__setstate__`."""
        if self.process_group is not None:
            raise TypeError(
                "a BNPPreconditioner with an explicit `process_group` cannot be pickled or copied (a process "
                "group is bound to this process); build a new one in the other process"
            )
        state = dict(self.__dict__)
        state.update(_handles=[], _commit_hooks={}, _pending={}, _layouts={}, _was_attached=self.attached)
        # a compiled function and CUDA events do not copy: a copy compiles its own step, and warnings still owed
        # for past steps are the original's to raise
        state.update(_compiled=None, _unreported=[], _token_mask=None, _mask_layers=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        attached = state.pop("_was_attached", False)
        self.__dict__.update(state)
        if self._compile_options is not None:
            self.compile_step(**self._compile_options)
        if attached:
            self.attach()

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
        return bool(self._handles)

    @property
    def collecting(self) -> bool:
        """Whether training forward passes count for the next step now (false inside :meth:`paused`)."""
        return self._collecting

    @property
    def pools_over_ranks(self) -> bool:
        """Whether a step pools its statistics over ranks: ``sync_statistics`` under an initialised
        ``torch.distributed`` whose group (``process_group``, default the world) has more than one rank."""
        return self._distributed()

    @property
    def step_compiled(self) -> bool:
        """Whether :meth:`compile_step` has been called: the step's tensor work runs compiled."""
        return self._compiled is not None

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Forward passes inside this context do not contribute statistics."""
        previous, self._collecting = self._collecting, False
        try:
            yield
        finally:
            self._collecting = previous

    @contextmanager
    def token_mask(self, mask: Tensor | None, *, layers: Sequence[str] | str | None = None) -> Iterator[None]:
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
        previous = self._token_mask, self._mask_layers
        self.set_token_mask(mask, layers=layers)
        try:
            yield
        finally:
            self._token_mask, self._mask_layers = previous

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
        if mask is not None:
            if not isinstance(mask, Tensor) or mask.dtype.is_floating_point or mask.dtype.is_complex:
                described = f"a tensor of dtype {mask.dtype}" if isinstance(mask, Tensor) else type(mask).__name__
                raise TypeError(
                    "`mask` must be a bool tensor (True = real token) or an integer one (nonzero = real token), "
                    f"got {described}"
                )
            if mask.dim() == 0:
                raise ValueError(
                    f"`mask` needs the leading dimensions of the layers' inputs, got shape {tuple(mask.shape)}"
                )
            mask = mask if mask.dtype == torch.bool else mask != 0
        chosen = None
        if layers is not None:
            patterns = check_patterns("layers", layers)
            assert patterns is not None
            chosen = self._mask_layer_sets.get(tuple(patterns))  # the callback sets one per batch
            if chosen is None:
                chosen = self._mask_layer_sets[tuple(patterns)] = self._layers_matching(patterns)
        self._token_mask, self._mask_layers = mask, chosen

    def _layers_matching(self, patterns: list[str]) -> frozenset[str]:
        chosen: set[str] = set()
        for pattern in patterns:
            matched = {
                layer.name for layer in self._layer_list if any(fnmatchcase(name, pattern) for name in _names_of(layer))
            }
            if not matched:
                raise ValueError(f"`layers` pattern {pattern!r} matches no BNP layer; layers are {list(self.layers)}")
            chosen |= matched
        return frozenset(chosen)

    def _moments_of(
        self,
        layer: ManagedLayer,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        h: Tensor,
        output: Any,
    ) -> Moments | None:
        """The moments of one call under a token mask or of a nested input; ``None`` for the usual case (no mask
        applies, a dense input): the caller reduces it as always."""
        mask = self._token_mask
        if mask is not None and (self._mask_layers is None or layer.name in self._mask_layers):
            if h.is_nested:
                raise ValueError(
                    f"BNP layer {layer.name!r} ({type(module).__name__}) got a nested tensor while a token mask of "
                    f"shape {tuple(mask.shape)} is set: a nested tensor holds no padding (its real rows are used "
                    "without a mask); leave this layer out of the mask with `layers`"
                )
            real = layer.kind.token_rows(module, args, kwargs, h, mask)
            if real is None:
                raise ValueError(
                    f"BNP layer {layer.name!r} ({type(module).__name__}): the token mask of shape "
                    f"{tuple(mask.shape)} does not fit its input of shape {tuple(h.shape)} (the mask needs the "
                    "input's leading dimensions; a MultiheadAttention's, those of its query, key or value). Pass "
                    "the mask in the layout this layer sees, or leave the layer out with "
                    "`token_mask(mask, layers=...)`"
                )
            return layer.kind.masked_moments(module, h, output, real)
        if h.is_nested:
            return layer.kind.moments(module, _jagged_rows(layer, module, h), output)
        return None

    def _make_hook(self, layer: ManagedLayer) -> Any:
        kind = layer.kind
        moments, layer_input, default_input, input_name = kind.moments, kind.input, kind.default_input, kind.input_name

        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            # statistics only from training forward passes that build a graph for a gradient
            if not (self._collecting and module.training and torch.is_grad_enabled() and layer.weight.requires_grad):
                return
            if default_input:  # forward(input): inline, as it runs at every forward call
                h = args[0] if args else kwargs.get(input_name)
            else:
                h = layer_input(module, args, kwargs)
            if not isinstance(h, Tensor) or not isinstance(output, Tensor):
                return
            special = None
            if self._token_mask is not None or h.is_nested:  # token masks, jagged rows
                special = self._moments_of(layer, module, args, kwargs, h, output)
            if torch.compiler.is_compiling():  # traced: counted at the forward (README, "torch.compile")
                part = moments(module, h, output) if special is None else special
                layer.moments = part if layer.moments is None else layer.moments.merge(part)
                return
            node = output.grad_fn
            if node is None:
                return
            part = moments(module, h, output) if special is None else special  # on h.detach(): records no graph
            node.register_prehook(self._count_when_reached(layer, part))

        return hook

    def _register_calls_hooks(
        self, layer: ManagedLayer, module: nn.Module, shared: list[Any]
    ) -> list[torch.utils.hooks.RemovableHandle]:
        """Hooks of a kind whose forward yields several (input, output) pairs (:meth:`LayerKind.calls`), or whose
        input is captured from an ``F.linear`` call made during the forward (:attr:`LayerKind.captures`)."""
        kind, handles = layer.kind, []
        started: list[Tensor] = []

        def recording() -> bool:
            return self._collecting and module.training and torch.is_grad_enabled() and layer.weight.requires_grad

        if kind.captures:

            def pre_hook(module: nn.Module, args: tuple[Any, ...]) -> None:
                if recording():
                    weight = kind.watched(module)  # type: ignore[attr-defined]
                    capturing(weight)
                    started.append(weight)

            handles.append(register_forward_pre_hook(module, pre_hook))

        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if kind.captures:
                if not started:
                    return
                calls = stop_capturing(started.pop())
                if output is None:  # the forward raised (an always_call hook)
                    return
            elif recording():
                calls = kind.calls(module, args, kwargs, output)
            else:
                return
            for h, out in calls:
                if not isinstance(h, Tensor) or not isinstance(out, Tensor):
                    continue
                special = None
                if self._token_mask is not None or h.is_nested:  # token masks, jagged rows
                    special = self._moments_of(layer, module, args, kwargs, h, out)
                if torch.compiler.is_compiling():  # traced: counted at the forward (README, "torch.compile")
                    part = kind.moments(module, h, out) if special is None else special
                    layer.moments = part if layer.moments is None else layer.moments.merge(part)
                elif out.grad_fn is not None:
                    part = _shared_moments(shared, kind, module, h, out) if special is None else special
                    out.grad_fn.register_prehook(self._count_when_reached(layer, part))

        handles.append(register_forward_hook(module, hook, with_kwargs=True, always_call=kind.captures))
        return handles

    def _count_when_reached(self, layer: ManagedLayer, part: Moments) -> Any:
        """A pre-hook for the output's autograd node: the forward's statistics join the step when the
        backward pass reaches the output (once, however often the graph is back-propagated)."""
        generation, counted = self._generation, False

        def count(grad_outputs: tuple[Tensor | None, ...]) -> None:
            nonlocal counted
            if counted or generation != self._generation:
                return
            counted = True
            layer.moments = part if layer.moments is None else layer.moments.merge(part)

        return count

    # ------------------------------------------------------------------- step
    def step(self, params: Iterable[Tensor] | Optimizer | None = None) -> None:
        """Precondition the gradients of the layers owning ``params`` (all when ``None``) and store
        the updated running statistics.

        Given an optimizer, the layers in its parameter groups are transformed and the statistics
        are stored only when ``optimizer.step()`` really runs (from its step post-hook): a step that
        ``torch.amp.GradScaler`` skips for non-finite gradients leaves them untouched, as the
        Lightning callback does. Call it after ``scaler.unscale_(optimizer)``.
        """
        if isinstance(params, Optimizer):
            self._pending[id(params)] = self.precondition(_parameters(params), commit=False)
            if id(params) not in self._commit_hooks:
                self._commit_hooks[id(params)] = params.register_step_post_hook(self._commit)
        else:
            self.precondition(params, commit=True)

    def compile_step(self, **options: Any) -> BNPPreconditioner:
        """Run the tensor work of every later step — the statistics update (Alg. 2/3 steps 1–3) and the
        transform of the gradients (steps 4–5) — as one ``torch.compile(fullgraph=True)`` graph per set of
        layers stepped together; what is left in Python is bookkeeping (which layers, the pending update).
        ``options`` go to ``torch.compile`` (e.g. ``backend``, ``mode``). Steps with statistics pooled over
        ranks stay eager. Returns ``self``."""
        # a copy of the function with its own code object: Dynamo keeps its compiled graphs (and counts
        # recompilations) per code object, so every preconditioner gets its own
        # (defaults and closure too: the same function when `_step_math` is wrapped, e.g. by mutmut's trampoline)
        own = types.FunctionType(
            _step_math.__code__.replace(),
            _step_math.__globals__,
            "_step_math",
            _step_math.__defaults__,
            _step_math.__closure__,
        )
        self._compiled = torch.compile(own, fullgraph=True, **options)
        self._compile_options = dict(options)
        return self

    def _commit(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        pending = self._pending.pop(id(optimizer), None)
        if pending is not None:
            pending.commit()

    def precondition(self, params: Iterable[Tensor] | None = None, *, commit: bool = True) -> PendingUpdate:
        """Transform the current gradients of the layers whose weight is in ``params``.

        Statistics pooled since the previous step are consumed. With ``commit=False`` the running
        statistics are updated only when the returned :class:`PendingUpdate` is committed. A
        gradient that the previous call transformed and no backward has changed since is left as it
        is (with a warning): the transform is applied once per gradient.
        """
        self._report()
        if params is None:
            layers = self._layer_list
        else:
            ids = {id(p) for p in params}
            layers = [layer for layer in self.layers.values() if id(layer.weight) in ids or self._left_alone(layer)]
        # a layer with no gradient this step did not contribute to it: its statistics are dropped
        active, grads = [], []
        for layer in layers:
            grad = layer.weight.grad
            grad = grad if grad is None or type(grad) is Tensor else _local_rows(layer, grad)
            if grad is None:
                self._left_alone(layer)
            elif not self._transformed_already(layer, grad):
                active.append(layer)
                grads.append(grad)
        ran_here = [layer.moments is not None and not _is_zero(layer.moments.rows) for layer in active]
        self._not_run_here = {layer.name for layer, ran in zip(active, ran_here) if not ran}
        pooled = self._pool(active)
        for layer in layers:
            layer.moments = None
            layer.transform = None
        pending = PendingUpdate()
        ready = []
        for layer, m, grad, ran in zip(active, pooled, grads, ran_here):
            # pooled over ranks, the count is on the device: a layer no rank ran gets M = I there (_transform)
            if isinstance(m.rows, Tensor) or m.rows > 0:
                ready.append((layer, m, grad))
            if not ran:
                self._warn(layer, "never ran", _NEVER_RAN)
        groups: dict[tuple[torch.device, torch.dtype], list[tuple[ManagedLayer, Moments, Tensor]]] = {}
        for item in ready:  # one flat layout per device and dtype (usually a single group)
            groups.setdefault((item[1].mean.device, item[1].mean.dtype), []).append(item)
        for group in groups.values():
            self._transform(group, pending)
        if commit:
            pending.commit()
        return pending

    def _left_alone(self, layer: ManagedLayer) -> bool:
        """False; names (once) a layer reparametrized since setup in a way BNP cannot follow (README
        'Reparametrized layers'): its weight leaf is then ``NO_LEAF`` and it is skipped like a frozen layer."""
        if layer.weight is NO_LEAF:
            self._warn(layer, "reparametrized", f"{_REPARAMETRIZED}: {unsupported(layer.module)}.")
        return False

    def _transformed_already(self, layer: ManagedLayer, grad: Tensor) -> bool:
        """Whether the weight's gradient is the one the previous step transformed, unchanged since."""
        done = layer.transformed_grad
        if done is None or done[0]() is not grad or grad._version != done[1]:
            return False
        self._warn(layer, "twice", _TWICE)
        return True

    def _transform(self, ready: list[tuple[ManagedLayer, Moments, Tensor]], pending: PendingUpdate) -> None:
        """Steps 2–4 for every layer of the step at once (flat statistics, ``torch._foreach_*`` gradients): the
        bookkeeping here, the tensor work in :func:`_step_math` (compiled whole with ``compile_step``)."""
        layout = self._layout([layer for layer, _, _ in ready], ready[0][1].mean)
        moments = [m for _, m, _ in ready]
        running = self.statistics == "running"
        pooled = any(isinstance(m.rows, Tensor) for m in moments)  # counts pooled over ranks, on the device
        single = tuple(i for i, m in enumerate(moments) if not isinstance(m.rows, Tensor) and m.rows == 1)
        if single and not running:
            raise ValueError(
                f"statistics='batch' needs more than one row of input per step, but layer "
                f"{ready[single[0]][0].name!r} saw 1; use statistics='running' for batch size 1"
            )
        runnings = [layer.running for layer, _, _ in ready]
        # N = 1 (σ²_H = (h − μ)² with the running μ before the update): where a count is 1, or may be (pooled)
        one_row = tuple(
            i for i, (layer, _, _) in enumerate(ready) if layer.has_bias and running and (i in single or pooled)
        )
        before = steps_before = None
        if running:  # (first: it moves the statistics to the batch's device and dtype when the model moved)
            before, steps_before = self._state_before(runnings, layout, moments[0].mean)
        running_mus = [runnings[i].device_mu() for i in one_row]
        grads_w = [grad if layer.kind.same_rows else layer.rows(grad) for layer, _, grad in ready]
        grads_b: list[Tensor | None] = []
        for layer, _, _ in ready:
            kind = layer.kind
            grad_b = kind.bias(layer.module).grad if layer.has_bias else None  # type: ignore[union-attr]
            grad_b = grad_b if grad_b is None or type(grad_b) is Tensor else _local_rows(layer, grad_b)
            grads_b.append(grad_b if grad_b is None or kind.same_rows else kind.bias_rows(layer.module, grad_b))
        q2s_host: list[float] = []
        if not pooled:
            q2s_host = [
                q_squared(layer.fan_in, int(m.samples), int(m.out_positions) / int(m.samples)) for layer, m, _ in ready
            ]
        # the q, k, v row blocks of one weight are one entry of the transform (LayerKind.row_block)
        if layout.row_runs is None:
            layout.row_runs = _row_block_runs([layer for layer, _, _ in ready])
        spans = _row_block_spans(
            layout.row_runs, ready, grads_b, None if pooled or self._compiled is not None else q2s_host
        )
        q2s: list[Any]
        entry_q2s: list[Any] = []
        counts = fan_in = q2_flat = None
        if pooled:
            device = moments[0].mean.device
            counts = torch.stack(
                [torch.stack([_count(c, device) for c in (m.rows, m.samples, m.out_positions)]) for m in moments]
            )
            fan_in = torch.tensor([layer.fan_in for layer, _, _ in ready], dtype=torch.float64, device=device)
            q2s = []
        else:
            q2s = q2s_host
            q2_flat = layout.per_layer_cached(q2s)
            if self._compiled is not None:  # tensors, so that a new q² is new data, not a recompilation
                values = layout.per_layer_values(q2s)
                q2s = list(values.unbind(0))
                entry_q2s = [q2s[i] if n == 1 else values[i : i + n].view(n, 1) for i, n in spans]
            else:  # (the blocks of one entry have one q²: _row_block_spans)
                entry_q2s = [q2s[i] for i, _ in spans]
        math_fn = _step_math if self._compiled is None or pooled else self._compiled
        config = layout.configs.get((one_row, spans))  # built once per layout, N = 1 pattern and entries
        if config is None:
            sizes = tuple(sum(layout.sizes[i : i + n]) for i, n in spans)
            groups = tuple(ready[i][0].groups if n == 1 else n for i, n in spans)
            config = _StepConfig(
                running, self.bias_correction, self.rho, self.eps1, self.eps2, one_row, spans, sizes, groups
            )
            layout.configs[(one_row, spans)] = config
        entry_w, entry_b = grads_w, grads_b
        if len(spans) < len(ready):  # a run of row blocks: its whole gradient and bias gradient
            entry_w = [grads_w[i] if n == 1 else ready[i][2] for i, n in spans]
            entry_b = [grads_b[i] if n == 1 else _whole_bias_grad(ready[i][0]) for i, n in spans]
        means, variances = [m.mean for m in moments], [m.var for m in moments]
        mu, var_t, after, steps, peak, q2_out = math_fn(
            layout, config, means, variances, running_mus, before, steps_before, counts, fan_in, q2_flat, entry_q2s,
            entry_w, entry_b,
        )  # fmt: skip
        if pooled:
            q2s = list(q2_out.unbind(0))
        # (a layer this rank never ran has had its own warning: a NaN there is not reported again)
        reported = [layer if layer.name not in self._not_run_here else None for layer, _, _ in ready]
        # with counts on the device (pooled, or token masks), the rows too: a layer that saw no row (every token
        # padding) has a NaN peak but nothing to report
        self._unreported.append(
            (reported, _host_copy(peak if counts is None else torch.cat([peak, counts[:, 0].to(peak.dtype)])))
        )
        if running:
            total = layout.total
            state = (after[:total], after[total : 2 * total], after[2 * total :])
            views = list(
                zip(
                    layout.split(state[0]),
                    layout.split(state[1]),
                    layout.split_layers(steps),
                    layout.split_layers(state[2]),
                )
            )
            layout.last_state = (after, steps, views)
            pending.items.extend(zip(runnings, views))
        for (layer, _, grad_w), mu_l, var_t_l, q2, grad_b in zip(
            ready, layout.split(mu), layout.split(var_t), q2s, grads_b
        ):
            mu_used = mu_l if grad_b is not None else None
            layer.transform = StepTransform(mu_used, var_t_l, q2, layer.groups, layer.rows, layer.bias_rows)
            layer.transformed_grad = (weakref.ref(grad_w), grad_w._version)

    def _layout(self, layers: list[ManagedLayer], like: Tensor) -> FeatureLayout:
        """The flat layout of ``layers``' features, built once per set of layers, device and dtype."""
        key = (tuple(layer.name for layer in layers), like.device, like.dtype)
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) >= 16:
                self._layouts.pop(next(iter(self._layouts)))
            sizes = [layer.features for layer in layers]
            layout = self._layouts[key] = FeatureLayout(
                sizes, [layer.has_bias for layer in layers], like.device, like.dtype, self._decay_offset
            )
        return layout

    def _state_before(
        self, runnings: list[RunningStatistics], layout: FeatureLayout, batch: Tensor
    ) -> tuple[Tensor, Tensor]:
        """The committed ``[m ; v ; d]`` of every layer and their step counts, as flat vectors: the previous
        step's own vectors when every layer still holds the views it handed out (no copy), else gathered."""
        last = layout.last_state
        if last is not None and all(
            r.mean_acc is m and r.var_acc is v and r._steps is t and r.decay is d
            for r, (m, v, t, d) in zip(runnings, last[2])
        ):
            return last[0], last[1]
        for running in runnings:  # the model was moved or cast
            running.to(batch.device, batch.dtype)
        before = torch.cat([r.mean_acc for r in runnings] + [r.var_acc for r in runnings] + [r.decay for r in runnings])
        steps = torch.cat(
            [
                r._steps if isinstance(r._steps, Tensor) else torch.tensor([r._steps], device=batch.device)
                for r in runnings
            ]
        )
        return before, steps

    def _report(self) -> None:
        """Warn about the layers whose statistics a past step found not finite or out of range, from the
        host copies of their per-layer max σ²_H — only those whose copy has arrived (a step never waits)."""
        while self._unreported:
            layers, (host, done) = self._unreported[0]
            if done is not None and not done.query():
                return
            self._unreported.pop(0)
            peaks = host.numpy()
            rows = peaks[len(layers) :].tolist()  # empty unless the counts were on the device
            peaks = peaks[: len(layers)]
            if math.isfinite(peaks.sum()):  # the usual case: nothing to report (an inf sum falls through)
                continue
            for i, (layer, peak) in enumerate(zip(layers, peaks.tolist())):
                if layer is None or (rows and rows[i] == 0):
                    continue
                if math.isnan(peak):
                    self._warn(layer, "non-finite", _NON_FINITE if self.statistics == "running" else _NON_FINITE_BATCH)
                elif math.isinf(peak):
                    root, name = math.sqrt(torch.finfo(host.dtype).max), str(host.dtype).removeprefix("torch.")
                    message = _OVERFLOW.format(dtype=name, root=root, ceiling=_ceiling(host.dtype))
                    self._warn(layer, "overflow", message)

    def flush_warnings(self) -> None:
        """Raise now the warnings about non-finite or overflowing statistics that the steps so far have
        found (normally raised by the next step); waits for the device."""
        for _, (_, done) in self._unreported:
            if done is not None:
                done.synchronize()
        self._report()

    def _pool(self, layers: list[ManagedLayer]) -> list[Moments]:
        """This step's moments per layer, pooled over ranks when syncing (one collective)."""
        local = [
            layer.moments
            if layer.moments is not None
            else Moments.empty(layer.features, layer.weight.device, layer.dtype)
            for layer in layers
        ]
        if not layers or not self._distributed():
            return local
        world = dist.get_world_size(self.process_group)
        flat = torch.cat([m.pack() for m in local])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat, group=self.process_group)
        sizes = [3 + 2 * layer.features for layer in layers]
        per_rank = [g.split(sizes) for g in gathered]
        pooled = []
        for i, layer in enumerate(layers):
            merged = Moments.unpack(per_rank[0][i], layer.features, layer.dtype)
            for rank in range(1, world):  # same order on every rank: bitwise-identical results
                merged = merged.merge(Moments.unpack(per_rank[rank][i], layer.features, layer.dtype))
            pooled.append(merged)
        return pooled

    def _distributed(self) -> bool:
        return (
            self.sync_statistics
            and dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size(self.process_group) > 1
        )

    def _warn(self, layer: ManagedLayer, cause: str, message: str) -> None:
        if (layer.name, cause) in self._warned:
            return
        self._warned.add((layer.name, cause))
        message = f"BNP layer {layer.name!r} ({type(layer.module).__name__}): {message}"
        warnings.warn(message, BNPWarning, stacklevel=user_stacklevel())

    def step_transforms(self, params: Iterable[Tensor]) -> dict[str, tuple[ManagedLayer, StepTransform]]:
        """``{layer name: (layer, transform)}`` for the layers among ``params`` that the latest
        :meth:`precondition` transformed; parameters not listed have M = I. Several layers may feed row blocks
        of one weight (``nn.MultiheadAttention``'s q, k, v): each transform maps its own rows
        (:attr:`StepTransform.rows`, :attr:`StepTransform.bias_rows`)."""
        ids = {id(p) for p in params}
        return {
            name: (layer, layer.transform)
            for name, layer in self.layers.items()
            if layer.transform is not None and id(layer.weight) in ids
        }

    # ------------------------------------------------------------------ state
    def hyperparameters(self) -> dict[str, Any]:
        """The settings that shape the running statistics and P (saved with them); ``conv_statistics`` only
        when a convolution is managed (it shapes nothing else)."""
        settings: dict[str, Any] = {
            "rho": self.rho,
            "eps1": self.eps1,
            "eps2": self.eps2,
            "statistics": self.statistics,
            "bias_correction": self.bias_correction,
        }
        if any("conv_statistics" in layer.kind.options for layer in self._layer_list):
            settings["conv_statistics"] = self.conv_statistics
        return settings

    def state_dict(self) -> dict[str, Any]:
        """Running statistics per layer name (CPU tensors) and the :meth:`hyperparameters` they were made with."""
        return {
            "layers": {name: layer.running.state_dict() for name, layer in self.layers.items()},
            "hyperparameters": self.hyperparameters(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output.

        Raises:
            ValueError: the saved layer names differ from the managed ones, or a layer's saved statistics
                have another length (e.g. per-channel ones saved under ``conv_statistics="channel"`` loaded
                into ``"column"``: they cannot be converted); nothing is loaded then.
        """
        saved = state["layers"]
        missing, unexpected = set(self.layers) - set(saved), set(saved) - set(self.layers)
        if missing or unexpected:
            raise ValueError(
                f"BNP state does not match the managed layers: missing {sorted(missing)}, "
                f"unexpected {sorted(unexpected)}"
            )
        saved_settings, current = state.get("hyperparameters"), self.hyperparameters()
        for name, layer_state in saved.items():
            length, layer = layer_state["mean_acc"].numel(), self.layers[name]
            if length != layer.features:
                was = (saved_settings or {}).get("conv_statistics", "channel")
                columns = bool(getattr(layer.kind, "columns", False))
                if "conv_statistics" not in layer.kind.options or columns == (was == "column"):
                    unit = "input features" if layer.kind.dense else "columns" if columns else "input channels"
                    raise ValueError(
                        f"BNP statistics of layer {name!r} have {length} entries, but the layer "
                        f"({type(layer.module).__name__}) has {layer.features} {unit}: the state was saved from "
                        "a model whose layer has another shape. Load it into the same architecture, or start "
                        "without the BNP state."
                    )
                raise ValueError(
                    f"BNP statistics of layer {name!r} have {length} entries, but it has {layer.features} with "
                    f"conv_statistics={self.conv_statistics!r} (saved with conv_statistics={was!r}); per-channel "
                    "and per-column statistics cannot be converted into each other. Resume with the saved "
                    "`conv_statistics`, or start without the BNP state."
                )
        for name, layer_state in saved.items():
            self.layers[name].running.load_state_dict(layer_state)
        changed = {k: (v, current[k]) for k, v in (saved_settings or {}).items() if current.get(k) != v}
        if changed:  # a deliberate change on resume is allowed, but it should not pass unnoticed
            described = ", ".join(f"{k}: saved {old!r}, now {new!r}" for k, (old, new) in sorted(changed.items()))
            warnings.warn(
                f"BNP statistics loaded from a state saved with other settings ({described}); they continue "
                "under the current settings.",
                BNPWarning,
                stacklevel=user_stacklevel(),
            )
