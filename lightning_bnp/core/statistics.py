"""Per-layer activation statistics for BNP (paper 000, Alg. 2/3 steps 1–2, eqs. 13, 21–22).

Two objects live here:

* :class:`Moments` — the pooled count, mean and centred sum of squares of one layer's *input*
  over every forward call that contributed to one optimizer step (micro-batches, repeated calls
  of a shared layer and, under DDP, ranks). Parts are combined with Chan et al.'s pairwise
  update, which stays accurate when ``|mean| >> std`` (raw ``Σh² − (Σh)²/n`` in float32 does not).
* :class:`RunningStatistics` — the exponential moving averages μ, σ² of Alg. 2 step 2, optionally
  bias-corrected (Adam-style) so that the first ~1/(1−ρ) steps are not dominated by the
  initial values μ = 0, σ² = 1.

Convolutions have two kinds of statistics (``conv_statistics``): per input channel (eqs. 21–22, the
paper's implementation, :func:`moments_of_input`) or exactly per im2col column — one μ, σ² per input
channel *and* kernel offset over the patches that offset sees, padding zeros included (eqs. 19–20,
:func:`column_moments_of_input`).

Statistics are float32 whatever the autocast dtype of the forward pass (half and bfloat16 inputs
are upcast); float64 models keep float64.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "Moments",
    "RunningStatistics",
    "column_moments_of_input",
    "ema_update",
    "feature_moments",
    "masked_feature_moments",
    "moments_of_input",
    "statistics_dtype",
    "token_moments",
]


@dataclass
class Moments:
    """Pooled statistics of one layer input over one optimizer step.

    Attributes:
        rows: number of rows of H that were averaged (Linear: every leading index; ConvNd:
            batch × input spatial positions, eqs. 21–22; per-column ConvNd statistics: batch × output
            positions, the rows of the unfolded input).
        samples: the paper's N — rows for Linear, batch entries for ConvNd.
        out_positions: output positions summed over samples (ConvNd; equals ``samples`` for Linear).
            ``out_positions / samples`` is the r·s of q² in Alg. 3 step 3.
        mean: per-feature / per-input-channel / per-column mean μ_H (float32, or float64 for float64 inputs).
        var: per-feature biased (1/n) variance σ²_H of eq. 13 / 22, same dtype.
    """

    rows: int | Tensor
    samples: int | Tensor
    out_positions: int | Tensor
    mean: Tensor
    var: Tensor

    @property
    def m2(self) -> Tensor:
        """Centred sum of squares Σ(h − mean)² = rows · σ²_H."""
        return self.var * self.rows

    def merge(self, other: Moments) -> Moments:
        """Combine two disjoint parts (Chan, Golub & LeVeque pairwise update).

        Counts that are tensors (pooled from other ranks, :meth:`unpack`) stay on the device: the merge then
        reads nothing back to the host (two empty parts give an empty part with μ = σ² = 0)."""
        if isinstance(self.rows, Tensor) or isinstance(other.rows, Tensor):
            return self._merge_on_device(other)
        if other.rows == 0:
            return self
        if self.rows == 0:
            return other
        n = self.rows + other.rows
        delta = other.mean - self.mean
        mean = self.mean + delta * (other.rows / n)
        # m2 = m2_a + m2_b + δ²·n_a·n_b/n, divided by n
        var = torch.lerp(self.var, other.var, other.rows / n)
        var.addcmul_(delta, delta, value=self.rows * other.rows / n**2)
        return Moments(n, self.samples + other.samples, self.out_positions + other.out_positions, mean, var)

    def _merge_on_device(self, other: Moments) -> Moments:
        rows_a, rows_b = _as_tensor(self.rows, self.mean), _as_tensor(other.rows, self.mean)
        n = rows_a + rows_b
        share = rows_b / n.clamp_min(1.0)  # float64; 0 when both parts are empty
        delta = other.mean - self.mean
        mean = self.mean + delta * share.to(delta.dtype)
        var = torch.lerp(self.var, other.var, share.to(self.var.dtype))
        var = var + delta.square() * (share * (rows_a / n.clamp_min(1.0))).to(var.dtype)
        samples = _as_tensor(self.samples, self.mean) + _as_tensor(other.samples, self.mean)
        positions = _as_tensor(self.out_positions, self.mean) + _as_tensor(other.out_positions, self.mean)
        return Moments(n, samples, positions, mean, var)

    def pack(self) -> Tensor:
        """Flatten to one float64 vector ``[rows, samples, out_positions, mean…, var…]`` (for collectives)."""
        counts = (self.rows, self.samples, self.out_positions)
        if any(isinstance(c, Tensor) for c in counts):
            head = torch.stack([_as_tensor(c, self.mean) for c in counts])
        else:
            head = torch.tensor(counts, dtype=torch.float64, device=self.mean.device)
        return torch.cat([head, self.mean.double(), self.var.double()])

    @staticmethod
    def unpack(flat: Tensor, features: int, dtype: torch.dtype) -> Moments:
        """Inverse of :meth:`pack` for a vector of ``3 + 2·features`` entries. The counts stay on the device
        (float64 0-dim tensors): nothing is read back to the host."""
        mean = flat[3 : 3 + features].to(dtype)
        var = flat[3 + features : 3 + 2 * features].to(dtype)
        return Moments(flat[0], flat[1], flat[2], mean, var)

    @staticmethod
    def empty(features: int, device: torch.device, dtype: torch.dtype = torch.float32) -> Moments:
        zeros = torch.zeros(features, dtype=dtype, device=device)
        return Moments(0, 0, 0, zeros, zeros.clone())


def _as_tensor(count: int | Tensor, like: Tensor) -> Tensor:
    """A count as a float64 0-dim tensor on ``like``'s device."""
    if isinstance(count, Tensor):
        return count
    return torch.tensor(float(count), dtype=torch.float64, device=like.device)


def statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else (float32, float16, bfloat16) is reduced in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


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
        x = h.reshape(-1, h.shape[-1])
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
    if torch.compiler.is_compiling() or x.device.type not in _FUSED_KERNEL_DEVICES or (x.dim() == 2 and x.is_cuda):
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


class RunningStatistics:
    """Running μ, σ² of Alg. 2/3 step 2, with an optional Adam-style bias correction.

    The state is two zero-initialised accumulators and a step count ``t``:

    .. math::
        m_t = ρ m_{t-1} + (1-ρ) μ_H, \\qquad v_t = ρ v_{t-1} + (1-ρ) σ_H^2 .

    The paper's statistics (init μ = 0, σ² = 1) are exactly ``μ = m_t`` and ``σ² = v_t + ρ^t``;
    the bias-corrected ones are ``μ = m_t / (1 − ρ^t)`` and ``σ² = v_t / (1 − ρ^t)``. Keeping the
    zero-initialised accumulators (rather than the paper's σ²) avoids the cancellation of
    ``σ² − ρ^t`` in float32 when the true variance is small. Before the first update both views
    are the paper's initial values μ = 0, σ² = 1.

    ρ^t is kept on the device as :attr:`decay` = ρ^t + κ, a constant ``decay_offset`` κ added: the step updates
    it with the accumulators, ``decay ← ρ·decay + (1 − ρ)·κ``, and the paper's view folds ε2 into it
    (κ = ε2/(1 + ε1), so that its σ̃² floor takes one op less per step: ``preconditioner._step_math``).

    Args:
        features: length of μ and σ².
        rho: ρ ∈ [0, 1).
        bias_correction: use the bias-corrected view.
        device: where the accumulators live.
        dtype: the statistics' dtype.
        decay_offset: κ ≥ 0 (0 by default: :attr:`decay` is ρ^t).
    """

    decay_offset: float = 0.0  # (class default: an object pickled before κ existed holds plain ρ^t)

    def __init__(
        self,
        features: int,
        *,
        rho: float,
        bias_correction: bool,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        decay_offset: float = 0.0,
    ) -> None:
        self.rho = rho
        self.bias_correction = bias_correction
        self.decay_offset = decay_offset
        self.mean_acc = torch.zeros(features, dtype=dtype, device=device)
        self.var_acc = torch.zeros(features, dtype=dtype, device=device)
        # ρ^t + κ, kept on the device next to the accumulators (the step updates it with them)
        self.decay = torch.full((1,), 1.0 + decay_offset, dtype=dtype, device=device)
        self._steps: int | Tensor = 0  # t: a host int, or a (1,) int64 tensor that the step counts on the device

    @property
    def steps(self) -> int:
        """The number of updates t. After a step it lives on the device (a step whose statistics were not
        finite does not count, and which one that was is decided there): reading it waits for the device."""
        steps = self._steps
        return steps if isinstance(steps, int) else int(steps.item())

    @steps.setter
    def steps(self, steps: int) -> None:
        self._steps = steps
        decay = self.rho**steps + self.decay_offset
        self.decay = torch.full((1,), decay, dtype=self.mean_acc.dtype, device=self.mean_acc.device)

    def view_coefficients(self, steps: int) -> tuple[float, float]:
        """(scale, shift) with μ = scale·m_t and σ² = scale·v_t + shift, for t ≥ 1."""
        decay = self.rho**steps  # float64 on the host: exact enough for any t
        return (1.0 / (1.0 - decay), 0.0) if self.bias_correction else (1.0, decay)

    def view(self, mean_acc: Tensor, var_acc: Tensor, steps: int) -> tuple[Tensor, Tensor]:
        """(μ, σ²) seen through the configured view for a given accumulator state."""
        if steps == 0:
            return torch.zeros_like(mean_acc), torch.ones_like(var_acc)
        scale, shift = self.view_coefficients(steps)
        return mean_acc * scale, var_acc * scale + shift

    def data_view(self) -> tuple[Tensor, Tensor]:
        """(μ, σ²) of the data alone, m_t / (1 − ρ^t) and v_t / (1 − ρ^t), whichever view P uses: the
        exponentially weighted averages of the batch statistics without the paper's initial μ = 0,
        σ² = 1 (the activations' statistics that the paper's κ(D) describes). (0, 1) before any update."""
        if self.steps == 0:
            return torch.zeros_like(self.mean_acc), torch.ones_like(self.var_acc)
        scale = 1.0 / (1.0 - self.rho**self.steps)
        return self.mean_acc * scale, self.var_acc * scale

    def device_mu(self) -> Tensor:
        """μ of the configured view computed on the device from ρ^t (no read of t; 0 before any update)."""
        if not self.bias_correction:
            return self.mean_acc  # μ = m, and m = 0 before any update
        return self.mean_acc / ((1.0 + self.decay_offset) - self.decay).clamp_min(torch.finfo(self.decay.dtype).tiny)

    @property
    def mu(self) -> Tensor:
        return self.view(self.mean_acc, self.var_acc, self.steps)[0]

    @property
    def var(self) -> Tensor:
        return self.view(self.mean_acc, self.var_acc, self.steps)[1]

    def updated(self, mu_h: Tensor, var_h: Tensor) -> tuple[Tensor, Tensor, int]:
        """Accumulator state after one step with batch statistics (μ_H, σ²_H); does not commit."""
        return ema_update(self.mean_acc, mu_h, self.rho), ema_update(self.var_acc, var_h, self.rho), self.steps + 1

    def assign(self, mean_acc: Tensor, var_acc: Tensor, steps: int | Tensor, decay: Tensor | None = None) -> None:
        """Store an accumulator state; ``steps`` and ``decay`` (ρ^t + κ, shape (1,)) may be device tensors."""
        if decay is None:
            assert isinstance(steps, int)
            self.mean_acc, self.var_acc, self.steps = mean_acc, var_acc, steps
        else:
            self.mean_acc, self.var_acc, self._steps, self.decay = mean_acc, var_acc, steps, decay

    def to(self, device: torch.device, dtype: torch.dtype) -> None:
        """Follow the model when it is moved or cast after set-up."""
        if self.mean_acc.device != device or self.mean_acc.dtype != dtype:
            self.mean_acc = self.mean_acc.to(device, dtype)
            self.var_acc = self.var_acc.to(device, dtype)
            self.decay = self.decay.to(device, dtype)
            if isinstance(self._steps, Tensor):
                self._steps = self._steps.to(device)

    def state_dict(self) -> dict[str, object]:
        # ρ^t + κ as the steps computed it (in the statistics' dtype), so that a resumed run is bit-identical
        return {
            "mean_acc": self.mean_acc.cpu().clone(),
            "var_acc": self.var_acc.cpu().clone(),
            "steps": self.steps,
            "decay": self.decay.cpu().clone(),
            "decay_offset": self.decay_offset,
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        mean_acc, var_acc = state["mean_acc"], state["var_acc"]
        assert isinstance(mean_acc, Tensor) and isinstance(var_acc, Tensor)
        if mean_acc.shape != self.mean_acc.shape:
            raise ValueError(
                f"BNP statistics of shape {tuple(mean_acc.shape)} do not fit a layer with "
                f"{self.mean_acc.numel()} input features"
            )
        device, dtype = self.mean_acc.device, self.mean_acc.dtype
        self.mean_acc = mean_acc.to(device=device, dtype=dtype).clone()
        self.var_acc = var_acc.to(device=device, dtype=dtype).clone()
        self.steps = int(state["steps"])  # type: ignore[call-overload]  # sets ρ^t too
        decay = state.get("decay")  # absent from states saved before issue 28: ρ^t from t
        if isinstance(decay, Tensor):
            offset = float(state.get("decay_offset", 0.0))  # type: ignore[arg-type]  # 0: saved before it existed
            if offset != self.decay_offset:  # saved under other settings: ρ^t + κ with this κ
                decay = decay.double() - offset + self.decay_offset
            self.decay = decay.to(device=device, dtype=dtype).reshape(1).clone()


def ema_update(accumulator: Tensor, batch: Tensor, rho: float) -> Tensor:
    """m ← ρm + (1−ρ)x (Alg. 2/3 step 2), out of place; works on one layer's vector or on the flat
    vector of all layers' [m ; v] accumulators."""
    return torch.lerp(accumulator, batch, 1.0 - rho)
