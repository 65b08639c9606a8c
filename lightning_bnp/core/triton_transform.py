"""The BNP gradient transform of every entry of a step in one Triton launch (paper 000, eq. 15 / 23; DESIGN §6b).

The pure-torch transform (:func:`~lightning_bnp.core.transform.precondition_scaled_`) launches two ``torch._foreach_*``
kernels, which ATen runs as one kernel per layer where the statistics broadcast against the gradients, and a
matrix–vector product per layer with a bias. Here a step's entries are one job, as torch's fused optimizers and
apex's ``multi_tensor_apply`` treat a list of tensors: one program per (entry, block of output rows) does

.. math::
    G_w[i, j] \\leftarrow \\frac{G_w[i, j] - μ_j G_b[i]}{q^2 \\tilde σ_j^2}, \\qquad
    G_b[i] \\leftarrow \\frac{G_b[i]}{q^2} - \\sum_j μ_j G_w^{new}[i, j]

for its rows, in float32 whatever the gradient's dtype, storing in the gradient's dtype (q²σ̃² is never rounded to
the gradient's dtype: a float16 gradient is divided by the float32 q²σ̃², rounding once, as the torch path does), and
the bias update uses the new G_w as stored. An entry is a Linear weight (out, in) of any strides (a transposed view
too), a ConvNd weight (out, c_in/groups, *kernel) of any strides (``channels_last`` included) with per-channel
statistics (μ_c, σ̃²_c broadcast over the kernel offsets, eq. 23) or per-column ones (one per input channel and
kernel offset), a grouped convolution (output row i sees its group's statistics), or the n row blocks of one
weight (``nn.MultiheadAttention``'s q, k, v: groups = n, each block with its own statistics and q²). An entry
without a bias gradient (no bias, or a frozen one) is only divided.

Which tensors an entry reads and writes is a table built once per step configuration (:class:`GroupedTransform`):
its geometry (sizes, strides, where its statistics start) as an int64 device tensor, and its gradients' addresses
in a second one, rewritten only when an address changes (a gradient made anew by ``zero_grad(set_to_none=True)``).
The launch is the custom op ``lightning_bnp::grouped_transform_``, which ``torch.compile`` keeps as one opaque call
(the addresses are read from the tensors it is given, so it is right whatever buffers the compiler hands it) and a
CUDA graph captures as it is: no host read, no allocation.

Under ``TRITON_INTERPRET=1`` (set before this module is imported) the kernel runs on CPU tensors: the tests compare
it there with the pure-torch step.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from lightning_bnp.core.transform import broadcast_shapes

__all__ = ["GroupedTransform", "GroupedTransformFailed", "entry_geometry", "grouped_transform_"]

ROWS = 16  # output rows per program
COLS = 64  # columns (input channel × kernel offset) per inner iteration

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


class GroupedTransformFailed(ValueError):
    """An entry the grouped kernel does not take (a dtype or a layout it does not know)."""


@triton.jit
def _transform_kernel(  # type: ignore[no-untyped-def]  # (Triton reads a kernel's annotations)
    meta_ptr, addr_ptr, block_ptr, mu_ptr, scale_ptr, q2_ptr, GRAD: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr
):  # fmt: skip
    pid = tl.program_id(0)
    entry = tl.load(block_ptr + 2 * pid)
    row0 = tl.load(block_ptr + 2 * pid + 1)
    meta = meta_ptr + entry * 18
    out = tl.load(meta + 0)
    out_g = tl.load(meta + 1)
    cols = tl.load(meta + 2)
    kernel = tl.load(meta + 3)
    k1 = tl.load(meta + 4)
    k2 = tl.load(meta + 5)
    s_out = tl.load(meta + 6)
    s_c = tl.load(meta + 7)
    s_k0 = tl.load(meta + 8)
    s_k1 = tl.load(meta + 9)
    s_k2 = tl.load(meta + 10)
    s_b = tl.load(meta + 11)
    features = tl.load(meta + 12)
    per_group = tl.load(meta + 13)
    per_column = tl.load(meta + 14)
    centred = tl.load(meta + 15)
    q2_index = tl.load(meta + 16)
    q2_per_group = tl.load(meta + 17)
    w_ptr = tl.load(addr_ptr + 2 * entry).to(tl.pointer_type(GRAD))
    b_ptr = tl.load(addr_ptr + 2 * entry + 1).to(tl.pointer_type(GRAD))

    rows = row0 + tl.arange(0, ROWS)  # output rows i of this program
    row_ok = rows < out
    group = rows // out_g
    stats_row = features + group * per_group  # where row i's statistics start in the flat vectors
    g_b = tl.zeros((ROWS,), dtype=tl.float64)
    if centred != 0:
        g_b = tl.load(b_ptr + rows * s_b, mask=row_ok, other=0.0).to(tl.float64)
    dot = tl.zeros((ROWS,), dtype=tl.float64)  # Σ_j μ_j G_w_new[i, j], in float64 (it may cancel against G_b/q²)
    for j0 in range(0, cols, COLS):
        j = j0 + tl.arange(0, COLS)
        col_ok = j < cols
        channel = j // kernel
        offset = j % kernel  # kernel offset (k0, k1, k2), last dimension fastest
        k0_i = offset // (k1 * k2)
        k1_i = (offset // k2) % k1
        k2_i = offset % k2
        col_addr = channel * s_c + k0_i * s_k0 + k1_i * s_k1 + k2_i * s_k2
        feature = tl.where(per_column != 0, j, channel)
        mask = row_ok[:, None] & col_ok[None, :]
        addr = rows[:, None] * s_out + col_addr[None, :]
        stat = stats_row[:, None] + feature[None, :]
        g = tl.load(w_ptr + addr, mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(scale_ptr + stat, mask=mask, other=1.0)  # q²σ̃²_j, float32
        if centred != 0:
            mu = tl.load(mu_ptr + stat, mask=mask, other=0.0)
            # G_w − μ_j G_b[i] rounded once (as ATen's fused addcmul): the product of two float32 numbers is exact in
            # float64. Where G_w ≈ μ G_bᵀ (a layer input nearly the same over the batch) the difference is what is
            # left of a cancellation, then divided by a small q²σ̃²: a rounded product would leave only noise there
            g = (g.to(tl.float64) - mu.to(tl.float64) * g_b[:, None]).to(tl.float32) / scale
            stored = g.to(GRAD)
            tl.store(w_ptr + addr, stored, mask=mask)
            dot += tl.sum(mu.to(tl.float64) * stored.to(tl.float64), axis=1)  # the new G_w as stored
        else:
            tl.store(w_ptr + addr, (g / scale).to(GRAD), mask=mask)
    if centred != 0:
        q2 = tl.load(q2_ptr + q2_index + group * q2_per_group, mask=row_ok, other=1.0).to(tl.float64)
        tl.store(b_ptr + rows * s_b, (g_b / q2 - dot).to(tl.float32).to(GRAD), mask=row_ok)


@torch.library.custom_op("lightning_bnp::grouped_transform_", mutates_args=("grads_w", "grads_b", "addresses"))
def grouped_transform_(
    grads_w: list[Tensor],
    grads_b: list[Tensor],
    mu: Tensor,
    scale: Tensor,
    q2: Tensor,
    meta: Tensor,
    blocks: Tensor,
    addresses: Tensor,
) -> None:
    """Eq. 15 / 23 for every entry, in place, in one launch (the gradients share one dtype).

    Args:
        grads_w: each entry's weight gradient (its rows; any strides).
        grads_b: each entry's bias gradient, or an empty tensor where it has none (no bias, or a frozen one: the
            entry is only divided; not ``None``, which ``torch.compile``'s functionalization of a mutated list
            refuses).
        mu: every layer's μ, one flat float32 vector (the step's layout).
        scale: every layer's q²σ̃², likewise.
        q2: q² per layer (float32).
        meta: the entries' geometry (:func:`entry_geometry`), on the gradients' device.
        blocks: (entry, first row) per program, int64, on the device.
        addresses: the entries' (weight, bias) gradient addresses, on the device: rewritten here when a gradient's
            address changed since the last call (a copy from the host, which a CUDA graph captures as a memcpy).
    """
    wanted = [(w.data_ptr(), b.data_ptr()) for w, b in zip(grads_w, grads_b)]
    _refresh_addresses(addresses, wanted)
    grad = _TL_DTYPES[grads_w[0].dtype]  # (one dtype: GroupedTransform)
    _transform_kernel[(blocks.shape[0],)](meta, addresses, blocks, mu, scale, q2, grad, ROWS, COLS)


@grouped_transform_.register_fake
def _(grads_w: list[Tensor], grads_b: list[Tensor], mu: Tensor, scale: Tensor, q2: Tensor, meta: Tensor,
      blocks: Tensor, addresses: Tensor) -> None:  # fmt: skip
    return None


# per device address table: what it holds now, and (on CUDA) the pinned sources of the copies captured in a CUDA graph,
# which a replay reads again, kept as long as the table lives (the source of an eager copy is the caching host
# allocator's to keep until the copy is done). By id with a weak reference: a table freed and another made with its id
# must not look filled; the entry of a freed table goes with it
_held: dict[int, tuple[weakref.ref[Tensor], list[tuple[int, int]], list[Tensor]]] = {}


def _refresh_addresses(addresses: Tensor, wanted: list[tuple[int, int]]) -> None:
    held = _held.get(id(addresses))
    if held is not None and held[0]() is not addresses:
        held = None
    if held is not None and held[1] == wanted:
        return
    captured = [] if held is None else held[2]
    source = torch.tensor(wanted, dtype=torch.int64)
    if addresses.is_cuda:  # an asynchronous copy from pinned memory: no host wait, and capturable
        source = source.pin_memory()
        if torch.cuda.is_current_stream_capturing():
            captured = [*captured, source]
    addresses.copy_(source, non_blocking=addresses.is_cuda)
    if held is None:
        weakref.finalize(addresses, _held.pop, id(addresses), None)
    _held[id(addresses)] = (weakref.ref(addresses), wanted, captured)


def entry_geometry(grad_w: Tensor, grad_b: Tensor | None, groups: int, features: int, first_feature: int,
                   q2_index: int, row_blocks: bool) -> list[int]:  # fmt: skip
    """How entry ``grad_w`` (its rows) meets its statistics, which start at ``first_feature`` of the step's flat
    vectors (``features`` of them: c_in or c_in·kernel volume per group, times ``groups``), and its q² (at
    ``q2_index`` of the per-layer vector, the next one per row block with ``row_blocks``): one row of the kernel's
    geometry table (out, out/groups, columns, kernel volume, the kernel's last two sizes, the strides of rows,
    channels and three kernel dimensions, the bias's stride, the first feature, features per group, per column,
    centred, q² index, q² per row block).

    Raises:
        GroupedTransformFailed: a weight of more than three kernel dimensions, or a dtype the kernel does not take.
    """
    if grad_w.dtype not in _TL_DTYPES or (grad_b is not None and grad_b.dtype != grad_w.dtype):
        raise GroupedTransformFailed(f"gradient dtype {grad_w.dtype} (bias {None if grad_b is None else grad_b.dtype})")
    if grad_w.dim() < 2 or grad_w.dim() > 5:
        raise GroupedTransformFailed(f"a weight gradient of shape {tuple(grad_w.shape)}")
    per_column = broadcast_shapes(grad_w, groups, features)[3]
    out, cin_g, kernel = grad_w.shape[0], grad_w.shape[1], list(grad_w.shape[2:])
    strides = list(grad_w.stride())
    sizes, k_strides = [*([1] * (3 - len(kernel))), *kernel], [*([0] * (3 - len(kernel))), *strides[2:]]
    volume = math.prod(kernel)
    return [
        out, out // groups, cin_g * volume, volume, sizes[1], sizes[2], strides[0], strides[1], *k_strides,
        0 if grad_b is None else grad_b.stride(0), first_feature, features // groups, int(per_column),
        int(grad_b is not None), q2_index, int(row_blocks),
    ]  # fmt: skip


class GroupedTransform:
    """The grouped transform of one step configuration: its tables, built once on the gradients' device.

    Args:
        grads_w: each entry's weight gradient (as the step passes it: its rows).
        grads_b: each entry's bias gradient or ``None``.
        spans: (first layer, layers) per entry (a run of n > 1 layers is the n row blocks of one weight).
        groups: per entry, its groups (n for a run of row blocks).
        sizes: per entry, its features (all its layers').
        offsets: where each layer's features start in the flat vectors.

    Raises:
        GroupedTransformFailed: an entry the kernel does not take (:func:`entry_geometry`), or gradients of
            several dtypes (the kernel is built for one).
    """

    def __init__(self, grads_w: Sequence[Tensor], grads_b: Sequence[Tensor | None], spans: Sequence[tuple[int, int]],
                 groups: Sequence[int], sizes: Sequence[int], offsets: Sequence[int]) -> None:  # fmt: skip
        if len({w.dtype for w in grads_w}) > 1:
            raise GroupedTransformFailed(f"gradients of several dtypes {sorted({str(w.dtype) for w in grads_w})}")
        rows = [
            entry_geometry(w, b, k, size, offsets[first], first, n > 1)
            for w, b, k, size, (first, n) in zip(grads_w, grads_b, groups, sizes, spans)
        ]
        device = grads_w[0].device
        self.meta = torch.tensor(rows, dtype=torch.int64, device=device)
        blocks = [(e, r) for e, w in enumerate(grads_w) for r in range(0, w.shape[0], ROWS)]
        self.blocks = torch.tensor(blocks, dtype=torch.int64, device=device)
        self.addresses = torch.zeros(len(rows), 2, dtype=torch.int64, device=device)
        # an empty tensor of its own in place of each missing bias gradient (never read: the entry is not centred)
        self.no_bias = [torch.empty(0, dtype=w.dtype, device=device) if b is None else None for w, b in
                        zip(grads_w, grads_b)]  # fmt: skip
        self.key = self.layout_key(grads_w, grads_b)

    @staticmethod
    def layout_key(grads_w: Sequence[Tensor], grads_b: Sequence[Tensor | None]) -> tuple[object, ...]:
        """What the tables depend on besides the step configuration: the gradients' shapes, strides and dtypes."""
        return tuple(
            (w.shape, w.stride(), w.dtype, None if b is None else (b.stride(0), b.dtype))
            for w, b in zip(grads_w, grads_b)
        )

    def __call__(self, grads_w: list[Tensor], grads_b: list[Tensor | None], mu: Tensor, scale: Tensor,
                 q2: Tensor) -> None:  # fmt: skip
        """Transform the entries' gradients in place (one launch): ``mu``, ``scale`` = q²σ̃² and ``q2`` (per layer)
        as the step computed them, in float32."""
        biases = [b if b is not None else empty for b, empty in zip(grads_b, self.no_bias)]
        grouped_transform_(grads_w, biases, mu, scale, q2, self.meta, self.blocks, self.addresses)
