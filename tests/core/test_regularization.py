"""Hessian-vector products for gradient regularization (paper 001, eq. 12)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_bnp.core.regularization import hessian_vector_product


def small_problem() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(16, 4, dtype=torch.float64), torch.randint(0, 3, (16,))
    return net, x, y


def explicit_hessian(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    params = {k: v.detach() for k, v in net.named_parameters()}
    names, shapes = list(params), [v.shape for v in params.values()]
    sizes = [v.numel() for v in params.values()]

    def loss_of(flat: torch.Tensor) -> torch.Tensor:
        pieces = dict(zip(names, (t.view(s) for t, s in zip(flat.split(sizes), shapes))))
        return nn.functional.cross_entropy(torch.func.functional_call(net, pieces, (x,)), y)

    flat = torch.cat([v.reshape(-1) for v in params.values()])
    return torch.autograd.functional.hessian(loss_of, flat)


@pytest.mark.parametrize("method", ["double_backprop", "finite_difference"])
def test_hvp_matches_explicit_hessian(method: str) -> None:
    net, x, y = small_problem()
    params = list(net.parameters())
    v = [torch.randn_like(p) for p in params]
    before = [p.detach().clone() for p in params]
    hv = hessian_vector_product(
        lambda: nn.functional.cross_entropy(net(x), y),
        params,
        v,
        method=method,
        fd_step=1e-5,  # type: ignore[arg-type]
    )
    expected = explicit_hessian(net, x, y) @ torch.cat([t.reshape(-1) for t in v])
    tol = 1e-10 if method == "double_backprop" else 1e-5
    torch.testing.assert_close(torch.cat([h.reshape(-1) for h in hv]), expected, rtol=tol, atol=tol)
    assert all(torch.equal(p, b) for p, b in zip(params, before))  # parameters restored bit for bit


def test_finite_difference_with_given_gradient_agrees_with_double_backprop() -> None:
    net, x, y = small_problem()
    params = list(net.parameters())
    grads = torch.autograd.grad(nn.functional.cross_entropy(net(x), y), params)
    v = [torch.randn_like(p) for p in params]
    loss_fn = lambda: nn.functional.cross_entropy(net(x), y)  # noqa: E731
    exact = hessian_vector_product(loss_fn, params, v, method="double_backprop")
    approx = hessian_vector_product(loss_fn, params, v, method="finite_difference", grads_at_params=grads, fd_step=1e-5)
    for a, e in zip(approx, exact):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-6)


def test_unknown_method() -> None:
    net, x, _ = small_problem()
    with pytest.raises(ValueError, match="`method` must be 'finite_difference' or 'double_backprop', got 'lanczos'"):
        hessian_vector_product(lambda: net(x).sum(), list(net.parameters()), [], method="lanczos")  # type: ignore[arg-type]


@pytest.mark.parametrize("method", ["double_backprop", "finite_difference"])
def test_no_parameters_and_a_constant_loss_give_an_empty_and_a_zero_product(method: str) -> None:
    assert hessian_vector_product(lambda: torch.zeros(()), [], [], method=method) == []  # type: ignore[arg-type]
    p = torch.ones(3, requires_grad=True)
    (hv,) = hessian_vector_product(lambda: torch.zeros(()), [p], [torch.ones(3)], method=method)  # type: ignore[arg-type]
    assert torch.equal(hv, torch.zeros(3))
