"""BNP for transposed convolutions: ``nn.ConvTranspose{1,2,3}d`` as a layer kind (issue 44, DESIGN §1b).

A transposed convolution scatters every input position through every tap: with input x (N, c_in, *L_in) and weight
W (c_in, c_out, *k),

.. math::
    y[n, o, t] = b_o + \\sum_{c, κ} x[n, c, i] \\, W[c, o, κ], \\qquad t = i·s + κ·d − p ,

one term for each input position i whose tap κ lands on output position t inside the output (s the stride, d the
dilation, p the padding, per spatial dimension; ``output_padding`` or ``output_size=`` only lengthen the output). For
a given t and κ at most one i does, so this is a linear layer ``y = [e, H]·[b; W_o]`` on an explicit matrix H with one
row per (sample, *output* position), N·L_out rows, and one column per (input channel c, tap κ): H[(n, t), (c, κ)] =
x[n, c, i] where tap κ of position i lands on t, and 0 where no position's tap κ does. Its weight matrix is W read as
(c_out, c_in·∏k), so BNP's rows are the output channels (:meth:`ConvTransposeNdKind.rows`: ``weight.transpose(0, 1)``,
a view) and eq. 15 applies as it is, with the moments of H's columns (eqs. 12–13):

.. math::
    μ_H(c, κ) = \\frac{S_1(c, κ)}{N L_{out}}, \\qquad σ_H^2(c, κ) = \\frac{S_2(c, κ)}{N L_{out}} − μ_H(c, κ)^2,

S1, S2 the sums of x and x² over the batch and the input positions whose tap κ lands inside the output
(``conv_statistics="column"``, :func:`transposed_column_moments`). Each sum is, per spatial dimension, a contiguous
range of input positions, so the sums are the batch-summed input contracted with one 0/1 matrix (taps × input
positions) per dimension; H is never built.

Without padding every tap of every input position lands inside the output, so every column holds the N·L_in input
values and N·(L_out − L_in) zeros: with ρ = L_in/L_out (products over the spatial dimensions, ≈ 1/∏stride),

.. math::
    μ_H = ρ μ_x, \\qquad σ_H^2 = ρ σ_x^2 + ρ (1 − ρ) μ_x^2,

from the per-channel mean and variance of the input (``conv_statistics="channel"``, the default,
:func:`transposed_channel_moments`): exact without padding, wrong only at the border with padding, where a tap that
falls outside the output drops an input position (the analogue of Alg. 3's per-channel approximation of eqs. 19–20).
The input's own μ_x, σ²_x — what a convolution records, and what BatchNorm would compute — would centre the layer by
1/ρ times the columns' mean (4× at stride 2 in 2-D).

q² = max(c_in·∏k/N, √L_out) with L_out the output positions per sample: Alg. 3's q² for the matrix H above, whose
rows are the output positions (docs "Transposed convolutions" measures the alternative √L_in).

Groups: output channel o of group γ sees the input channels of group γ only, so its row of the weight matrix is
(c_out, c_in/groups·∏k) and P is that of its group's columns, as for a grouped convolution. The weight is stored
(c_in, c_out/groups, *k); when each group has one input channel (depthwise, c_in = groups: e.g. the fixed bilinear
upsampling of FCN-style decoders) the rows (c_out, 1, *k) are a plain view of it. With more input channels per group
they are no strided view of it, and BNP transforms the gradient in place, so such a layer is left alone and named with
the reason (:meth:`ConvTransposeNdKind.reparametrized`). ``nn.ConvTranspose*d`` pads with zeros only.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import Tensor, nn

from lightning_bnp.core.kinds import ConvNdKind, LayerKind
from lightning_bnp.core.moments import moments_of_input
from lightning_bnp.core.reparametrization import unsupported
from lightning_bnp.core.statistics import Moments, statistics_dtype

__all__ = ["ConvTransposeNdKind", "tap_reach", "transposed_channel_moments", "transposed_column_moments"]

_EINSUM = {1: "xci,ai->xca", 2: "xcij,ai,bj->xcab", 3: "xcijl,ai,bj,el->xcabe"}


def _geometry(layer: nn.Module, h: Tensor, output: Tensor) -> tuple[Tensor, Tensor, tuple[int, ...], tuple[int, ...]]:
    """``(h, output)`` with a batch dimension (unbatched (C, *L) inputs count as a batch of one), the input and
    output positions per sample."""
    if h.dim() == len(layer.kernel_size) + 1:  # type: ignore[arg-type]  # unbatched input
        h, output = h.unsqueeze(0), output.unsqueeze(0)
    return h, output, tuple(h.shape[2:]), tuple(output.shape[2:])


def transposed_channel_moments(layer: nn.Module, h: Tensor, output: Tensor) -> Moments:
    """Per-channel statistics of the columns of a transposed convolution's H (module docstring): the input's own
    per-channel mean μ_x and biased variance σ²_x over the batch and its positions
    (:func:`~lightning_bnp.core.moments.moments_of_input`, one fused call), scaled by ρ = L_in/L_out to
    μ_H = ρ·μ_x, σ²_H = ρ·σ²_x + ρ(1 − ρ)·μ_x². Exact without padding; with padding it counts the input positions
    whose taps fall outside the output too. Rows: N·L_out; q²'s positions: N·L_out."""
    x = moments_of_input(layer, h, output)
    if x.is_empty():
        return x
    _, _, inputs, positions = _geometry(layer, h, output)
    rho = math.prod(inputs) / math.prod(positions)
    samples = int(x.samples)
    rows = samples * math.prod(positions)
    # σ²_H = ρ·(σ²_x + (1 − ρ)·μ_x²) (in place on the fused kernel's fresh outputs), μ_H = ρ·μ_x: one call for both
    var = x.var.addcmul_(x.mean, x.mean, value=1.0 - rho)
    torch._foreach_mul_([x.mean, var], rho)
    return Moments(rows, samples, rows, x.mean, var)


