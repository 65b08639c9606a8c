"""ZSpaceRegularization: each mode's SGD step equals its formula with explicit matrices (paper 001)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins import MixedPrecision
from torch import Tensor, nn
from typing_extensions import override

from lightning_bnp import BatchNormPreconditioning
from lightning_bnp.callbacks.regularization import ZSpaceRegularization
from tests.helpers import BoringClassifier, _fit, make_data

LR, BATCH = 0.1, 4


def make_net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.LayerNorm(4), nn.Linear(4, 3))


def explicit_step_quantities(net: nn.Sequential, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """g = ∇L, the full Hessian H and the block-diagonal M = (1/q²)PPᵀ of the first BNP step, built
    independently of the package: batch statistics (bias-corrected running averages after one step),
    explicit P per output neuron, identity for the LayerNorm parameters."""
    net = net.double()
    x = x.double()
    names = [n for n, _ in net.named_parameters()]
    shapes = [p.shape for p in net.parameters()]
    sizes = [p.numel() for p in net.parameters()]
    offsets = dict(zip(names, torch.tensor([0, *sizes]).cumsum(0).tolist()))
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])

    def loss_of(theta: Tensor) -> Tensor:
        pieces = dict(zip(names, (t.view(s) for t, s in zip(theta.split(sizes), shapes))))
        return nn.functional.cross_entropy(torch.func.functional_call(net, pieces, (x,)), y)

    g = torch.autograd.grad(loss_of(flat.requires_grad_()), flat)[0]
    hessian = torch.autograd.functional.hessian(loss_of, flat.detach())
    with torch.no_grad():
        inputs = {"0": x, "3": net[2](net[1](net[0](x)))}
    m = torch.eye(flat.numel(), dtype=torch.float64)
    p_q = torch.eye(flat.numel(), dtype=torch.float64)  # p = P_q·z, M = P_q·P_qᵀ
    z_weights = torch.zeros_like(flat)  # z's weight coordinates of the BNP layers
    penalty_scale = torch.zeros_like(flat)  # q²·σ̃²_j on each BNP weight: λ‖z_w‖² = λ·Σ q²σ̃²_j w_ij²
    for layer, h in inputs.items():
        mu, var = h.mean(0), h.var(0, unbiased=False)
        var_t = var + 1e-2 * var.max() + 1e-4
        n_in, n_out = h.shape[1], net[int(layer)].out_features
        q2 = max(n_in / len(h), 1.0)
        u = torch.eye(n_in + 1, dtype=torch.float64)
        u[0, 1:] = -mu
        p = u @ torch.diag(torch.cat([torch.ones(1, dtype=torch.float64), var_t.rsqrt()]))
        block = p @ p.T / q2
        for i in range(n_out):
            idx = [offsets[f"{layer}.bias"] + i] + [offsets[f"{layer}.weight"] + i * n_in + j for j in range(n_in)]
            m[torch.tensor(idx)[:, None], torch.tensor(idx)[None, :]] = block
            p_q[torch.tensor(idx)[:, None], torch.tensor(idx)[None, :]] = p / q2**0.5
            z_weights[torch.tensor(idx[1:])] = 1.0
            penalty_scale[torch.tensor(idx[1:])] = q2 * var_t
    decay_mask = torch.zeros_like(flat)
    for name in ("0.weight", "3.weight"):  # exclude_bias_and_norm=True keeps only the BNP weights
        decay_mask[offsets[name] : offsets[name] + dict(zip(names, sizes))[name]] = 1.0
    return {
        "p": flat.detach(),
        "g": g,
        "H": hessian,
        "M": m,
        "mask": decay_mask,
        "P": p_q,
        "z_weights": z_weights,
        "penalty_scale": penalty_scale,
    }


def lightning_step(tmp_path: Path, callbacks: list[Any], net: nn.Module) -> Tensor:
    model = BoringClassifier(net, lr=LR)
    _fit(tmp_path, model, make_data(n=BATCH), batch_size=BATCH, callbacks=callbacks, max_steps=1, precision="64-true")
    return torch.cat([p.detach().reshape(-1) for p in model.network.parameters()])


@pytest.fixture(scope="module")
def quantities() -> dict[str, Tensor]:
    x, y = make_data(n=BATCH)[:]
    return explicit_step_quantities(make_net(), x, y)


LAM = 0.3


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"weight_decay": LAM, "decay_space": "z"}, lambda q: q["M"] @ q["g"] + 2 * LAM * q["p"]),
        ({"weight_decay": LAM, "decay_space": "p"}, lambda q: q["M"] @ (q["g"] + 2 * LAM * q["p"])),
        (  # gradient descent in z on λ‖z_w‖²: p moves by P·∇_z, z = P⁻¹p (the bias coordinate of z not decayed)
            {"weight_decay": LAM, "decay_space": "z", "exclude_bias_and_norm": True},
            lambda q: q["M"] @ q["g"] + q["P"] @ (2 * LAM * q["z_weights"] * torch.linalg.solve(q["P"], q["p"])),
        ),
        (
            {"weight_decay": LAM, "decay_space": "p", "exclude_bias_and_norm": True},
            lambda q: q["M"] @ (q["g"] + 2 * LAM * q["mask"] * q["p"]),
        ),
        (
            {"gradient_penalty": LAM, "hvp": "double_backprop"},
            lambda q: q["M"] @ q["g"] + 2 * LAM * q["M"] @ q["H"] @ q["M"] @ q["g"],
        ),
        (  # paper 001 eq. 11: M·∇_p(L + λ‖∇_p L‖²)
            {"gradient_penalty": LAM, "gradient_penalty_space": "p", "hvp": "double_backprop"},
            lambda q: q["M"] @ (q["g"] + 2 * LAM * q["H"] @ q["g"]),
        ),
    ],
)
def test_one_sgd_step_equals_the_formula(tmp_path: Path, quantities: dict, kwargs: dict, expected: Any) -> None:
    kwargs.setdefault("exclude_bias_and_norm", False)
    # the reference's M uses the batch statistics: the bias-corrected running averages after one step
    bnp = BatchNormPreconditioning(bias_correction=True)
    new = lightning_step(tmp_path, [bnp, ZSpaceRegularization(**kwargs)], make_net())
    torch.testing.assert_close(new, quantities["p"] - LR * expected(quantities), rtol=1e-9, atol=1e-11)


def test_z_decay_without_bias_is_the_documented_penalty(tmp_path: Path, quantities: dict) -> None:
    """README's formula for the default (`exclude_bias_and_norm=True`): g = M∇L + 2λ·(w; −μᵀw per neuron),
    which is M·∇_p of λ·Σ q²σ̃²_j w_ij² — checked here against that penalty's explicit gradient."""
    q = quantities
    penalty_grad = 2 * LAM * q["penalty_scale"] * q["p"]  # ∇_p λ Σ q²σ̃² w²
    bnp = BatchNormPreconditioning(bias_correction=True)
    new = lightning_step(tmp_path, [bnp, ZSpaceRegularization(weight_decay=LAM)], make_net())
    torch.testing.assert_close(new, q["p"] - LR * q["M"] @ (q["g"] + penalty_grad), rtol=1e-9, atol=1e-11)
    # and the decay is no longer a field that is asymmetric in z: λ‖z_w‖² has the Hessian 2λ·diag(z_weights)
    field = torch.linalg.solve(q["P"], q["M"] @ penalty_grad)  # P⁻¹ · (p-direction) = ∇_z
    torch.testing.assert_close(field, 2 * LAM * q["z_weights"] * torch.linalg.solve(q["P"], q["p"]))


