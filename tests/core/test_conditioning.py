"""Weight Conditioning in plain torch: the paper's formulas (§4) in its orientation, gradients,
Van der Sluis (Thm. 5.1 / Prop. 1), selection, idempotence, baking, compile."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.nn.utils import parametrize

import lightning_bnp.core.conditioning as conditioning
from example_projects.models import cnn5
from lightning_bnp.core.conditioning import (
    Equilibration,
    apply_weight_conditioning,
    bake_weight_conditioning,
    condition_number,
    conditioned_layers,
    equilibrate,
    zero_norm_count,
)
from tests.helpers import make_cnn, make_data, make_mlp

MODES = ("row", "column", "row_column")
# (out, in/groups, *kernel) shapes: Linear, Conv1d, grouped Conv2d, Conv3d
SHAPES = [(5, 7), (3, 8), (4, 2, 3), (6, 3, 3, 3), (2, 3, 2, 2, 2)]


@pytest.fixture(params=["fused", "autograd"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test through the custom autograd Function (large weights) and plain autograd ops (small)."""
    monkeypatch.setattr(conditioning, "FUSED_MIN_NUMEL", 0 if request.param == "fused" else 2**62)
    return str(request.param)


# ------------------------------------------------------------------ the paper's formulas, explicitly
def paper_matrix(weight: Tensor) -> Tensor:
    """The paper's W (n_in, n_out) = PyTorch weight.T; a kernel's n_in is in/groups·∏k."""
    return weight.reshape(weight.shape[0], -1).T


def row_equilibrator(a: Tensor) -> Tensor:
    """Paper §4: diagonal n×n matrix with 1/‖A_{i:}‖₂ on the diagonal."""
    return torch.diag(1.0 / torch.stack([a[i, :].norm() for i in range(a.shape[0])]))


def column_equilibrator(a: Tensor) -> Tensor:
    """Paper §4: diagonal m×m matrix with 1/‖A_{:j}‖₂ on the diagonal."""
    return torch.diag(1.0 / torch.stack([a[:, j].norm() for j in range(a.shape[1])]))


def paper_formula(weight: Tensor, mode: str) -> Tensor:
    """E·A, A·E or (E_r·A)·E_c(E_r·A), mapped back to PyTorch's layout."""
    a = paper_matrix(weight)
    if mode == "row":
        out = row_equilibrator(a) @ a
    elif mode == "column":
        out = a @ column_equilibrator(a)
    else:
        left = row_equilibrator(a) @ a
        out = left @ column_equilibrator(left)
    return out.T.reshape(weight.shape)


def test_orientation_on_an_explicit_matrix(path: str) -> None:
    """Paper W (n_in=2, n_out=3) = PyTorch weight.T; numbers worked out by hand.

    W = [[3, 0, 4],      paper rows (input features) have norms 5 and 13 (= PyTorch columns);
         [0, 12, 5]]     paper columns (output neurons) have norms 3, 12, √41 (= PyTorch rows).
    """
    weight = torch.tensor([[3.0, 0.0], [0.0, 12.0], [4.0, 5.0]], dtype=torch.float64)  # (out=3, in=2)
    row = torch.tensor([[3 / 5, 0, 4 / 5], [0, 12 / 13, 5 / 13]], dtype=torch.float64)  # E·W: rows / (5, 13)
    r41 = math.sqrt(41)
    column = torch.tensor([[1, 0, 4 / r41], [0, 1, 5 / r41]], dtype=torch.float64)  # W·E: columns / (3, 12, √41)
    # row_column: columns of E·W have norms 3/5, 12/13 and √((4/5)²+(5/13)²)
    c3 = math.hypot(4 / 5, 5 / 13)
    row_column = torch.tensor([[1, 0, 4 / 5 / c3], [0, 1, 5 / 13 / c3]], dtype=torch.float64)
    for mode, paper in (("row", row), ("column", column), ("row_column", row_column)):
        layer = nn.Linear(2, 3, bias=False).double()
        layer.weight = nn.Parameter(weight.clone())
        apply_weight_conditioning(layer, mode=mode)  # type: ignore[arg-type]
        torch.testing.assert_close(layer.weight.T, paper, rtol=1e-15, atol=1e-15, msg=mode)
        x = torch.tensor([[1.0, 0.0]], dtype=torch.float64)  # input feature 0: F·W picks paper row 0
        torch.testing.assert_close(layer(x), paper[:1], rtol=1e-15, atol=1e-15, msg=mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES)
