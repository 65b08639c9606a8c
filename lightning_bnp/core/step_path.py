"""Which path a step plan takes, chosen once per plan (DESIGN §6b): the grouped Triton kernels where the statistics
are float32 on a CUDA device and Triton is importable — the running state of every layer in one launch
(:func:`~lightning_bnp.core.triton_statistics.state_update`) and the transform of every entry in one more
(:mod:`~lightning_bnp.core.triton_transform`) — else the pure-torch step (:mod:`~lightning_bnp.core.step_math`,
:mod:`~lightning_bnp.core.transform`), which is the CPU path and the reference the kernels are tested against.
The grouped path is opt-in (``BNPPreconditioner(grouped_kernels=True)``) until it has been measured and checked on a
GPU; every plan takes the pure-torch path otherwise.

On the grouped path, a step whose counts are device tensors (statistics pooled over ranks, token masks) updates the
state with the pure-torch ops, and a configuration whose entries the transform kernel does not take (gradients of
another dtype than float32, bfloat16 and float16, or of several dtypes at once; weights of more than three kernel
dimensions) transforms with them.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_bnp.core.bounded_cache import BoundedCache

__all__ = ["GroupedKernels", "GroupedPath", "triton_importable", "uses_grouped_kernels"]

# device types the grouped kernels run on; tests add "cpu" in a subprocess that runs Triton's interpreter
# (TRITON_INTERPRET=1 set before the kernels are imported): never in a user's process
KERNEL_DEVICES: set[str] = {"cuda"}


@functools.lru_cache(maxsize=1)
def triton_importable() -> bool:
    """Whether Triton can be imported (it ships with torch's CUDA wheels), asked once per process."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install counts as none: the pure-torch path runs
        return False
    return True


def uses_grouped_kernels(device: torch.device, dtype: torch.dtype, *, requested: bool) -> bool:
    """Whether a plan whose statistics live on ``device`` in ``dtype`` takes the grouped kernels: float32 statistics
    on a CUDA device with Triton importable, where they are ``requested`` (else the pure-torch step)."""
    return requested and dtype == torch.float32 and device.type in KERNEL_DEVICES and triton_importable()


@dataclass(frozen=True)
class GroupedKernels:
    """The grouped kernels of one step configuration.

    Attributes:
        layers: (first feature, features, N = 1 rule, no bias) per layer, int64 on the device (the state kernel's).
        transform: the entries' :class:`~lightning_bnp.core.triton_transform.GroupedTransform`, or ``None``
            where the transform kernel does not take them.
    """

    layers: Tensor
    transform: Any

    def state(self, batch: Tensor, before: Tensor | None, q2_flat: Tensor, running: bool, bias_correction: bool,
              rho: float, eps1: float, eps2: float, ceiling: float) -> tuple[Tensor, ...]:  # fmt: skip
        """Alg. 2/3 steps 2–3 for every layer in one launch (:func:`~lightning_bnp.core.triton_statistics.
        state_update`)."""
        from lightning_bnp.core.triton_statistics import state_update

        return state_update(
            self.layers, batch, batch if before is None else before, q2_flat, running, bias_correction, rho, eps1,
            eps2, ceiling,
        )  # fmt: skip


class GroupedPath:
    """A plan's grouped kernels, one set per step configuration and gradient layout (shapes, strides, dtypes), built
    at their first step (the last 16 kept).

    Args:
        sizes: features per layer (the plan's layout).
        centred: per layer, whether it has a bias.
        device: where the statistics live.
    """

    def __init__(self, sizes: Sequence[int], centred: Sequence[bool], device: torch.device) -> None:
        self.sizes, self.centred, self.device = list(sizes), list(centred), device
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self._made: BoundedCache[tuple[Any, ...], GroupedKernels] = BoundedCache(16)
        self.proven = False  # whether they have run (until then a failure falls back to the pure-torch step)

    def kernels(self, one_row: tuple[int, ...], spans: Sequence[tuple[int, int]], groups: Sequence[int],
                sizes: Sequence[int], grads_w: Sequence[Tensor],
                grads_b: Sequence[Tensor | None]) -> GroupedKernels:  # fmt: skip
        """The kernels of a step whose layers ``one_row`` follow the N = 1 rule and whose entries (``spans``, their
        ``groups`` and features ``sizes``) have these gradients."""
        from lightning_bnp.core import triton_transform

        key = (one_row, tuple(spans), triton_transform.GroupedTransform.layout_key(grads_w, grads_b))
        return self._made.get_or_make(key, lambda: self._make(one_row, spans, groups, sizes, grads_w, grads_b))

    def _make(self, one_row: tuple[int, ...], spans: Sequence[tuple[int, int]], groups: Sequence[int],
              sizes: Sequence[int], grads_w: Sequence[Tensor],
              grads_b: Sequence[Tensor | None]) -> GroupedKernels:  # fmt: skip
        from lightning_bnp.core import triton_transform

        rows = [
            [offset, size, int(i in one_row), int(not centred)]
            for i, (offset, size, centred) in enumerate(zip(self.offsets, self.sizes, self.centred))
        ]
        layers = torch.tensor(rows, dtype=torch.int64, device=self.device)
        try:
            transform = triton_transform.GroupedTransform(grads_w, grads_b, spans, groups, sizes, self.offsets)
        except triton_transform.GroupedTransformFailed:
            transform = None
        return GroupedKernels(layers, transform)