@pytest.mark.parametrize("hvp", ["double_backprop", "finite_difference"])
def test_gradient_penalty_in_p_without_bnp_equals_the_one_in_z(tmp_path: Path, hvp: str) -> None:
    """Without BNP, M = I: eq. 11 and eq. 12 are the same update."""
    steps = [
        lightning_step(
            tmp_path, [ZSpaceRegularization(gradient_penalty=LAM, gradient_penalty_space=s, hvp=hvp)], make_net()
        )
        for s in ("z", "p")
    ]
    torch.testing.assert_close(steps[0], steps[1], rtol=1e-12, atol=1e-14)


def test_finite_difference_gradient_penalty_is_close_to_the_formula(tmp_path: Path, quantities: dict) -> None:
    reg = ZSpaceRegularization(gradient_penalty=LAM, hvp="finite_difference", fd_step=1e-6)  # a smooth (tanh) net
    bnp = BatchNormPreconditioning(bias_correction=True)  # M from the batch statistics, as the reference's
    new = lightning_step(tmp_path, [reg, bnp], make_net())  # order does not matter
    q = quantities
    expected = q["p"] - LR * (q["M"] @ q["g"] + 2 * LAM * q["M"] @ q["H"] @ q["M"] @ q["g"])
    torch.testing.assert_close(new, expected, rtol=1e-6, atol=1e-7)  # a first-order difference


