"""How one forward call's layer input is reduced to per-feature :class:`~lightning_bnp.core.statistics.Moments`
(paper 000, Alg. 2/3 step 1, eqs. 13, 19–22): per feature of a linear layer's input, per input channel of a
convolution's (eqs. 21–22, the paper's implementation, :func:`moments_of_input`) or exactly per im2col column —
one μ, σ² per input channel *and* kernel offset over the patches that offset sees, padding zeros included
(eqs. 19–20, :func:`column_moments_of_input`) —, over the real rows of a token mask, or of an embedding's one-hot
rows from token counts.

Statistics are float32 whatever the autocast dtype of the forward pass (half and bfloat16 inputs are upcast);
float64 models keep float64.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_bnp.core.statistics import Moments, statistics_dtype

__all__ = [
    "column_moments_of_input",
    "feature_moments",
    "masked_feature_moments",
    "moments_of_input",
    "token_moments",
]


def moments_of_input(layer: nn.Module, h: Tensor, output: Tensor) -> Moments:
    """Statistics of one forward call's input ``h`` to a Linear or ConvNd ``layer``.

    Linear: per input feature over all leading dimensions (a (B, T, F) input gives B·T rows).
    ConvNd: per input channel over batch and all spatial positions (eqs. 21–22); unbatched
    (C, *spatial) inputs count as a batch of one.

    Mean and biased variance come from ATen's fused ``batch_norm_update_stats`` (the statistics pass
    of BatchNorm's training forward, without its output): one kernel launch per forward call of a
    convolution and two for a Linear layer, instead of four for a two-pass mean and Σ(h − mean)²
    (issue 16). For convolutions it accumulates in double on CPU and with Welford's update on CUDA.
    """
    h = h.detach()
    if h.numel() == 0:  # an empty batch contributes nothing (the fused kernel refuses it)
        features = layer.in_features if isinstance(layer, nn.Linear) else int(layer.in_channels)  # type: ignore[arg-type]
        return Moments.empty(features, h.device, statistics_dtype(h.dtype))
    if h.dtype not in (torch.float32, torch.float64):
        h = h.float()  # half / bfloat16 (autocast): statistics in float32
    if isinstance(layer, nn.Linear):
        x = h if h.dim() == 2 else h.reshape(-1, h.shape[-1])  # (a reshape costs ~1 µs of host time, even a no-op)
        rows = x.shape[0]
        mean, var = _per_channel_mean_var(x)
        return Moments(rows, rows, rows, mean, var)
    assert isinstance(layer, nn.modules.conv._ConvNd)
    if h.dim() == len(layer.kernel_size) + 1:  # unbatched input
        h, output = h.unsqueeze(0), output.unsqueeze(0)
    samples = h.shape[0]
    mean, var = _per_channel_mean_var(h)
    return Moments(h.numel() // h.shape[1], samples, samples * math.prod(output.shape[2:]), mean, var)


def feature_moments(h: Tensor) -> Moments:
    """Statistics of a linear layer's input ``h`` (whatever its module): per feature (last dimension) over every
    leading dimension, each row one sample (a (B, T, F) input gives B·T rows), as :func:`moments_of_input`
    computes for ``nn.Linear``."""
    h = h.detach()
    if h.numel() == 0:  # an empty batch contributes nothing (the fused kernel refuses it)
        return Moments.empty(h.shape[-1], h.device, statistics_dtype(h.dtype))
    if h.dtype not in (torch.float32, torch.float64):
        h = h.float()  # half / bfloat16 (autocast): statistics in float32
    x = h.reshape(-1, h.shape[-1])
    mean, var = _per_channel_mean_var(x)
    return Moments(x.shape[0], x.shape[0], x.shape[0], mean, var)


def masked_feature_moments(h: Tensor, real: Tensor) -> Moments:
    """Per-feature statistics of the rows of ``h`` (…, F) that ``real`` (a bool tensor of ``h``'s leading
    dimensions, True = a real token) marks: the mean and biased variance over the real rows only, N = their
    number (token masks, ``BNPPreconditioner.token_mask``).

    No row is gathered (``h[real]`` would read the count back to the host and give a shape only known at run
    time): padded rows are zeroed in both passes and the count stays a 0-dim float64 tensor on the device, which
    the step reads there (as it does counts pooled over ranks). A padded row's values never enter the result,
    not even a NaN there. With no real row the part counts 0 and adds nothing."""
    h = h.detach()
    if h.dtype not in (torch.float32, torch.float64):
        h = h.float()  # half / bfloat16 (autocast): statistics in float32
    x = h.reshape(-1, h.shape[-1])
    keep = real.to(device=x.device).reshape(-1, 1)
    count = keep.sum(dtype=torch.float64)  # N on the device
    per = count.clamp_min(1.0).to(x.dtype)
    mean = torch.where(keep, x, 0.0).sum(0) / per
    centred = torch.where(keep, x - mean, 0.0)
    var = centred.square_().sum(0) / per
    return Moments(count, count, count, mean, var)


def token_moments(
    tokens: Tensor, vocabulary: int, padding_idx: int | None, dtype: torch.dtype, real: Tensor | None = None
) -> Moments:
    """Statistics of an embedding's input seen as the one-hot rows it selects (issue 24, item 4), without
    building them: per token j of the ``vocabulary``, the mean of one-hot column j is the token's frequency
    p_j = c_j / N and its biased variance p_j(1 − p_j), from the per-token counts c_j (one ``index_add_``:
    static shape, no host read, traceable by ``torch.compile``; ``bincount`` reads its maximum back on CUDA).
    N is every index of ``tokens`` (any shape), each one row.

    ``padding_idx``: positions holding it are not tokens (torch gives the padding row no gradient and a
    constant output): they are left out of N and of every frequency, so μ, σ² and q² are those of the real
    tokens. N then depends on the data and stays on the device (a float64 0-dim tensor, as counts pooled over
    ranks are: the step builds q² there).

    ``real``: a token mask (bool, ``tokens``' shape, True = a real token; ``BNPPreconditioner.token_mask``):
    the positions it leaves out are not tokens either, as padding positions are.
    """
    flat = tokens.detach().reshape(-1)
    if flat.numel() == 0:
        return Moments.empty(vocabulary, tokens.device, dtype)
    counts = torch.zeros(vocabulary, dtype=torch.int64, device=flat.device)
    if real is None:
        ones = torch.ones((), dtype=torch.int64, device=flat.device).expand(flat.shape)
    else:  # a masked position adds 0 to its token's count
        ones = real.detach().reshape(-1).to(device=flat.device, dtype=torch.int64)
    counts.index_add_(0, flat, ones)
    rows: int | Tensor
    if padding_idx is None and real is None:
        rows = flat.numel()
        mean = counts.to(dtype) / rows  # exact counts; the division rounds once, as a column mean of ones does
    else:
        if padding_idx is not None:
            counts[padding_idx] = 0
        rows = counts.sum().to(torch.float64)
        mean = counts.to(dtype) / rows.clamp_min(1.0).to(dtype)  # no real token: μ = σ² = 0 and N = 0
    var = torch.addcmul(mean, mean, mean, value=-1.0)  # p(1 − p); the step adds μ² back (bias-free: E[h²] = p)
    return Moments(rows, rows, rows, mean, var)


def column_moments_of_input(layer: nn.Module, h: Tensor, output: Tensor) -> Moments:
    """Exact per-column statistics of a ConvNd input (eqs. 19–20): the mean and biased variance of every
    column of the unfolded input ``F.unfold(h)`` — one per (input channel, kernel offset), in the order of
    ``weight[o].flatten()`` across all input channels — over its N·(output positions) rows, padding zeros
    (or the reflected / replicated / circular values of ``padding_mode``) included.

    The unfolded matrix is never built. The sum of the entries one kernel offset sees over every sample
    and output position is a *window sum* of the batch-summed input (:func:`_window_sums`): with the
    input shifted by its per-channel mean a_c, S1 = Σ(h − a) and S2 = Σ(h − a)² over the real entries
    of each column, and the column's p padding zeros add −a and a² each:

    .. math::
        μ_k = a + \\frac{S1_k - p_k a}{R}, \\qquad σ_k^2 = \\frac{S2_k + p_k a^2}{R} - (μ_k - a)^2,

    R = N·(output positions). Shifting before squaring keeps σ² accurate when |μ| ≫ σ (a raw Σh² would
    cancel). Unbatched (C, *spatial) inputs count as a batch of one.
    """
    assert isinstance(layer, nn.modules.conv._ConvNd)
    h = h.detach()
    kernel = tuple(layer.kernel_size)
    channels = int(layer.in_channels)
    if h.numel() == 0:
        return Moments.empty(channels * math.prod(kernel), h.device, statistics_dtype(h.dtype))
    if h.dtype not in (torch.float32, torch.float64):
        h = h.float()  # half / bfloat16 (autocast): statistics in float32
    if h.dim() == len(kernel) + 1:  # unbatched input
        h, output = h.unsqueeze(0), output.unsqueeze(0)
    # (left, right) per spatial dimension, first dimension first (torch stores it reversed, last first)
    pads = layer._reversed_padding_repeated_twice
    left = tuple(int(pads[2 * i]) for i in reversed(range(len(kernel))))
    if layer.padding_mode != "zeros":  # the layer pads with values: the unfolded matrix holds them
        h, left = F.pad(h, pads, mode=layer.padding_mode), (0,) * len(kernel)
    samples, positions = h.shape[0], tuple(output.shape[2:])
    shift = h.mean([0, *range(2, h.dim())], keepdim=True)  # a_c: per-channel mean of the real entries
    centred = h - shift
    first = centred.sum(0)
    sums = torch.stack([first, centred.square_().sum(0)])  # (2, C, *spatial): Σ_n (h − a), Σ_n (h − a)²
    geometry = (tuple(h.shape[2:]), left, kernel, tuple(layer.stride), tuple(layer.dilation), positions)
    window = _window_sums(sums, *geometry[1:])
    rows = samples * math.prod(positions)
    # traced by torch.compile without its cache (dynamo calls the wrapped function either way)
    counts = _real_counts.__wrapped__ if torch.compiler.is_compiling() else _real_counts
    padded = samples * (math.prod(positions) - counts(*geometry, h.device))
    a = shift.view(channels, 1)
    delta = (window[0] - padded * a) / rows  # μ_k − a
    var = (window[1] + padded * a.square()) / rows - delta.square()
    return Moments(rows, samples, rows, (a + delta).flatten(), var.clamp_min_(0.0).flatten())


def _window_sums(
    x: Tensor,
    left: tuple[int, ...],
    kernel: tuple[int, ...],
    stride: tuple[int, ...],
    dilation: tuple[int, ...],
    positions: tuple[int, ...],
) -> Tensor:
    """``out[…, k] = Σ_o x[…, o·stride + k·dilation − left]`` (zero outside ``x``) for every kernel offset k,
    the sum over output positions o of what offset k sees. Leading dimensions of ``x`` are (2, C).

    It is a convolution with stride and dilation swapped: a kernel of ones over the output grid, dilated
    by the layer's stride and stepped by its dilation (what ``torch.nn.grad.conv_weight`` computes with
    a gradient of ones, on the batch-summed input).
    """
    lead, spatial = x.shape[:2], x.shape[2:]
    pad: list[int] = []
    for size, lo, k, s, d, o in reversed(list(zip(spatial, left, kernel, stride, dilation, positions))):
        pad += [lo, max(0, (o - 1) * s + (k - 1) * d + 1 - lo - size)]  # F.pad: last dimension first
    flat = F.pad(x.reshape(-1, 1, *spatial), pad)
    ones = torch.ones(1, 1, *positions, dtype=x.dtype, device=x.device)
    conv = (F.conv1d, F.conv2d, F.conv3d)[len(spatial) - 1]
    out = conv(flat, ones, stride=dilation, dilation=stride)
    for dim, k in enumerate(kernel, start=2):  # the conv may give more than the k offsets: keep the first k
        out = out.narrow(dim, 0, k)
    return out.reshape(*lead, math.prod(kernel))


@functools.lru_cache(maxsize=256)
def _real_counts(
    spatial: tuple[int, ...],
    left: tuple[int, ...],
    kernel: tuple[int, ...],
    stride: tuple[int, ...],
    dilation: tuple[int, ...],
    positions: tuple[int, ...],
    device: torch.device,
) -> Tensor:
    """Per kernel offset (flattened), how many output positions read a real entry of the input, not padding.
    Host arithmetic, cached per shape (it is the same every step)."""
    counts = torch.ones((), dtype=torch.int64)
    for size, lo, k, s, d, o in zip(spatial, left, kernel, stride, dilation, positions):
        per_offset = [sum(0 <= i * s + j * d - lo < size for i in range(o)) for j in range(k)]
        counts = counts.unsqueeze(-1) * torch.tensor(per_offset)
    return counts.flatten().to(device)


# where ATen implements batch_norm_update_stats (it has no fake-tensor rule either, so torch.compile cannot trace it)
_FUSED_KERNEL_DEVICES = ("cpu", "cuda")


def _per_channel_mean_var(x: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and biased variance per channel (dim 1) over every other dimension of ``x``.

    Under ``torch.compile`` and on devices without the fused kernel: ``torch.var_mean``, which inductor
    fuses into the forward's kernels and every device has.
    """
    # (x.is_cpu first: a property, where x.device builds a device object at every forward call)
    if (not x.is_cpu and (x.device.type not in _FUSED_KERNEL_DEVICES or x.dim() == 2)) or torch.compiler.is_compiling():
        # (on CUDA a (rows, features) input takes one Welford launch this way; on the CPU var_mean's Welford
        # kernel is 15–30× slower than the two below for such an input, measured at 60–2048 rows)
        var, mean = torch.var_mean(x, [0, *range(2, x.dim())], correction=0)
        return mean, var
    # (the torch.* binding: ~1.5 µs less host time per call than the torch.ops.aten packet, the same kernel)
    mean, var = torch.batch_norm_update_stats(x, None, None, 0.0)
    if x.dim() == 2:
        # ATen's 2-D (rows, features) CPU kernel sums the mean in float32 one row after another (a few ULPs off
        # when |μ| ≫ σ); ``mean(0)``'s cascade sum is exact to an ULP. The variance is centred on the
        # kernel's own mean, which is accurate enough for it.
        mean = x.mean(0)
    return mean, var
