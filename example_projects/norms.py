"""The BNP paper's batch-normalization baselines for small and large mini-batches (paper 000, §5).

* :class:`BatchRenorm` — Batch Renormalization (Ioffe 2017, Alg. 1): BN whose training output is
  corrected towards the moving statistics by r = σ_B/σ and d = (μ_B − μ)/σ, clipped to [1/r_max, r_max]
  and [−d_max, d_max] and treated as constants, with Ioffe's r_max/d_max schedule; inference uses the
  moving statistics, so train and inference networks agree.
* :class:`GhostBatchNorm` — BN over "ghost" (virtual) batches of a fixed size, with inference example
  weighing; together with a preceding affine-free GroupNorm and weight decay on γ and β (the optimizer's
  ``weight_decay``, which the example projects apply to every parameter) these are the "4 things" of
  Summers & Dinneen (2020) that the BNP paper uses as its "BN with 4 things" baseline
  (:func:`four_things_norm`).

Both take inputs (N, C, *) and normalize per channel C over N and every trailing dimension.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from typing_extensions import override

from lightning_bnp.core.validation import check_float, check_int


def _reduce_dims(x: Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _channel_view(v: Tensor, x: Tensor) -> Tensor:
    return v.view(1, -1, *([1] * (x.dim() - 2)))


class _ChannelNorm(nn.Module):
    """γ, β (C,) and the moving mean (C,) of a per-channel normalization, with validated ``momentum`` and ``eps``."""

    running_mean: Tensor

    def __init__(self, num_features: int, momentum: float, eps: float) -> None:
        super().__init__()
        check_int("num_features", num_features, low=1)
        self.momentum = check_float("momentum", momentum, low=0.0, high=1.0, low_open=True)
        self.eps = check_float("eps", eps, low=0.0, low_open=True)
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))

    def _affine(self, x_hat: Tensor) -> Tensor:
        return _channel_view(self.weight, x_hat) * x_hat + _channel_view(self.bias, x_hat)


class BatchRenorm(_ChannelNorm):
    """Batch Renormalization (Ioffe 2017, Algorithm 1).

    .. math::
        σ_B = \\sqrt{\\mathrm{Var}_B[x] + ε},\\quad r = \\mathrm{clip}_{[1/r_{max}, r_{max}]}(σ_B/σ),\\quad
        d = \\mathrm{clip}_{[−d_{max}, d_{max}]}((μ_B − μ)/σ)

        y = γ\\left(\\frac{x − μ_B}{σ_B}\\,r + d\\right) + β \\ \\text{(training; r, d without gradient)},\\qquad
        y = γ\\,\\frac{x − μ}{σ} + β \\ \\text{(inference)}

    then μ ← μ + α(μ_B − μ), σ ← σ + α(σ_B − σ) (the moving mean and *standard deviation*, as in the
    paper; Var_B is the biased batch variance). Schedule (Ioffe §4): r_max = 1 and d_max = 0 (plain BN)
    for ``relax_start`` training steps, then linear up to ``rmax`` at step ``rmax_end`` and ``dmax`` at
    ``dmax_end`` (5k, 40k and 25k in the paper).

    Args:
        num_features: channels C.
        rmax: final r_max ≥ 1 (paper: 3).
        dmax: final d_max ≥ 0 (paper: 5).
        relax_start: training steps of plain BN before the relaxation starts (paper: 5,000).
        rmax_end: step at which r_max reaches ``rmax`` (paper: 40,000).
        dmax_end: step at which d_max reaches ``dmax`` (paper: 25,000).
        momentum: α of the moving averages (default 0.01: TensorFlow's BN momentum 0.99; the BNP paper ran
            its FC and CNN experiments in TensorFlow).
        eps: ε inside the square roots (TensorFlow's default 1e-3).
    """

    running_std: Tensor
    num_batches_tracked: Tensor

    def __init__(
        self,
        num_features: int,
        *,
        rmax: float = 3.0,
        dmax: float = 5.0,
        relax_start: int = 5000,
        rmax_end: int = 40000,
        dmax_end: int = 25000,
        momentum: float = 0.01,
        eps: float = 1e-3,
    ) -> None:
        super().__init__(num_features, momentum, eps)
        self.rmax = check_float("rmax", rmax, low=1.0)
        self.dmax = check_float("dmax", dmax, low=0.0)
        self.relax_start = check_int("relax_start", relax_start, low=0)
        for name, end in (("rmax_end", rmax_end), ("dmax_end", dmax_end)):
            check_int(name, end, low=relax_start + 1)
        self.rmax_end, self.dmax_end = rmax_end, dmax_end
        self.register_buffer("running_std", torch.ones(num_features))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    def limits(self, step: int) -> tuple[float, float]:
        """(r_max, d_max) at training step ``step`` (counted from 0)."""

        def ramp(final: float, start_value: float, end: int) -> float:
            t = min(max((step - self.relax_start) / (end - self.relax_start), 0.0), 1.0)
            return start_value + t * (final - start_value)

        return ramp(self.rmax, 1.0, self.rmax_end), ramp(self.dmax, 0.0, self.dmax_end)

    @override
    def forward(self, x: Tensor) -> Tensor:
        if not self.training:
            mu, sigma = _channel_view(self.running_mean, x), _channel_view(self.running_std, x)
            return self._affine((x - mu) / sigma)
        dims = _reduce_dims(x)
        mu_b = x.mean(dims)
        sigma_b = torch.sqrt(x.var(dims, unbiased=False) + self.eps)
        rmax, dmax = self.limits(int(self.num_batches_tracked))
        with torch.no_grad():  # r and d are constants for backprop (Alg. 1)
            r = (sigma_b / self.running_std).clamp(1.0 / rmax, rmax)
            d = ((mu_b - self.running_mean) / self.running_std).clamp(-dmax, dmax)
            self.running_mean.add_(self.momentum * (mu_b - self.running_mean))
            self.running_std.add_(self.momentum * (sigma_b - self.running_std))
            self.num_batches_tracked.add_(1)
        x_hat = (x - _channel_view(mu_b, x)) / _channel_view(sigma_b, x) * _channel_view(r, x) + _channel_view(d, x)
        return self._affine(x_hat)


class GhostBatchNorm(_ChannelNorm):
    """BN over ghost batches, with inference example weighing (Summers & Dinneen 2020).

    Training: the mini-batch is split into consecutive ghost batches of ``ghost_batch_size`` samples (the
    last may be smaller; 0: the whole batch, plain BN); each is normalized with its own mean and biased
    variance, then scaled by γ and shifted by β. The moving averages are updated once per forward with the
    mean over ghost batches of their means and of their unbiased variances (PyTorch's BN convention).

    Inference: with example weight α, each example is normalized by
    μ = α·μ_x + (1 − α)·μ_pop and σ² = α·σ²_x + (1 − α)·σ²_pop, where μ_x and σ²_x are the example's own
    statistics over its trailing (spatial) dimensions and μ_pop, σ²_pop the moving averages. α = 0 is plain
    BN inference. Summers & Dinneen's text is not among this project's papers: this mixing of the
    variances (without a between-means term) is our reading of their "inference example weighing".

    Args:
        num_features: channels C.
        ghost_batch_size: samples per ghost batch (0: the whole mini-batch).
        example_weight: α in [0, 1) (needs inputs with trailing dimensions when > 0).
        momentum: PyTorch BN's momentum of the moving averages.
        eps: added to the variances.
    """

    running_var: Tensor

    def __init__(
        self,
        num_features: int,
        *,
        ghost_batch_size: int = 0,
        example_weight: float = 0.0,
        momentum: float = 0.1,
        eps: float = 1e-5,
    ) -> None:
        super().__init__(num_features, momentum, eps)
        self.ghost_batch_size = check_int("ghost_batch_size", ghost_batch_size, low=0)
        self.example_weight = check_float("example_weight", example_weight, low=0.0, high=1.0, high_open=True)
        self.register_buffer("running_var", torch.ones(num_features))

    @override
    def forward(self, x: Tensor) -> Tensor:
        if not self.training:
            mu, var = _channel_view(self.running_mean, x), _channel_view(self.running_var, x)
            if self.example_weight > 0:
                if x.dim() < 3:
                    raise ValueError(
                        f"`example_weight` {self.example_weight} needs per-example statistics over trailing "
                        f"dimensions, but the input has shape {tuple(x.shape)}"
                    )
                spatial = list(range(2, x.dim()))
                a = self.example_weight
                mu = a * x.mean(spatial, keepdim=True) + (1 - a) * mu
                var = a * x.var(spatial, unbiased=False, keepdim=True) + (1 - a) * var
            return self._affine((x - mu) / torch.sqrt(var + self.eps))
        size = self.ghost_batch_size or x.shape[0]
        outputs, means, variances = [], [], []
        for chunk in x.split(size):
            dims = _reduce_dims(chunk)
            mu_b, var_b = chunk.mean(dims), chunk.var(dims, unbiased=False)
            outputs.append((chunk - _channel_view(mu_b, chunk)) / torch.sqrt(_channel_view(var_b, chunk) + self.eps))
            n = chunk.numel() // chunk.shape[1]
            means.append(mu_b.detach())
            variances.append(var_b.detach() * (n / max(n - 1, 1)))
        with torch.no_grad():
            self.running_mean.lerp_(torch.stack(means).mean(0), self.momentum)
            self.running_var.lerp_(torch.stack(variances).mean(0), self.momentum)
        return self._affine(torch.cat(outputs))


def four_things_norm(
    num_features: int, *, ghost_batch_size: int = 0, gn_groups: int = 0, example_weight: float = 0.0
) -> nn.Module:
    """ "BN with 4 things" (Summers & Dinneen 2020) as the BNP paper uses it (§5, CNNs): Ghost BN for large
    batches (``ghost_batch_size``), BN combined with GroupNorm for small ones (``gn_groups``: an affine-free
    GroupNorm, then BN with γ, β — our reading of the combination), inference example weighing
    (``example_weight``); the fourth, weight decay on γ and β, is the optimizer's ``weight_decay``.

    Raises:
        ValueError: ``gn_groups`` does not divide ``num_features``.
    """
    bn = GhostBatchNorm(num_features, ghost_batch_size=ghost_batch_size, example_weight=example_weight)
    if not check_int("gn_groups", gn_groups, low=0):
        return bn
    if num_features % gn_groups:
        raise ValueError(f"`gn_groups` must divide the channels ({num_features}), got {gn_groups}")
    return nn.Sequential(nn.GroupNorm(gn_groups, num_features, affine=False), bn)