def test_callback_order_does_not_matter(tmp_path: Path) -> None:
    a = lightning_step(tmp_path, [BatchNormPreconditioning(), ZSpaceRegularization(weight_decay=LAM)], make_net())
    b = lightning_step(tmp_path, [ZSpaceRegularization(weight_decay=LAM), BatchNormPreconditioning()], make_net())
    assert torch.equal(a, b)


def test_without_bnp_decay_is_plain_sgd_weight_decay(tmp_path: Path) -> None:
    """M = I: decay in z and in p are both SGD's weight decay with coefficient 2λ."""
    ours = lightning_step(tmp_path, [ZSpaceRegularization(weight_decay=LAM, exclude_bias_and_norm=False)], make_net())
    net = make_net().double()
    opt = torch.optim.SGD(net.parameters(), lr=LR, weight_decay=2 * LAM)
    x, y = make_data(n=BATCH)[:]
    nn.functional.cross_entropy(net(x.double()), y).backward()
    opt.step()
    torch.testing.assert_close(ours, torch.cat([p.detach().reshape(-1) for p in net.parameters()]))


class CountsLogs(BoringClassifier):
    def __init__(self, network: nn.Module) -> None:
        super().__init__(network)
        self.logged = 0

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss

    @override
    def log(self, *args: Any, **kwargs: Any) -> None:
        self.logged += 1
        super().log(*args, **kwargs)


def test_gradient_penalty_neither_logs_twice_nor_touches_bnp_statistics(tmp_path: Path) -> None:
    bnp = BatchNormPreconditioning()
    model = CountsLogs(make_net())
    _fit(tmp_path, model, make_data(n=16), batch_size=4, max_steps=4,
         callbacks=[bnp, ZSpaceRegularization(gradient_penalty=0.1)])  # fmt: skip
    assert model.logged == 4
    for layer in bnp.preconditioner.layers.values():  # type: ignore[union-attr]
        assert layer.running.steps == 4 and layer.moments is None


@pytest.mark.parametrize("kwargs", [{"weight_decay": 0.05}, {"gradient_penalty": 0.05, "hvp": "double_backprop"}])
def test_gradient_accumulation_equals_the_large_batch(tmp_path: Path, kwargs: dict) -> None:
    data = make_data(n=64)
    small, large = BoringClassifier(make_net()), BoringClassifier(make_net())
    _fit(tmp_path, small, data, batch_size=4, max_steps=8, accumulate_grad_batches=2,
         callbacks=[BatchNormPreconditioning(), ZSpaceRegularization(**kwargs)])  # fmt: skip
    _fit(tmp_path, large, data, batch_size=8, max_steps=8,
         callbacks=[BatchNormPreconditioning(), ZSpaceRegularization(**kwargs)])  # fmt: skip
    for p, q in zip(small.parameters(), large.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_decay_acts_on_unscaled_gradients_under_fp16_amp(tmp_path: Path) -> None:
    data = make_data(n=32)
    plain, amp = BoringClassifier(make_net()), BoringClassifier(make_net())
    _fit(tmp_path, plain, data, batch_size=8, max_steps=4,
         callbacks=[BatchNormPreconditioning(), ZSpaceRegularization(weight_decay=1.0)])  # fmt: skip
    fp16 = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0))
    _fit(tmp_path, amp, data, batch_size=8, max_steps=4, plugins=[fp16],
         callbacks=[BatchNormPreconditioning(), ZSpaceRegularization(weight_decay=1.0)])  # fmt: skip
    for p, q in zip(plain.parameters(), amp.parameters()):  # a scaled gradient would be 1024× off
        torch.testing.assert_close(p, q, rtol=2e-2, atol=2e-3)