def transposed_column_moments(layer: nn.Module, h: Tensor, output: Tensor) -> Moments:
    """Exact statistics of every column (c, κ) of a transposed convolution's H (module docstring), in the order of
    ``rows(weight)[o].flatten()``: input channel first, then tap.

    With the input shifted by its per-channel mean a_c (so that σ² stays accurate when |μ| ≫ σ), S1 = Σ(x − a) and
    S2 = Σ(x − a)² over the N·r_κ input entries whose tap κ lands inside the output, and the column's
    z_κ = N·(L_out − r_κ) zeros add −a and a² each:

    .. math::
        μ_κ = a + \\frac{S1_κ − z_κ a}{R}, \\qquad σ_κ^2 = \\frac{S2_κ + z_κ a^2}{R} − (μ_κ − a)^2,
        \\qquad R = N L_{out}.

    The sums over input positions are one contraction of the batch-summed (x − a), (x − a)² with the per-dimension
    0/1 matrices of :func:`tap_reach`.
    """
    assert isinstance(layer, nn.modules.conv._ConvTransposeNd)
    kernel = tuple(layer.kernel_size)
    channels = int(layer.in_channels)
    h = h.detach()
    if h.numel() == 0:
        return Moments.empty(channels * math.prod(kernel), h.device, statistics_dtype(h.dtype))
    if h.dtype not in (torch.float32, torch.float64):
        h = h.float()  # half / bfloat16 (autocast): statistics in float32
    h, output, inputs, positions = _geometry(layer, h, output)
    samples = h.shape[0]
    shift = h.mean([0, *range(2, h.dim())], keepdim=True)  # a_c: per-channel mean of the input
    centred = h - shift
    first = centred.sum(0)
    sums = torch.stack([first, centred.square_().sum(0)])  # (2, C, *L_in): Σ_n (x − a), Σ_n (x − a)²
    # traced by torch.compile without its cache (dynamo calls the wrapped function either way)
    reach = tap_reach.__wrapped__ if torch.compiler.is_compiling() else tap_reach
    masks, real = reach(
        inputs, positions, kernel, tuple(layer.stride), tuple(layer.padding), tuple(layer.dilation), h.device, h.dtype
    )
    window = torch.einsum(_EINSUM[len(kernel)], sums, *masks).reshape(2, channels, -1)  # (2, C, ∏k)
    rows = samples * math.prod(positions)
    zeros = samples * (math.prod(positions) - real)  # per tap: the rows of H where its column is 0
    a = shift.view(channels, 1)
    delta = (window[0] - zeros * a) / rows  # μ_κ − a
    var = (window[1] + zeros * a.square()) / rows - delta.square()
    return Moments(rows, samples, rows, (a + delta).flatten(), var.clamp_min_(0.0).flatten())