def test_parametrized_weight_equals_the_paper_formula(mode: str, shape: tuple[int, ...], path: str) -> None:
    weight = torch.randn(*shape, dtype=torch.float64) * torch.logspace(-2, 2, shape[0], dtype=torch.float64).view(
        -1, *[1] * (len(shape) - 1)
    )
    layer = nn.Linear(1, 1).double()  # any module with a `weight`; its shape follows the parameter
    layer.weight = nn.Parameter(weight.clone())
    parametrize.register_parametrization(layer, "weight", Equilibration(mode))  # type: ignore[arg-type]
    torch.testing.assert_close(layer.weight, paper_formula(weight, mode), rtol=1e-12, atol=1e-14)
    assert torch.equal(layer.parametrizations.weight.original, weight)  # the free parameter is untouched


def test_row_column_is_sequential_not_simultaneous() -> None:
    """Column norms are taken of the row-equilibrated matrix, not of W itself."""
    weight = torch.randn(4, 6, dtype=torch.float64) * torch.logspace(-1, 1, 6, dtype=torch.float64)
    a = paper_matrix(weight)
    simultaneous = (row_equilibrator(a) @ a @ column_equilibrator(a)).T
    conditioned = equilibrate(weight, "row_column")
    assert not torch.allclose(conditioned, simultaneous, atol=1e-3)
    torch.testing.assert_close(conditioned.norm(dim=1), torch.ones(4, dtype=torch.float64))  # unit output neurons


def test_row_mode_gives_every_input_feature_unit_outgoing_weights() -> None:
    """Orientation, semantically: feeding the basis vector e_i returns input i's outgoing weights."""
    layer = nn.Linear(5, 3)
    layer.weight.data *= torch.tensor([0.01, 1.0, 100.0]).view(3, 1)
    apply_weight_conditioning(layer, mode="row")
    responses = layer(torch.eye(5)) - layer.bias  # row i: the outgoing weights of input feature i
    torch.testing.assert_close(responses.norm(dim=1), torch.ones(5))
    apply_weight_conditioning(other := nn.Linear(5, 3), mode="column")
    torch.testing.assert_close((other(torch.eye(5)) - other.bias).norm(dim=0), torch.ones(3))  # per output


def test_conv_output_uses_the_equilibrated_kernel() -> None:
    conv = nn.Conv2d(4, 6, 3, groups=2, padding=1).double()
    kernel = conv.weight.detach().clone()
    apply_weight_conditioning(conv, mode="row")
    x = torch.randn(2, 4, 5, 5, dtype=torch.float64)
    expected = F.conv2d(x, paper_formula(kernel, "row"), conv.bias, padding=1, groups=2)
    torch.testing.assert_close(conv(x), expected)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(MODES), st.sampled_from(SHAPES), st.floats(-3, 3), st.integers(0, 2**31 - 1))
def test_equilibrated_vectors_have_unit_norm(mode: str, shape: tuple[int, ...], log_scale: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    w = equilibrate(torch.randn(*shape, generator=g, dtype=torch.float64) * 10**log_scale, mode)  # type: ignore[arg-type]
    w2 = w.reshape(shape[0], -1)
    ones = torch.ones(1, dtype=torch.float64)
    if mode == "row":  # paper rows = PyTorch columns
        torch.testing.assert_close(w2.norm(dim=0), ones.expand(w2.shape[1]))
    else:  # the last step normalises output neurons = PyTorch rows
        torch.testing.assert_close(w2.norm(dim=1), ones.expand(shape[0]))
    if mode != "row_column":  # one-sided equilibration is a projection (row-column is one Sinkhorn-like sweep)
        torch.testing.assert_close(equilibrate(w, mode), w)  # type: ignore[arg-type]


# ------------------------------------------------------------------ gradients and numerics
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(4, 3), (3, 2, 2, 2)])
def test_gradcheck(mode: str, shape: tuple[int, ...], path: str) -> None:
    weight = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda w: equilibrate(w, mode), (weight,))  # type: ignore[arg-type]
    assert torch.autograd.gradgradcheck(lambda w: equilibrate(w, mode), (weight,))  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", MODES)