class WithOptimizerDecay(BoringClassifier):
    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, weight_decay=1e-4)


def test_warns_about_double_decay(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match=r"SGD has weight_decay=0.0001 and ZSpaceRegularization has weight_decay=0.1"):
        _fit(tmp_path, WithOptimizerDecay(make_net()), make_data(n=8), batch_size=4, max_steps=1,
             callbacks=[ZSpaceRegularization(weight_decay=0.1)])  # fmt: skip


class Manual(BoringClassifier):
    def __init__(self, network: nn.Module) -> None:
        super().__init__(network)
        self.automatic_optimization = False

    @override
    def training_step(self, batch: Any, batch_idx: int) -> None:  # type: ignore[override]
        opt = self.optimizers()
        self.manual_backward(super().training_step(batch, batch_idx))
        opt.step()  # type: ignore[union-attr]
        opt.zero_grad()  # type: ignore[union-attr]


def test_gradient_penalty_refuses_manual_optimization(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"re-runs `training_step`.*manual optimization"):
        _fit(tmp_path, Manual(make_net()), make_data(n=8), batch_size=4, max_steps=1,
             callbacks=[ZSpaceRegularization(gradient_penalty=0.1)])  # fmt: skip


def test_decay_works_with_manual_optimization(tmp_path: Path) -> None:
    _fit(tmp_path, Manual(make_net()), make_data(n=8), batch_size=4, max_steps=2,
         callbacks=[BatchNormPreconditioning(), ZSpaceRegularization(weight_decay=0.1)])  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"weight_decay": -0.1}, r"`weight_decay` must be a finite number >= 0, got -0.1"),
        ({"gradient_penalty": -1.0}, r"`gradient_penalty` must be a finite number >= 0, got -1.0"),
        ({}, r"`weight_decay` and `gradient_penalty` are both 0"),
        ({"weight_decay": 0.1, "decay_space": "w"}, r"`decay_space` must be 'z' or 'p', got 'w'"),
        (
            {"gradient_penalty": 0.1, "hvp": "exact"},
            r"`hvp` must be 'finite_difference' or 'double_backprop', got 'exact'",
        ),
        ({"gradient_penalty": 0.1, "fd_step": 0.0}, r"`fd_step` must be a finite number > 0, got 0.0"),
        (
            {"gradient_penalty": 0.1, "gradient_penalty_space": "w"},
            r"`gradient_penalty_space` must be 'z' or 'p', got 'w'",
        ),
    ],
)
def test_invalid_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ZSpaceRegularization(**kwargs)


class SkippingClassifier(BoringClassifier):
    """``training_step`` returns None (Lightning: skip the batch) on ``skip``: after the forward pass,
    or with ``early=True`` before it."""

    def __init__(self, network: nn.Module, skip: set[int], early: bool = False) -> None:
        super().__init__(network, lr=LR)
        self.skip, self.early = skip, early

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.early and batch_idx in self.skip:
            return None
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx in self.skip else loss


def _params(model: BoringClassifier) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.network.parameters()])


@pytest.mark.parametrize("hvp", ["double_backprop", "finite_difference"])
@pytest.mark.parametrize("bnp", [False, True])
def test_gradient_penalty_skips_steps_whose_training_step_returns_none(tmp_path: Path, hvp: str, bnp: bool) -> None:
    """Issue 15, item 7: IndexError (double backprop) / "stack expects a non-empty TensorList" (finite
    difference) when `training_step` returned None. A skipped step adds no term (it has no gradient);
    the run equals one on the other batches alone."""

    def callbacks() -> list[Any]:
        reg = ZSpaceRegularization(gradient_penalty=0.5, weight_decay=0.01, hvp=hvp)  # type: ignore[arg-type]
        return [reg, BatchNormPreconditioning()] if bnp else [reg]

    data = make_data(n=4 * BATCH)
    model = SkippingClassifier(make_net(), skip={0, 2})
    _fit(tmp_path, model, data, batch_size=BATCH, callbacks=callbacks(), max_steps=4)
    kept = torch.utils.data.TensorDataset(*(torch.cat([t[BATCH : 2 * BATCH], t[3 * BATCH :]]) for t in data.tensors))
    reference = SkippingClassifier(make_net(), skip=set())
    _fit(tmp_path, reference, kept, batch_size=BATCH, callbacks=callbacks(), max_steps=2)
    torch.testing.assert_close(_params(model), _params(reference))


