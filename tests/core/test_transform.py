"""The BNP transform equals the explicit (1/q²)·P·Pᵀ product of eq. 15 / 23 (DESIGN §3.4)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from lightning_bnp.core.transform import precondition_, precondition_many_, q_squared, var_tilde


def explicit_matrix(mu: torch.Tensor | None, var_t: torch.Tensor, kernel_volume: int, q2: float) -> torch.Tensor:
    """(1/q²)·P·Pᵀ for one output neuron, coordinates [b, w_(j, kernel position)...]; no bias: P = diag(1/σ̃)."""
    scale = var_t.repeat_interleave(kernel_volume).rsqrt()
    if mu is None:
        p = torch.diag(scale)
    else:
        n = 1 + scale.numel()
        u = torch.eye(n, dtype=torch.float64)
        u[0, 1:] = -mu.repeat_interleave(kernel_volume)  # [[1, −μᵀ⊗eᵀ], [0, I]]
        d = torch.diag(torch.cat([torch.ones(1, dtype=torch.float64), scale]))
        p = u @ d
    return p @ p.T / q2


def reference(
    grad_w: torch.Tensor,
    grad_b: torch.Tensor | None,
    mu: torch.Tensor | None,
    var_t: torch.Tensor,
    q2: float,
    groups: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    out, cin_g = grad_w.shape[:2]
    kv = math.prod(grad_w.shape[2:])
    new_w, new_b = torch.empty_like(grad_w), None if grad_b is None else torch.empty_like(grad_b)
    for i in range(out):
        g = i // (out // groups)  # the group output neuron i belongs to sees channels g·cin_g ... (g+1)·cin_g − 1
        channels = slice(g * cin_g, (g + 1) * cin_g)
        m = explicit_matrix(None if mu is None else mu[channels], var_t[channels], kv, q2)
        if grad_b is None:
            new_w[i] = (m @ grad_w[i].reshape(-1)).view_as(grad_w[i])
        else:
            v = m @ torch.cat([grad_b[i : i + 1], grad_w[i].reshape(-1)])
            new_b[i] = v[0]  # type: ignore[index]
            new_w[i] = v[1:].view_as(grad_w[i])
    return new_w, new_b


@st.composite
def layer_shapes(draw: st.DrawFn) -> tuple[tuple[int, ...], int]:
    spatial = draw(st.integers(0, 3))  # 0: Linear; 1-3: Conv1d/2d/3d
    groups = 1 if spatial == 0 else draw(st.sampled_from([1, 2, 3]))
    cin_g = draw(st.integers(1, 4))
    out = groups * draw(st.integers(1, 3))
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(spatial))
    return (out, cin_g, *kernel), groups


@settings(max_examples=60, deadline=None)
@given(layer_shapes(), st.booleans(), st.floats(0.5, 20.0), st.integers(0, 2**31 - 1))
@example(((6, 2, 2, 3), 3), True, 2.5, 0)  # grouped Conv2d, centred: the batched per-group bias update
@example(((6, 2, 2, 1, 2), 2), False, 3.0, 1)  # grouped Conv3d without bias
@example(((3, 4, 3), 1), True, 1.5, 2)  # Conv1d, kernel positions summed for the bias
@example(((4, 3), 1), True, 0.7, 3)  # Linear
def test_transform_equals_explicit_matrix(
    shape_groups: tuple[tuple[int, ...], int], with_bias: bool, q2: float, seed: int
) -> None:
    shape, groups = shape_groups
    g = torch.Generator().manual_seed(seed)
    cin = shape[1] * groups
    grad_w = torch.randn(shape, generator=g, dtype=torch.float64)
    grad_b = torch.randn(shape[0], generator=g, dtype=torch.float64) if with_bias else None
    mu = 3 * torch.randn(cin, generator=g, dtype=torch.float64) if with_bias else None
    var_t = torch.rand(cin, generator=g, dtype=torch.float64) * 10 + 1e-3
    expected_w, expected_b = reference(grad_w, grad_b, mu, var_t, q2, groups)
    precondition_(grad_w, grad_b, mu, var_t, q2, groups)
    torch.testing.assert_close(grad_w, expected_w, rtol=1e-10, atol=1e-10)
    if with_bias:
        torch.testing.assert_close(grad_b, expected_b, rtol=1e-10, atol=1e-10)


def test_transform_in_float32_gradient_dtype_stays() -> None:
    grad_w, grad_b = torch.randn(3, 4), torch.randn(3)
    precondition_(grad_w, grad_b, torch.randn(4), torch.rand(4) + 0.5, 2.0)
    assert grad_w.dtype == torch.float32 and grad_b.dtype == torch.float32


def test_var_tilde_is_step_3() -> None:
    var = torch.tensor([4.0, 1.0, 0.0])
    # σ̃² = σ² + ε1·max(σ²) + ε2
    torch.testing.assert_close(var_tilde(var, 1e-2, 1e-4), torch.tensor([4.0401, 1.0401, 0.0401]))


@pytest.mark.parametrize(
    ("fan_in", "samples", "positions", "expected"),
    [
        (100, 60, 1, 100 / 60),  # dense: max(n_in/N, 1)
        (100, 256, 1, 1.0),
        (32 * 9, 2, 64, 144.0),  # conv: max(c_in·k²/N, √(r·s))
        (32 * 9, 128, 1024, 32.0),
    ],
)
def test_q_squared(fan_in: int, samples: int, positions: float, expected: float) -> None:
    assert q_squared(fan_in, samples, positions) == pytest.approx(expected)


def test_a_layer_is_centred_only_when_both_its_bias_gradient_and_mu_are_given() -> None:
    """Issue 27 (a `make mutate` survivor): a bias gradient without μ is left alone, the weight gets P = diag(1/σ̃)."""
    g = torch.Generator().manual_seed(0)
    grad_w, grad_b = (
        torch.randn(3, 4, generator=g, dtype=torch.float64),
        torch.randn(3, generator=g, dtype=torch.float64),
    )
    var_t = torch.rand(4, generator=g, dtype=torch.float64) + 0.5
    expected_w, bias = grad_w / (2.0 * var_t), grad_b.clone()
    precondition_many_([grad_w], [grad_b], [None], [var_t], [2.0], [1])
    torch.testing.assert_close(grad_w, expected_w, rtol=1e-12, atol=0)
    assert torch.equal(grad_b, bias)


@pytest.mark.parametrize("groups", [1, 2])
def test_half_gradients_with_float32_statistics_stay_half(groups: int) -> None:
    """Issue 27 (`make mutate` survivors): statistics are float32 for a half model; μ is applied in the gradient's
    dtype (mixing them fails in ``addmv``/``baddbmm``), and the result is the formula to half precision."""
    g = torch.Generator().manual_seed(0)
    grad_w = torch.randn(4, 4 // groups, 3, generator=g).half()
    grad_b = torch.randn(4, generator=g).half()
    mu, var_t = torch.randn(4, generator=g), torch.rand(4, generator=g) + 0.5
    expected_w, expected_b = reference(grad_w.double(), grad_b.double(), mu.double(), var_t.double(), 1.5, groups)
    precondition_(grad_w, grad_b, mu, var_t, 1.5, groups)
    assert grad_w.dtype == grad_b.dtype == torch.float16
    torch.testing.assert_close(grad_w.double(), expected_w, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(grad_b.double(), expected_b, rtol=1e-2, atol=1e-2)


def test_a_half_gradient_is_divided_by_the_float32_q2_var_t_beyond_the_half_range() -> None:
    """Issue 27 (a `make mutate` survivor showed it): q²σ̃² of float32 statistics divides a float16 gradient as it is.
    Rounded to float16 first, 1e5 (σ > 256: a feature whose square float16 cannot hold) became inf and zeroed its
    column, and 1e-8 became 0 and made it infinite, where the formula's values (explicit P·Pᵀ in float64) are
    float16 numbers: 7e-5 and 1e4."""
    grad_w = torch.tensor([[8.0, 1.0, 1e-4], [-16.0, 2.0, -2e-4]], dtype=torch.float16)
    grad_b = torch.tensor([2.0, -1.0], dtype=torch.float16)
    mu, var_t = torch.tensor([0.5, 0.25, 0.0]), torch.tensor([1e5, 1.0, 1e-8])
    expected_w, expected_b = reference(grad_w.double(), grad_b.double(), mu.double(), var_t.double(), 1.0, 1)
    precondition_(grad_w, grad_b, mu, var_t, 1.0)
    assert grad_w.dtype == grad_b.dtype == torch.float16 and bool(grad_w.isfinite().all())
    torch.testing.assert_close(grad_w.double(), expected_w, rtol=2e-3, atol=0)
    torch.testing.assert_close(grad_b.double(), expected_b, rtol=2e-3, atol=0)
    uncentred = torch.tensor([[8.0, 1e-4]], dtype=torch.float16)
    precondition_(uncentred, None, None, torch.tensor([1e5, 1e-8]), 1.0)
    torch.testing.assert_close(uncentred.double(), torch.tensor([[8e-5, 1e4]], dtype=torch.float64), rtol=2e-3, atol=0)


def test_a_half_model_with_features_beyond_sigma_256_gets_the_formulas_gradient() -> None:
    """The same through a BNP step: a float16 model whose inputs have σ ≈ 400 (σ² > 65504, float32 statistics)
    gets eq. 15's gradient for its first layer, by hand from the batch's μ, σ² (q² = max(3/8, 1) = 1), not 0."""
    from lightning_bnp.core import BNPPreconditioner

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).half()
    pre = BNPPreconditioner(model, statistics="batch", eps1=0.01, eps2=1e-4)
    x = (torch.randn(8, 3) * 400).half()
    model(x).float().sin().sum().backward()
    layer = model[0]
    assert layer.weight.grad is not None and layer.bias.grad is not None
    grad_w, grad_b = layer.weight.grad.double(), layer.bias.grad.double()
    h = x.double()
    mu, var = h.mean(0), h.var(0, unbiased=False)
    assert bool((var > 65504).all())
    expected_w, _ = reference(grad_w, grad_b, mu, var + 0.01 * var.max() + 1e-4, 1.0, 1)
    pre.step()
    assert bool((layer.weight.grad != 0).all())
    torch.testing.assert_close(layer.weight.grad.double(), expected_w, rtol=1e-2, atol=0)


def test_the_views_of_a_weight_shape_are_worked_out_once() -> None:
    """Issue 16 (and a `make mutate` survivor of issue 27): the step works out how a gradient of a given shape meets
    its statistics once per (shape, groups, features), then takes it from the cache every step."""
    from lightning_bnp.core.transform import _broadcast_shapes

    _broadcast_shapes.cache_clear()
    for _ in range(3):
        precondition_(torch.randn(4, 2, 3), torch.randn(4), torch.randn(4), torch.rand(4) + 0.5, 1.5, groups=2)
    info = _broadcast_shapes.cache_info()
    assert (info.misses, info.hits) == (1, 2)
