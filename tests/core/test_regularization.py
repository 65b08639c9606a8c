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


# ------------------------------------------------------------------ pins found by mutation testing (issue 27)
def cubic_problem() -> tuple[torch.Tensor, torch.Tensor, object]:
    """L(p, u) = Σ p³ with a parameter u the loss does not use: ∇_p L = 3p², ∇²L·v = 6p⊙v, and the forward
    difference with step ε along v is 6p⊙v + 3ε·v⊙v exactly (up to rounding)."""
    p = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64, requires_grad=True)
    u = torch.tensor([4.0, 5.0], dtype=torch.float64, requires_grad=True)
    return p, u, lambda: (p**3).sum()


def test_finite_difference_default_step_is_1e_3_along_a_unit_vector() -> None:
    """‖v‖ = 1 (no shortcut for it) and the default fd_step 1e-3: the result carries the known O(ε) error 3ε·v²."""
    p, u, loss_fn = cubic_problem()
    v = torch.tensor([0.6, 0.0, 0.8], dtype=torch.float64)
    hv_p, hv_u = hessian_vector_product(
        loss_fn, [p, u], [v, torch.zeros(2, dtype=torch.float64)], method="finite_difference"
    )  # type: ignore[arg-type]
    torch.testing.assert_close(hv_p, 6 * p.detach() * v + 3e-3 * v * v, rtol=1e-9, atol=1e-9)
    assert torch.equal(hv_u, torch.zeros(2, dtype=torch.float64))


@pytest.mark.parametrize("method", ["double_backprop", "finite_difference"])
def test_a_parameter_the_loss_does_not_use_gets_a_zero_product(method: str) -> None:
    p, u, loss_fn = cubic_problem()
    v = [torch.tensor([1.0, 2.0, -1.0], dtype=torch.float64), torch.tensor([3.0, -1.0], dtype=torch.float64)]
    hv_p, hv_u = hessian_vector_product(loss_fn, [p, u], v, method=method, fd_step=1e-6)  # type: ignore[arg-type]
    torch.testing.assert_close(hv_p, 6 * p.detach() * v[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(hv_u, torch.zeros(2, dtype=torch.float64))


def test_finite_difference_along_a_zero_vector_is_zero() -> None:
    p, u, loss_fn = cubic_problem()
    zero = [torch.zeros(3, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)]
    hv = hessian_vector_product(loss_fn, [p, u], zero, method="finite_difference")  # type: ignore[arg-type]
    assert [h.shape for h in hv] == [(3,), (2,)] and all(torch.equal(h, torch.zeros_like(h)) for h in hv)


def test_finite_difference_uses_the_given_gradient_at_the_parameters() -> None:
    """``grads_at_params`` (the step's, already reduced over ranks) is ∇L(θ) in the difference, not recomputed:
    with a given base g₀ the product is (∇L(θ + εv) − g₀)/ε."""
    p, _, loss_fn = cubic_problem()
    v = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    base = 3 * p.detach() ** 2 + torch.tensor([0.0, 1e-3, 0.0], dtype=torch.float64)  # off by 1e-3 in entry 1
    (hv,) = hessian_vector_product(loss_fn, [p], [v], method="finite_difference", grads_at_params=[base], fd_step=1e-3)
    want = torch.tensor([6.0 * 1.0 + 3e-3, -1.0, 0.0], dtype=torch.float64)  # entry 1: −1e-3/ε
    torch.testing.assert_close(hv, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    ("method", "given_base"), [("double_backprop", False), ("finite_difference", False), ("finite_difference", True)]
)
def test_reduce_is_applied_to_what_the_local_batch_gives(method: str, given_base: bool) -> None:
    """``reduce_`` runs once: on the product when everything is local, on ∇L(θ + εv) when ∇L(θ) is given
    (already global). A reduction that doubles shows which: 2·Hv, or (2∇L(θ + εv) − ∇L(θ))/ε."""
    p, _, loss_fn = cubic_problem()
    v = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    calls: list[list[torch.Tensor]] = []

    def double_(tensors: list[torch.Tensor]) -> None:
        calls.append([t.clone() for t in tensors])
        for t in tensors:
            t.mul_(2)

    g0 = 3 * p.detach() ** 2
    grads = [g0] if given_base else None
    (hv,) = hessian_vector_product(
        loss_fn, [p], [v], method=method, grads_at_params=grads, reduce_=double_, fd_step=1e-3
    )  # type: ignore[arg-type]
    assert len(calls) == 1
    shifted = 3 * (p.detach() + 1e-3 * v) ** 2
    if not given_base:
        exact = 6 * p.detach() * v + (0 if method == "double_backprop" else 3e-3 * v * v)
        torch.testing.assert_close(calls[0][0], exact, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(hv, 2 * exact, rtol=1e-9, atol=1e-9)
    else:
        torch.testing.assert_close(calls[0][0], shifted, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(hv, (2 * shifted - g0) / 1e-3, rtol=1e-9, atol=1e-6)


def test_all_reduce_mean_averages_over_ranks_in_one_flat_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake 2-rank group whose other rank holds ``other``: every tensor becomes the mean, piece by piece."""
    import torch.distributed as dist

    from lightning_bnp.core.regularization import all_reduce_mean_

    other = torch.arange(12, dtype=torch.float64)
    collectives: list[int] = []

    def all_reduce(flat: torch.Tensor) -> None:
        collectives.append(flat.numel())
        flat += other

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    a, b = torch.ones(2, 3, dtype=torch.float64), torch.full((4,), 3.0, dtype=torch.float64)
    c = torch.full((2,), 5.0, dtype=torch.float64)  # a third piece: its offset is 6 + 4, not 4
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    all_reduce_mean_([a, b, c])  # one rank: nothing to do
    assert collectives == [] and torch.equal(a, torch.ones(2, 3, dtype=torch.float64))
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    all_reduce_mean_([a, b, c])
    assert collectives == [12]
    torch.testing.assert_close(a, (1 + other[:6].view(2, 3)) / 2, rtol=0, atol=0)
    torch.testing.assert_close(b, (3 + other[6:10]) / 2, rtol=0, atol=0)
    torch.testing.assert_close(c, (5 + other[10:]) / 2, rtol=0, atol=0)


def test_z_weight_decay_bias_term_stays_on_the_device_of_its_input() -> None:
    from lightning_bnp.core.regularization import z_weight_decay_

    decay_b = z_weight_decay_(torch.empty(3, 4, device="meta"), torch.empty(4, device="meta"), 1)
    assert decay_b.device.type == "meta" and decay_b.shape == (3,)