def test_all_zero_vectors_give_finite_outputs_and_gradients(mode: str, path: str) -> None:
    layer = nn.Linear(4, 3)
    with torch.no_grad():
        layer.weight[:, 1] = 0.0  # input feature 1 has no outgoing weights (a paper row)
        layer.weight[2, :] = 0.0  # output neuron 2 has no incoming weights (a paper column)
    apply_weight_conditioning(layer, mode=mode)  # type: ignore[arg-type]
    out = layer(torch.randn(8, 4))
    out.square().sum().backward()
    grad = layer.parametrizations.weight.original.grad
    assert torch.isfinite(out).all() and grad is not None and torch.isfinite(grad).all()
    assert (layer.weight[:, 1] == 0).all() and (layer.weight[2, :] == 0).all()
    assert zero_norm_count(layer.parametrizations.weight.original, mode) == 1  # type: ignore[arg-type]


def test_eps_is_a_threshold_of_the_norm_not_an_offset(path: str) -> None:
    """Vectors above ε get exactly unit norm (not 1/(‖w‖ + ε)); vectors at or below ε are left as they are."""
    weight = torch.tensor([[3.0, 1e-3], [4.0, 0.0]], dtype=torch.float64)
    out = equilibrate(weight, "row", eps=1e-2)
    torch.testing.assert_close(out[:, 0], torch.tensor([0.6, 0.8], dtype=torch.float64), rtol=1e-12, atol=0)
    assert torch.equal(out[:, 1], weight[:, 1])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(3, 4), (128, 130)])  # the plain-autograd and the fused (≥ 2¹⁴) path
def test_a_zero_vector_has_an_identity_jacobian(mode: str, shape: tuple[int, int]) -> None:
    """Issue 15, item 6: the gradient of a zero vector is the plain gradient (unit scale), not 1/ε = 1e12
    times it (1e24 through both sweeps of row-column), in first and second order."""
    torch.manual_seed(0)
    weight = torch.randn(*shape, dtype=torch.float64)
    weight[:, 1] = 0.0  # a zero paper row (input feature 1)
    weight[2, :] = 0.0  # a zero paper column (output neuron 2)
    grad_out = torch.randn_like(weight)
    w = weight.clone().requires_grad_()
    (grad,) = torch.autograd.grad(equilibrate(w, mode), w, grad_out, create_graph=True)  # type: ignore[arg-type]
    zero_vector = (slice(None), 1) if mode != "column" else (2, slice(None))
    # the zero vector's own entries: E leaves it as it is, so ∂y/∂w there is the identity
    free = [i for i in range(shape[0]) if i != 2] if mode == "row_column" else list(range(shape[0]))
    rows = torch.tensor(free) if zero_vector[1] == 1 else torch.tensor([2])
    cols = torch.tensor([1]) if zero_vector[1] == 1 else torch.arange(shape[1])
    got, want = grad[rows[:, None], cols[None, :]], grad_out[rows[:, None], cols[None, :]]
    if mode == "row_column":  # the column sweep then scales neuron i's row by 1/‖(E_r W)_i‖
        row_norms = torch.linalg.vector_norm(equilibrate(weight, "row")[free], dim=1, keepdim=True)
        want = want / row_norms
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert grad.abs().max() < 1e3
    (second,) = torch.autograd.grad((grad * torch.randn_like(grad)).sum(), w)  # double backward stays finite
    assert torch.isfinite(second).all()
    zero = torch.zeros(*shape, dtype=torch.float64, requires_grad=True)  # all zero: y = 0, ∂y/∂w = I
    (grad,) = torch.autograd.grad(equilibrate(zero, mode), zero, grad_out)  # type: ignore[arg-type]
    assert torch.equal(grad, grad_out)


@pytest.mark.parametrize("mode", MODES)
def test_a_zero_initialised_layer_trains_under_every_mode(mode: str) -> None:
    """Issue 15, item 6: row-column on a zero-initialised head stayed 0 forever (``original`` jumped to
    ~1e22, its float32 squared norm overflowed); row/column threw ``original`` to ~1e10. Now every mode
    trains like an unconditioned start, ``original`` stays moderate and the promise holds: after the
    first step the conditioned vectors have unit norm."""
    x, y = make_data(n=64)[:]
    losses, originals = {}, {}
    for m in ("row", mode):
        net = make_mlp(hidden=16)
        nn.init.zeros_(net[2].weight)
        apply_weight_conditioning(net, mode=m)  # type: ignore[arg-type]
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        history = []
        for _ in range(60):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            history.append(loss.item())
        losses[m], originals[m] = history, net[2].parametrizations.weight.original.detach()
        head = net[2].weight.detach()
        unit = head.norm(dim=1) if m != "row" else head.norm(dim=0)  # neurons (column, row-column) or features
        torch.testing.assert_close(unit, torch.ones_like(unit))
    assert losses[mode][-1] < losses[mode][0] - 0.15, losses[mode]
    assert abs(losses[mode][-1] - losses["row"][-1]) < 0.05
    assert torch.isfinite(originals[mode]).all() and originals[mode].abs().max() < 10