@pytest.mark.parametrize("hvp", ["double_backprop", "finite_difference"])
def test_gradient_penalty_skips_a_none_micro_batch_under_accumulation(tmp_path: Path, hvp: str) -> None:
    """A micro-batch returning None contributes nothing to ∇L nor to ∇²L·v, nor to BNP's statistics
    (issue 15, item 2): the same step as a micro-batch skipped before its forward pass."""
    results = []
    for early in (False, True):
        model = SkippingClassifier(make_net(), skip={0}, early=early)
        reg = ZSpaceRegularization(gradient_penalty=0.5, hvp=hvp)  # type: ignore[arg-type]
        _fit(tmp_path, model, make_data(n=2 * BATCH), batch_size=BATCH, callbacks=[reg, BatchNormPreconditioning()],
             max_steps=1, accumulate_grad_batches=2)  # fmt: skip
        results.append(_params(model))
    torch.testing.assert_close(results[0], results[1])
    assert not torch.equal(results[0], _params(SkippingClassifier(make_net(), skip=set())))  # it did train


@pytest.mark.parametrize(("groups", "conv_statistics"), [(1, "channel"), (2, "channel"), (2, "column")])
def test_z_decay_on_convolutions_is_the_formula(tmp_path: Path, groups: int, conv_statistics: str) -> None:
    """Issue 27: decay in z with the default ``exclude_bias_and_norm=True`` adds 2λ·w to every weight and
    −2λ·Σ_j μ_j w_ij to a centred layer's bias, j over what neuron i sees: its group's input channels summed over
    the kernel offsets (per-channel μ), or its group's im2col columns (per-column μ). The difference of one SGD
    step with and without the decay is −lr times that term; μ is the first step's batch mean, from the input."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1, groups=groups), nn.Tanh(), nn.Flatten(), nn.Linear(64, 3))
    data = make_data(n=BATCH, shape=(4, 4, 4))

    def one_step(callbacks: list[Any]) -> dict[str, Tensor]:
        model = BoringClassifier(copy.deepcopy(net), lr=LR)
        bnp = BatchNormPreconditioning(bias_correction=True, conv_statistics=conv_statistics)  # type: ignore[arg-type]
        _fit(tmp_path, model, data, batch_size=BATCH, callbacks=[bnp, *callbacks], max_steps=1, precision="64-true")
        return {k: v.detach() for k, v in model.network.state_dict().items()}

    decayed, plain = one_step([ZSpaceRegularization(weight_decay=LAM)]), one_step([])
    ref = copy.deepcopy(net).double()
    x = data.tensors[0].double()
    w_conv, w_lin = ref[0].weight.detach(), ref[3].weight.detach()
    expected = {"0.weight": 2 * LAM * w_conv, "3.weight": 2 * LAM * w_lin}
    hidden = ref[2](ref[1](ref[0](x))).detach()
    expected["3.bias"] = -2 * LAM * w_lin @ hidden.mean(0)
    per_group, out_per_group = 4 // groups, 4 // groups
    if conv_statistics == "channel":
        mu = x.mean((0, 2, 3))  # (c_in,)
        seen = w_conv.sum((2, 3))  # (out, c_in/groups): kernel offsets summed
    else:
        mu = F.unfold(x, 3, padding=1).mean((0, 2))  # (c_in·9,), channel-major like weight[o].flatten()
        seen = w_conv.flatten(1)  # (out, c_in/groups·9)
        per_group *= 9
    bias = torch.empty(4, dtype=torch.float64)
    for i in range(4):
        g = i // out_per_group
        bias[i] = -2 * LAM * seen[i] @ mu[g * per_group : (g + 1) * per_group]
    expected["0.bias"] = bias
    for name, term in expected.items():
        torch.testing.assert_close(decayed[name], plain[name] - LR * term, rtol=1e-9, atol=1e-12, msg=name)
