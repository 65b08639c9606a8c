"""Batch Renormalization (Ioffe 2017, Alg. 1) and "BN with 4 things" (Summers & Dinneen 2020) against explicit
formulas and ``torch.nn.functional.batch_norm``/``group_norm`` as independent references."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from example_projects.models import cnn5, fc_network
from example_projects.norms import BatchRenorm, GhostBatchNorm, four_things_norm
from tests.helpers import TINY_EPS


def _renorm(seed: int = 0) -> tuple[BatchRenorm, Tensor]:
    torch.manual_seed(seed)
    layer = BatchRenorm(3, relax_start=10, rmax_end=50, dmax_end=30).double()
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([1.5, -0.5, 2.0]))
        layer.bias.copy_(torch.tensor([0.1, 0.2, -0.3]))
        layer.running_mean.copy_(torch.tensor([0.3, -2.0, 0.0]))
        layer.running_std.copy_(torch.tensor([0.5, 1.0, 4.0]))
    x = torch.randn(6, 3, 2, 2, dtype=torch.float64) * torch.tensor([1.0, 3.0, 0.2]).view(1, 3, 1, 1) + 1.0
    return layer, x


def test_renorm_schedule_is_ioffes_linear_relaxation() -> None:
    layer = BatchRenorm(2)  # the paper's 5k / 40k / 25k steps, r_max 3, d_max 5
    assert layer.limits(0) == (1.0, 0.0) and layer.limits(5000) == (1.0, 0.0)
    assert layer.limits(22500) == pytest.approx((1 + 2 * 17500 / 35000, 5 * 17500 / 20000))
    assert layer.limits(40000) == (3.0, 5.0) and layer.limits(10**6) == (3.0, 5.0)


@pytest.mark.parametrize("step", [0, 20, 100])
def test_renorm_training_step_equals_algorithm_1(step: int) -> None:
    layer, x = _renorm()
    layer.num_batches_tracked.fill_(step)
    mu, sigma = layer.running_mean.clone(), layer.running_std.clone()
    rmax, dmax = {0: (1.0, 0.0), 20: (1.5, 2.5), 100: (3.0, 5.0)}[step]  # relax 10 → 50 (r) and 30 (d)
    x = x.requires_grad_()
    y = layer(x)
    # Algorithm 1 written out per channel, r and d as plain constants
    expected, grads = [], []
    for c in range(3):
        xc = x[:, c].detach().clone().requires_grad_()
        mu_b = xc.mean()
        sigma_b = torch.sqrt(((xc - mu_b) ** 2).mean() + 1e-3)
        r = float(min(max(sigma_b.item() / sigma[c].item(), 1 / rmax), rmax))
        d = float(min(max((mu_b.item() - mu[c].item()) / sigma[c].item(), -dmax), dmax))
        yc = layer.weight[c].item() * ((xc - mu_b) / sigma_b * r + d) + layer.bias[c].item()
        (gc,) = torch.autograd.grad((yc * torch.arange(yc.numel()).view_as(yc)).sum(), xc)
        expected.append(yc.detach())
        grads.append(gc)
        # moving mean and standard deviation: μ += α(μ_B − μ), σ += α(σ_B − σ) with α = 0.01
        assert layer.running_mean[c].item() == pytest.approx(mu[c].item() + 0.01 * (mu_b.item() - mu[c].item()))
        assert layer.running_std[c].item() == pytest.approx(sigma[c].item() + 0.01 * (sigma_b.item() - sigma[c].item()))
    torch.testing.assert_close(y.detach(), torch.stack(expected, 1))
    (grad,) = torch.autograd.grad((y * torch.arange(y[:, 0].numel()).view_as(y[:, 0]).unsqueeze(1)).sum(), x)
    torch.testing.assert_close(grad, torch.stack(grads, 1))
    assert int(layer.num_batches_tracked) == step + 1


def test_renorm_before_relaxation_is_batch_norm_and_inference_uses_the_moving_statistics() -> None:
    layer, x = _renorm()
    bn = F.batch_norm(x, None, None, layer.weight, layer.bias, training=True, eps=1e-3)
    torch.testing.assert_close(layer(x), bn)  # r = 1, d = 0 at step 0
    layer.eval()
    var = layer.running_std**2
    expected = F.batch_norm(x, layer.running_mean, var, layer.weight, layer.bias, training=False, eps=TINY_EPS)
    torch.testing.assert_close(layer(x), expected)


def test_ghost_batch_norm_normalizes_each_ghost_batch() -> None:
    torch.manual_seed(0)
    layer = GhostBatchNorm(3, ghost_batch_size=4).double()
    with torch.no_grad():
        layer.weight.uniform_(0.5, 2.0)
        layer.bias.uniform_(-1.0, 1.0)
    x = torch.randn(10, 3, 5, 5, dtype=torch.float64) + 2.0
    y = layer(x)
    for chunk_x, chunk_y in zip(x.split(4), y.split(4)):  # ghost batches of 4, 4 and 2
        torch.testing.assert_close(chunk_y, F.batch_norm(chunk_x, None, None, layer.weight, layer.bias, training=True))
    means = torch.stack([c.mean((0, 2, 3)) for c in x.split(4)]).mean(0)
    variances = torch.stack([c.transpose(0, 1).flatten(1).var(1) for c in x.split(4)]).mean(0)  # unbiased
    torch.testing.assert_close(layer.running_mean, 0.1 * means)
    torch.testing.assert_close(layer.running_var, 0.9 + 0.1 * variances)
    whole = GhostBatchNorm(3).double()  # ghost_batch_size 0: plain BN
    torch.testing.assert_close(whole(x), F.batch_norm(x, None, None, whole.weight, whole.bias, training=True))


def test_inference_example_weighing() -> None:
    torch.manual_seed(0)
    layer = GhostBatchNorm(2, example_weight=0.25).double().eval()
    with torch.no_grad():
        layer.running_mean.copy_(torch.tensor([1.0, -1.0]))
        layer.running_var.copy_(torch.tensor([4.0, 0.25]))
        layer.weight.copy_(torch.tensor([2.0, 0.5]))
    x = torch.randn(3, 2, 4, 4, dtype=torch.float64)
    for n in range(3):
        for c in range(2):
            xe = x[n, c]
            mu = 0.25 * xe.mean() + 0.75 * layer.running_mean[c]
            var = 0.25 * ((xe - xe.mean()) ** 2).mean() + 0.75 * layer.running_var[c]
            expected = layer.weight[c] * (xe - mu) / torch.sqrt(var + 1e-5) + layer.bias[c]
            torch.testing.assert_close(layer(x)[n, c], expected)
    plain = GhostBatchNorm(2).double().eval()
    torch.testing.assert_close(plain(x), F.batch_norm(x, plain.running_mean, plain.running_var, training=False))
    with pytest.raises(ValueError, match=r"`example_weight` 0.25 needs per-example statistics"):
        layer(torch.randn(3, 2, dtype=torch.float64))


def test_four_things_with_group_norm_is_affine_free_gn_then_bn() -> None:
    torch.manual_seed(0)
    norm = four_things_norm(8, gn_groups=4).double()
    x = torch.randn(2, 8, 3, 3, dtype=torch.float64) * 3 + 1
    bn = norm[1]
    expected = F.batch_norm(F.group_norm(x, 4), None, None, bn.weight, bn.bias, training=True)
    torch.testing.assert_close(norm(x), expected)
    assert isinstance(four_things_norm(8, ghost_batch_size=16), GhostBatchNorm)
    with pytest.raises(ValueError, match=r"`gn_groups` must divide the channels \(8\), got 3"):
        four_things_norm(8, gn_groups=3)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rmax": 0.5}, r"`rmax` must be a finite number >= 1, got 0.5"),
        ({"dmax": -1.0}, r"`dmax` must be a finite number >= 0, got -1.0"),
        ({"relax_start": 10, "rmax_end": 10}, r"`rmax_end` must be an integer >= 11, got 10"),
        ({"momentum": 0.0}, r"`momentum` must be a finite number in \(0, 1\], got 0.0"),
    ],
)
def test_renorm_invalid_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BatchRenorm(4, **kwargs)


def test_ghost_invalid_arguments() -> None:
    with pytest.raises(ValueError, match=r"`ghost_batch_size` must be an integer >= 0, got -1"):
        GhostBatchNorm(4, ghost_batch_size=-1)
    with pytest.raises(ValueError, match=r"`example_weight` must be a finite number in \[0, 1\), got 1.0"):
        GhostBatchNorm(4, example_weight=1.0)


def test_networks_take_the_baselines() -> None:
    x = torch.randn(4, 1, 28, 28)
    assert any(isinstance(m, BatchRenorm) for m in fc_network(784, norm="renorm").modules())
    for kwargs in ({"norm": "renorm"}, {"norm": "bn4", "ghost_batch_size": 2}, {"norm": "bn4", "bn4_gn_groups": 4}):
        net: nn.Module = cnn5(1, 28, **kwargs)  # type: ignore[arg-type]
        assert net(x).shape == (4, 10)
    assert sum(isinstance(m, nn.GroupNorm) for m in cnn5(1, 28, norm="bn4", bn4_gn_groups=4).modules()) == 3