def test_half_precision_weights_are_equilibrated_in_float32() -> None:
    weight = torch.randn(6, 5) * 1e3
    out = equilibrate(weight.bfloat16(), "row_column")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), equilibrate(weight.bfloat16().float(), "row_column"), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("mode", MODES)
def test_fused_backward_equals_autograd_of_the_formula(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The analytic VJP of the custom Function, with clamped (all-zero) vectors, vs autograd."""
    weight = torch.randn(6, 3, 2, 2, dtype=torch.float64)
    weight[:, 1] = 0.0  # 4 all-zero paper rows (input channel 1 at every kernel position)
    weight[4] = 0.0  # an all-zero output neuron
    grad_out = torch.randn_like(weight)
    grads = []
    for numel in (0, 2**62):
        monkeypatch.setattr(conditioning, "FUSED_MIN_NUMEL", numel)
        w = weight.clone().requires_grad_()
        (grad,) = torch.autograd.grad(equilibrate(w, mode), w, grad_out)  # type: ignore[arg-type]
        grads.append(grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_norms_are_not_downcast_by_autocast(mode: str, path: str) -> None:
    """Under bf16 autocast the conditioned float32 weight is bitwise the float32 one."""
    weight = torch.randn(16, 8, 3, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = equilibrate(weight, mode)  # type: ignore[arg-type]
    assert out.dtype == torch.float32 and torch.equal(out, equilibrate(weight, mode))  # type: ignore[arg-type]
    meta = torch.empty(16, 8, 3, 3, device="meta", requires_grad=True)  # deferred init: shapes only
    equilibrate(meta, mode).sum().backward()  # type: ignore[arg-type]
    assert meta.grad is not None and meta.grad.shape == meta.shape


# ------------------------------------------------------------------ Van der Sluis (paper Thm. 5.1, Prop. 1)
def row_equilibrated(a: Tensor) -> Tensor:
    """E·A computed by the parametrization: a Linear whose weight is the paper's A transposed."""
    layer = nn.Linear(a.shape[0], a.shape[1], bias=False).double()
    layer.weight = nn.Parameter(a.T.clone())
    apply_weight_conditioning(layer, mode="row")
    return layer.weight.detach().T


def kappa(a: Tensor) -> float:
    return condition_number(a.T)  # condition_number takes PyTorch's layout; κ(Aᵀ) = κ(A)


@st.composite
def scaled_matrices(draw: st.DrawFn, rows: st.SearchStrategy[int], cols: st.SearchStrategy[int]) -> Tensor:
    """Random full-rank matrices with rows scaled over up to 6 decades (where scaling matters)."""
    m, n, seed = draw(rows), draw(cols), draw(st.integers(0, 2**31 - 1))
    spread = draw(st.floats(0.0, 6.0))
    g = torch.Generator().manual_seed(seed)
    scales = 10 ** (spread * (torch.rand(m, 1, generator=g, dtype=torch.float64) - 0.5))
    return torch.randn(m, n, generator=g, dtype=torch.float64) * scales


TOL = 1 + 1e-9


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_van_der_sluis_row_equilibration_is_within_sqrt_m_of_every_diagonal_scaling(data: st.DataObject) -> None:
    """m ≤ n: κ₂(E·A) ≤ √m · κ₂(D·A) for every diagonal D (Van der Sluis), in particular D = I."""
    a = data.draw(scaled_matrices(st.integers(1, 6), st.integers(6, 9)))
    m = a.shape[0]
    d = torch.diag(10 ** (4 * (torch.rand(m, dtype=torch.float64) - 0.5)))
    e_a = row_equilibrated(a)
    assert kappa(e_a) <= math.sqrt(m) * kappa(a) * TOL
    assert kappa(e_a) <= math.sqrt(m) * kappa(d @ a) * TOL


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_row_equilibration_is_within_sqrt_m_of_the_raw_matrix_in_every_shape(data: st.DataObject) -> None:
    """Full-rank A of any shape: ‖E·A‖₂ ≤ √m and σ_min(E·A) ≥ σ_min(A)/‖A‖₂, so κ(E·A) ≤ √m·κ(A)."""
    a = data.draw(scaled_matrices(st.integers(1, 9), st.integers(1, 9)))
    assert kappa(row_equilibrated(a)) <= math.sqrt(a.shape[0]) * kappa(a) * TOL


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_paper_prop1_holds_for_two_rows(data: st.DataObject) -> None:
    """With two rows equal row norms are the optimal scaling, so the paper's κ(E·W) ≤ κ(W) holds."""
    a = data.draw(scaled_matrices(st.just(2), st.integers(2, 8)))
    assert kappa(row_equilibrated(a)) <= kappa(a) * TOL


@pytest.mark.parametrize(
    "a",
    [
        [[2.0, 0.0, 0.0], [2.0, 2.0, 1.0], [2.0, 1.0, 2.0]],  # square: κ 4.372 → 4.731
        [[1.0, 0.0], [0.0, 1.0], [0.0, 0.01]],  # tall (n_in > n_out): κ 1.00005 → √2
    ],
)
def test_paper_prop1_fails_without_the_sqrt_m_factor(a: list[list[float]]) -> None:
    """Counterexamples to the paper's Prop. 1 (κ(E·W) ≤ κ(W)); the √m bound above still holds."""
    w = torch.tensor(a, dtype=torch.float64)
    assert kappa(row_equilibrated(w)) > 1.05 * kappa(w)
    assert kappa(row_equilibrated(w)) <= math.sqrt(w.shape[0]) * kappa(w)


# ------------------------------------------------------------------ selection, idempotence, baking
def test_selection_all_first_and_last_and_patterns() -> None:
    net = cnn5()
    assert list(apply_weight_conditioning(cnn5(), layers="all")) == ["0", "3", "6", "9", "11"]
    assert list(apply_weight_conditioning(net, layers="first_and_last")) == ["0", "11"]  # first conv, last dense
    assert set(conditioned_layers(net)) == {"0", "11"}
    assert list(apply_weight_conditioning(cnn5(), include=["?"], exclude=["6"])) == ["0", "3", "9"]
    assert list(apply_weight_conditioning(cnn5(), layers="first_and_last", layer_types=["Conv2d"])) == ["0", "6"]
    assert list(apply_weight_conditioning(make_mlp(), layers="first_and_last", include=["2"])) == ["2"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "rows"}, r"`mode` must be one of \['row', 'column', 'row_column'\], got 'rows'"),
        ({"layers": "first"}, r"`layers` must be 'all' or 'first_and_last', got 'first'"),
        ({"eps": 0.0}, r"`eps` must be a finite number > 0, got 0.0"),
        ({"eps": math.inf}, r"`eps` must be a finite number > 0, got inf"),
        ({"layer_types": ["Dense"]}, r"`layer_types` must be a subset of .* got unknown \['Dense'\]"),
        ({"exclude": []}, r"`exclude` must be None or a non-empty list of patterns, got \[\]"),
        ({"include": ["encoder.*"]}, r"`include` pattern 'encoder.\*' matches no"),
        ({"exclude": ["*"]}, r"no Linear/Conv1d/Conv2d/Conv3d layer is left for WeightConditioning"),
    ],
)
def test_invalid_selection_is_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        apply_weight_conditioning(make_mlp(), **kwargs)


