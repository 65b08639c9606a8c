"""Per-layer activation statistics for BNP (paper 000, Alg. 2/3 steps 1–2, eqs. 13, 21–22).

Two objects live here:

* :class:`Moments` — the pooled count, mean and biased variance of one layer's *input*
  over every forward call that contributed to one optimizer step (micro-batches, repeated calls
  of a shared layer and, under DDP, ranks). Parts are combined with Chan et al.'s pairwise
  update, which stays accurate when ``|mean| >> std`` (raw ``Σh² − (Σh)²/n`` in float32 does not).
* :class:`RunningStatistics` — the exponential moving averages μ, σ² of Alg. 2 step 2, optionally
  bias-corrected (Adam-style) so that the first ~1/(1−ρ) steps are not dominated by the
  initial values μ = 0, σ² = 1.

How one forward call's input is reduced to :class:`Moments` (per feature, per input channel or per im2col
column, ``conv_statistics``) is :mod:`lightning_bnp.core.moments`.

Statistics are float32 whatever the autocast dtype of the forward pass (half and bfloat16 inputs
are upcast); float64 models keep float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "Moments",
    "RunningStatistics",
    "count_on_device",
    "ema_update",
    "statistics_dtype",
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
    def counted_on_device(self) -> bool:
        """Whether the counts are device tensors, never read by the host: statistics pooled over ranks
        (:meth:`unpack`) or of the real tokens under a token mask (``moments.masked_feature_moments``,
        ``moments.token_moments``). The step then builds q² on the device."""
        return isinstance(self.rows, Tensor)

    def is_empty(self) -> bool:
        """Whether a part with host counts holds no row (one counted on the device is never known to be empty)."""
        return not isinstance(self.rows, Tensor) and self.rows == 0

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
        rows_a, rows_b = count_on_device(self.rows, self.mean), count_on_device(other.rows, self.mean)
        n = rows_a + rows_b
        share = rows_b / n.clamp_min(1.0)  # float64; 0 when both parts are empty
        delta = other.mean - self.mean
        mean = self.mean + delta * share.to(delta.dtype)
        var = torch.lerp(self.var, other.var, share.to(self.var.dtype))
        var = var + delta.square() * (share * (rows_a / n.clamp_min(1.0))).to(var.dtype)
        samples = count_on_device(self.samples, self.mean) + count_on_device(other.samples, self.mean)
        positions = count_on_device(self.out_positions, self.mean) + count_on_device(other.out_positions, self.mean)
        return Moments(n, samples, positions, mean, var)

    def pack(self) -> Tensor:
        """Flatten to one float64 vector ``[rows, samples, out_positions, mean…, var…]`` (for collectives)."""
        counts = (self.rows, self.samples, self.out_positions)
        if self.mean.device.type != "cpu" or any(isinstance(c, Tensor) for c in counts):
            # (fills: a copy of host ints to a GPU would wait for every kernel queued before it)
            head = torch.stack([count_on_device(c, self.mean) for c in counts])
        else:
            head = torch.tensor(counts, dtype=torch.float64)
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


def count_on_device(count: int | Tensor, like: Tensor) -> Tensor:
    """A count as a float64 0-dim tensor on ``like``'s device (a fill, not a copy from the host: on CUDA a copy
    from pageable host memory waits for the device, and cannot be captured in a CUDA graph)."""
    if isinstance(count, Tensor):
        return count
    return torch.full((), float(count), dtype=torch.float64, device=like.device)


def statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else (float32, float16, bfloat16) is reduced in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


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
    # ρ^t of the host views is decay_base·ρ^(t − base_steps): the ρ's applied before a resume under another ρ, folded
    # into decay_base at step base_steps (class defaults: an object pickled before they existed has ρ^t)
    decay_base: float = 1.0
    base_steps: int = 0

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
        decay = self.rho_power(steps) + self.decay_offset
        self.decay = torch.full((1,), decay, dtype=self.mean_acc.dtype, device=self.mean_acc.device)

    def rho_power(self, steps: int) -> float:
        """The product of the ρ's applied by the first ``steps`` updates: ρ^t, or, after a resume under another ρ
        (:meth:`load_state_dict`), the saved ρ's product times ρ^(t − t_resume). Float64 on the host: exact enough
        for any t."""
        if steps < self.base_steps:  # (steps set back by hand below the resume: the ρ's before it are unknown)
            return float(self.rho**steps)
        return self.decay_base * self.rho ** (steps - self.base_steps)

    def view_coefficients(self, steps: int) -> tuple[float, float]:
        """(scale, shift) with μ = scale·m_t and σ² = scale·v_t + shift, for t ≥ 1."""
        decay = self.rho_power(steps)
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
        scale = 1.0 / (1.0 - self.rho_power(self.steps))
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

    def assign(self, mean_acc: Tensor, var_acc: Tensor, steps: int | Tensor, decay: Tensor) -> None:
        """Store the accumulator state a step computed (:class:`~lightning_bnp.core.preconditioner.PendingUpdate`):
        ``steps`` t and ``decay`` ρ^t + κ (shape (1,)) as the step left them, device tensors or not."""
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
            "decay_base": self.decay_base,
            "base_steps": self.base_steps,
        }

    def load_state_dict(self, state: dict[str, object], *, saved_rho: float | None = None) -> None:
        """Restore :meth:`state_dict` output. ``saved_rho``: the ρ it was made with (default: this ρ); under another
        ρ the saved ρ's product is kept (:meth:`rho_power`), so that μ, σ² of the views are those P uses."""
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
        steps = int(state["steps"])  # type: ignore[call-overload]
        base, base_steps = float(state.get("decay_base", 1.0)), int(state.get("base_steps", 0))  # type: ignore[arg-type, call-overload]
        if saved_rho is not None and saved_rho != self.rho and steps >= base_steps:  # its ρ's up to now, as applied
            base, base_steps = base * saved_rho ** (steps - base_steps), steps
        self.decay_base, self.base_steps = base, base_steps
        self.steps = steps  # sets ρ^t too
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
