"""The gradients a BNP step transforms, as the layer's rows: the weight's and the bias's gradient of one managed
layer, through its kind's view (a transposed weight, a row block) and, for a ``DTensor``, this rank's shard."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_bnp.core.layers import ManagedLayer

__all__ = ["bias_grad", "local_rows", "weight_grad", "whole_bias_grad"]


def local_rows(layer: ManagedLayer, grad: Tensor) -> Tensor:
    """The rows of a gradient this rank holds: ``grad`` itself, or for a ``DTensor`` (FSDP2's ``fully_shard``) its
    local shard — rows of the weight (``Shard(0)``: BNP's transform is row-local and uses the full-width statistics
    pooled over ranks, README "Large models") or all of it (``Replicate``). In-place updates of the shard update the
    DTensor.

    Raises:
        ValueError: another sharding (tensor parallelism splits a row over ranks, or shards the rows of a layer
            whose rows are not its weight's dim 0: a transposed weight, a grouped convolution).
    """
    if type(grad) is Tensor:
        return grad
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


def weight_grad(layer: ManagedLayer) -> Tensor | None:
    """The gradient of the layer's weight leaf that this rank holds (``None``: no gradient this step)."""
    grad = layer.weight.grad
    return None if grad is None else local_rows(layer, grad)


def whole_bias_grad(layer: ManagedLayer) -> Tensor | None:
    """The gradient of the whole bias the layer's rows feed (of every row block), or ``None``."""
    bias = layer.kind.bias(layer.module) if layer.has_bias else None
    return None if bias is None else bias.grad


def bias_grad(layer: ManagedLayer) -> Tensor | None:
    """The bias gradient as the layer's rows (its kind's :meth:`~lightning_bnp.core.kinds.LayerKind.bias_rows`,
    this rank's shard), or ``None`` (no bias, or no gradient: P then has no centring block)."""
    grad = whole_bias_grad(layer)
    if grad is None:
        return None
    grad = local_rows(layer, grad)
    return grad if layer.kind.same_rows else layer.bias_rows(grad)