def test_applying_twice_is_a_no_op_and_another_mode_is_refused() -> None:
    net = make_cnn()
    apply_weight_conditioning(net, mode="row")
    keys, x = list(net.state_dict()), torch.randn(3, 2, 6, 6)
    out = net(x)
    apply_weight_conditioning(net, mode="row")
    assert list(net.state_dict()) == keys and torch.equal(net(x), out)
    assert all(len(m.parametrizations.weight) == 1 for m in net.modules() if parametrize.is_parametrized(m))
    with pytest.raises(ValueError, match=r"layer '0' is already conditioned with mode='row'.*refusing"):
        apply_weight_conditioning(net, mode="column")


def test_no_weight_parameter_is_refused() -> None:
    with pytest.raises(ValueError, match=r"layer '' has no `weight` parameter"):
        apply_weight_conditioning(nn.LazyLinear(3))


def test_state_dict_loads_into_the_same_setup_only() -> None:
    trained, fresh = make_cnn(seed=0), make_cnn(seed=1)
    apply_weight_conditioning(trained, mode="row_column")
    apply_weight_conditioning(fresh, mode="row_column")
    assert "0.parametrizations.weight.original" in trained.state_dict()
    fresh.load_state_dict(trained.state_dict())
    x = torch.randn(2, 2, 6, 6)
    assert torch.equal(fresh(x), trained(x))
    with pytest.raises(RuntimeError, match=r"parametrizations\.weight\.original"):
        make_cnn().load_state_dict(trained.state_dict())