@functools.lru_cache(maxsize=256)
def tap_reach(
    inputs: tuple[int, ...],
    positions: tuple[int, ...],
    kernel: tuple[int, ...],
    stride: tuple[int, ...],
    padding: tuple[int, ...],
    dilation: tuple[int, ...],
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[tuple[Tensor, ...], Tensor]:
    """Per spatial dimension the (k, L_in) 0/1 matrix whose entry (κ, i) is 1 where tap κ of input position i lands
    inside the output, t = i·s + κ·d − p ∈ [0, L_out); and per tap (flattened) how many input positions of a sample
    land inside, r_κ (the product over dimensions). Host arithmetic, cached per shape (the same every step)."""
    masks, counts = [], torch.ones((), dtype=torch.int64)
    for size, out, k, s, p, d in zip(inputs, positions, kernel, stride, padding, dilation):
        t = torch.arange(size).mul(s).unsqueeze(0) + torch.arange(k).mul(d).unsqueeze(1) - p  # (k, L_in)
        inside = (t >= 0) & (t < out)
        masks.append(inside.to(device=device, dtype=dtype))
        counts = counts.unsqueeze(-1) * inside.sum(1)
    return tuple(masks), counts.flatten().to(device=device, dtype=dtype)


class ConvTransposeNdKind(ConvNdKind):
    """``nn.ConvTranspose{1,2,3}d``: a linear layer on the (N·L_out, c_in·∏k) matrix H of the module docstring.
    Per-channel statistics scaled by ρ = L_in/L_out (``conv_statistics="channel"``, exact without padding) or exact
    per column (c, κ) (``"column"``). Its weight (c_in, c_out, *k) is read as the rows (c_out, c_in, *k). Selected by
    its own name and by its family: ``"Conv2d"`` in ``layer_types`` (the default) also selects ``ConvTranspose2d``.
    ``groups > 1`` with more than one input channel per group is left alone, named with the reason. The fan-in,
    features, groups and what an entry of the statistics is are a convolution's (:class:`ConvNdKind`)."""

    def __init__(self, name: str, module_type: type[nn.Module], family: str, *, columns: bool = False) -> None:
        self.name = name  # type: ignore[misc]
        self.module_type = module_type  # type: ignore[misc]
        self.family = family  # type: ignore[misc]
        self.columns = columns
        self.moments = transposed_column_moments if columns else transposed_channel_moments  # type: ignore[method-assign,assignment]

    def configure(self, **options: Any) -> LayerKind:
        columns = options.get("conv_statistics", "channel") == "column"
        if columns == self.columns:
            return self
        return ConvTransposeNdKind(self.name, self.module_type, self.family, columns=columns)  # type: ignore[arg-type]

    def reparametrized(self, module: nn.Module) -> str | None:
        """Also why a grouped transposed convolution with several input channels per group is left alone: no
        in-place view of its rows."""
        groups, channels = int(module.groups), int(module.in_channels)  # type: ignore[arg-type]
        if groups > 1 and channels // groups > 1:
            return (
                f"a transposed convolution with groups={groups} and {channels // groups} input channels per group "
                "stores its weight (c_in, c_out/groups, *k), whose (c_out, c_in/groups, *k) rows are no view of it "
                "for BNP to transform in place (one input channel per group, groups=in_channels, is transformed)"
            )
        return unsupported(module, self.weight_name, self.bias_name)

    def rows(self, module: nn.Module, weight: Tensor) -> Tensor:
        if module.groups == 1:  # (c_in, c_out, *k) -> (c_out, c_in, *k): a view, the transform stays in place
            return weight.transpose(0, 1)
        # one input channel per group: (c_in, c_out/groups, *k) -> (c_out, 1, *k), the same memory (view, never a copy)
        return weight.view(-1, 1, *weight.shape[2:])