@pytest.mark.parametrize("mode", MODES)
def test_bake_keeps_outputs_and_removes_every_parametrization(mode: str) -> None:
    net = cnn5(image_size=8, padding="same")
    apply_weight_conditioning(net, mode=mode)  # type: ignore[arg-type]
    original = net[0].parametrizations.weight.original
    x = torch.randn(4, 1, 8, 8)
    before = net(x)
    assert bake_weight_conditioning(net) == ["0", "3", "6", "9", "11"]
    assert not any(parametrize.is_parametrized(m) for m in net.modules())
    assert type(net[0]) is nn.Conv2d and net[0].weight is original  # same Parameter: optimizers stay valid
    torch.testing.assert_close(net(x), before, rtol=0, atol=0)
    plain = cnn5(image_size=8, padding="same")
    plain.load_state_dict(net.state_dict())  # plain `weight` keys again
    torch.testing.assert_close(plain(x), before, rtol=0, atol=0)
    assert bake_weight_conditioning(net) == []


# ------------------------------------------------------------------ pins found by mutation testing (issue 27)
def explicit_row_vjp(weight: Tensor, grad_out: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Row mode column by column: y = w/‖w‖ and w̄ = (ȳ − y·(yᵀȳ))/‖w‖ where ‖w‖ > ε, else y = w and w̄ = ȳ."""
    ys, grads = [], []
    for j in range(weight.shape[1]):
        w, g = weight[:, j], grad_out[:, j]
        n = math.sqrt(sum(float(v) ** 2 for v in w))
        if n > eps:
            y = w / n
            ys.append(y)
            grads.append((g - y * float(y @ g)) / n)
        else:
            ys.append(w)
            grads.append(g)
    return torch.stack(ys, dim=1), torch.stack(grads, dim=1)


@pytest.mark.parametrize("create_graph", [False, True])
def test_a_vector_of_norm_exactly_eps_is_left_as_it_is(path: str, create_graph: bool) -> None:
    """ε is a threshold: norm ≤ ε keeps the vector and an identity Jacobian, norm > ε (also below 1) gets unit
    norm and the projected gradient; in the forward, the backward, and the backward under ``create_graph``."""
    eps = 0.5  # ‖(0.5, 0)‖² = 0.25 = ε² exactly in floating point
    weight = torch.tensor([[0.5, 0.36, 3.0, 0.0], [0.0, 0.48, 4.0, 0.0]], dtype=torch.float64)
    grad_out = torch.tensor([[1.0, -2.0, 0.5, 3.0], [2.0, 2.5, -1.0, -1.0]], dtype=torch.float64)
    want_y, want_grad = explicit_row_vjp(weight, grad_out, eps)
    torch.testing.assert_close(want_y[:, 1:3], torch.tensor([[0.6, 0.6], [0.8, 0.8]], dtype=torch.float64))
    for mode, w0, g0, y0, gw0 in (
        ("row", weight, grad_out, want_y, want_grad),
        ("column", weight.T, grad_out.T, want_y.T, want_grad.T),  # PyTorch rows: the same vectors
    ):
        w = w0.clone().requires_grad_()
        y = equilibrate(w, mode, eps=eps)  # type: ignore[arg-type]
        torch.testing.assert_close(y, y0, rtol=1e-14, atol=1e-15, msg=mode)
        (grad,) = torch.autograd.grad(y, w, g0, create_graph=create_graph)
        torch.testing.assert_close(grad, gw0, rtol=1e-12, atol=1e-14, msg=mode)


@pytest.mark.parametrize("mode", MODES)
def test_norms_are_float32_accurate_under_and_outside_autocast(mode: str, path: str) -> None:
    """The norms inside the equilibration are never taken in bfloat16, autocast or not: the float32 result
    matches the float64 paper formula to float32 rounding (a bfloat16 norm is off by ~1e-3)."""
    torch.manual_seed(0)
    weight = torch.randn(6, 5) * torch.logspace(-1, 1, 5)
    want = paper_formula(weight.double(), mode).float()
    torch.testing.assert_close(equilibrate(weight, mode), want, rtol=2e-6, atol=1e-7)  # type: ignore[arg-type]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = equilibrate(weight, mode)  # type: ignore[arg-type]
    torch.testing.assert_close(out, want, rtol=2e-6, atol=1e-7)


def test_defaults_are_row_mode_and_eps_1e_12(path: str) -> None:
    torch.manual_seed(0)
    weight = torch.randn(4, 3, dtype=torch.float64)
    torch.testing.assert_close(equilibrate(weight), weight / weight.norm(dim=0, keepdim=True))  # the docstring's
    parametrization = Equilibration()
    assert (parametrization.mode, parametrization.eps) == ("row", 1e-12)
    torch.testing.assert_close(parametrization(weight), weight / weight.norm(dim=0, keepdim=True))


def test_eps_reaches_the_parametrization() -> None:
    """``eps`` given to Equilibration / apply_weight_conditioning is the one the forward uses: a vector of norm
    1e-3 < ε = 1e-2 is left as it is (with the default ε = 1e-12 it would be scaled to unit norm)."""
    weight = torch.tensor([[3.0, 1e-3], [4.0, 0.0]], dtype=torch.float64)
    out = Equilibration("row", eps=1e-2)(weight)
    assert torch.equal(out[:, 1], weight[:, 1])
    layer = nn.Linear(2, 2, bias=False).double()
    layer.weight = nn.Parameter(weight.clone())
    apply_weight_conditioning(layer, eps=1e-2)
    assert layer.parametrizations.weight[0].eps == 1e-2
    assert torch.equal(layer.weight[:, 1], weight[:, 1])
    torch.testing.assert_close(layer.weight[:, 0], torch.tensor([0.6, 0.8], dtype=torch.float64))


def test_weights_of_at_least_fused_min_numel_elements_use_the_custom_function() -> None:
    """The documented threshold: 2¹⁴ elements and more go through ``_Equilibrate`` (its analytic backward)."""

    def uses_custom_function(weight: Tensor) -> bool:
        seen, stack = set(), [equilibrate(weight.requires_grad_()).grad_fn]
        while stack:
            fn = stack.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            if "_Equilibrate" in type(fn).__name__:
                return True
            stack.extend(f for f, _ in fn.next_functions)
        return False

    assert conditioning.FUSED_MIN_NUMEL == 2**14
    assert uses_custom_function(torch.randn(128, 128))  # exactly 2¹⁴
    assert not uses_custom_function(torch.randn(127, 129))  # 2¹⁴ − 1


@pytest.mark.parametrize("mode", MODES)
def test_float16_weights_whose_squares_overflow_are_equilibrated_in_float32(mode: str, path: str) -> None:
    """300² = 9e4 > 65504 (the largest float16): the norms must be taken in float32, else they overflow to inf
    and the conditioned weight is 0."""
    weight = torch.tensor([[300.0, -200.0, 250.0], [240.0, 310.0, -150.0]], dtype=torch.float16)
    out = equilibrate(weight, mode)  # type: ignore[arg-type]
    assert out.dtype == torch.float16
    assert torch.equal(out, equilibrate(weight.float(), mode).half())  # type: ignore[arg-type]
    unit = out.float().norm(dim=0 if mode == "row" else 1)
    torch.testing.assert_close(unit, torch.ones_like(unit), rtol=2e-3, atol=0)


def test_zero_norm_count_counts_the_vectors_the_first_step_normalises() -> None:
    """row and row_column normalise PyTorch columns first (input features), column PyTorch rows; norms ≤ ε count."""
    weight = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 2.0, 3.0], [0.0, 0.0, 0.0, 0.0]])  # 1 zero column, 2 rows
    assert zero_norm_count(weight) == 1  # default: row
    assert [zero_norm_count(weight, m) for m in MODES] == [1, 2, 1]  # type: ignore[arg-type]
    three_four = torch.tensor([[3.0], [4.0]])  # one column of norm exactly 5
    assert zero_norm_count(three_four, "row", eps=5.0) == 1  # ≤ ε
    assert zero_norm_count(three_four, "row", eps=4.999) == 0
    # float16 norms are taken in float32: ‖(2048, 64)‖ = 2048.9998, which float16 rounds to 2048 ≤ 2048.5
    half = torch.tensor([[2048.0], [64.0]], dtype=torch.float16)
    assert zero_norm_count(half, "row", eps=2048.5) == 0
    assert zero_norm_count(half, "row", eps=2049.5) == 1


def test_condition_number_is_taken_in_float64_and_infinite_when_rank_deficient() -> None:
    assert condition_number(torch.zeros(3, 2)) == math.inf  # σ_max = σ_min = 0
    assert condition_number(torch.tensor([[2.0, 0.0], [0.0, 0.0]])) == math.inf
    torch.testing.assert_close(condition_number(torch.tensor([[2.0, 0.0], [0.0, 0.5]])), 4.0)
    # a float32 matrix with κ ≈ 1e6: float32 SVD gets σ_min wrong by ~10 %, float64 to ~1e-10
    c, s = math.cos(0.3), math.sin(0.3)
    rot = torch.tensor([[c, -s], [s, c]], dtype=torch.float64)
    w32 = (rot @ torch.diag(torch.tensor([1.0, 1e-6], dtype=torch.float64)) @ rot.T).float()
    sv = torch.linalg.svdvals(w32.double())
    assert condition_number(w32) == pytest.approx(float(sv[0] / sv[1]), rel=1e-8)


def test_a_layer_with_another_parametrized_tensor_is_conditioned() -> None:
    """A parametrization on the bias is no Weight Conditioning, and does not stop conditioning the weight."""

    class Double(nn.Module):
        def forward(self, t: Tensor) -> Tensor:
            return 2 * t

    layer = nn.Linear(3, 2)
    parametrize.register_parametrization(layer, "bias", Double())
    assert conditioned_layers(layer) == {}
    assert list(apply_weight_conditioning(layer)) == [""]
    assert list(conditioned_layers(layer)) == [""]
    torch.testing.assert_close(layer.weight.norm(dim=0), torch.ones(3))


def test_applying_to_a_partly_conditioned_model_conditions_the_rest() -> None:
    net = make_mlp()
    apply_weight_conditioning(net, include=["0"])
    assert list(conditioned_layers(net)) == ["0"]
    assert list(apply_weight_conditioning(net)) == ["0", "2"]
    assert list(conditioned_layers(net)) == ["0", "2"]
    assert len(net[0].parametrizations.weight) == 1


def test_a_layer_without_a_plain_weight_is_refused_with_the_reason() -> None:
    head = "layer '' has no `weight` parameter to condition: "
    lazy = head + "it is an uninitialised lazy layer (run one forward pass first)"
    with pytest.raises(ValueError, match=re.escape(lazy)):
        apply_weight_conditioning(nn.LazyLinear(3))
    no_weight = nn.Linear(3, 2)
    no_weight.register_parameter("weight", None)
    message = head + "its weight is not a parameter; WeightConditioning needs a plain one"
    with pytest.raises(ValueError, match=re.escape(message)):
        apply_weight_conditioning(no_weight)


# ------------------------------------------------------------------ torch.compile
@pytest.fixture(scope="module")
def compile_works() -> None:
    try:
        torch.compile(lambda t: t * 2 + 1)(torch.ones(2))
    except Exception as err:  # no C++ toolchain for inductor on this machine
        pytest.skip(f"torch.compile does not work here: {type(err).__name__}: {err}"[:300])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["row_column"])
def test_compiled_conditioned_model_matches_eager(compile_works: None, mode: str, path: str) -> None:
    """Dynamo traces the parametrization, the custom autograd Function included (no graph break needed)."""
    torch._dynamo.reset()
    eager, compiled = make_cnn(), make_cnn()
    for net in (eager, compiled):
        apply_weight_conditioning(net, mode=mode)  # type: ignore[arg-type]
    x = torch.randn(5, 2, 6, 6)
    eager(x).square().sum().backward()
    fn = torch.compile(compiled, fullgraph=True)  # no graph break
    out = fn(x)
    out.square().sum().backward()
    torch.testing.assert_close(out, eager(x))
    for p, q in zip(compiled.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
