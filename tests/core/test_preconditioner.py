"""BNPPreconditioner end to end: the paper's Prop. 7 oracle, batch-size-1 statistics, layer rules."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_bnp import BatchNormPreconditioning
from lightning_bnp.core import BNPPreconditioner, BNPWarning
from tests.helpers import TINY_EPS

TINY = 1e-30  # ε1, ε2 must be > 0; this makes them vanish next to any variance


def uneven_inputs(n: int, features: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, features, generator=g, dtype=torch.float64) * torch.logspace(-1, 1, features)) + 2.0


def test_prop7_dense_bnp_step_equals_bn_step() -> None:
    """One SGD step through BN(affine=False) with constant batch statistics = one BNP step on Ŵ, b̂ (Prop. 7)."""
    n, features, out, lr = 32, 5, 3, 0.3  # N ≥ n_in, so q² = 1
    h = uneven_inputs(n, features)
    target = torch.randint(0, out, (n,), generator=torch.Generator().manual_seed(1))
    mu_h, var_h = h.mean(0), h.var(0, unbiased=False)
    sigma_h = var_h.sqrt()

    torch.manual_seed(2)
    bn_layer = nn.Linear(features, out).double()
    # BN with the statistics as constants: eval-mode batch_norm fed the batch statistics (the oracle)
    normalized = F.batch_norm(h, mu_h, var_h, training=False, eps=TINY_EPS)
    F.cross_entropy(bn_layer(normalized), target).backward()
    with torch.no_grad():
        w_bn = bn_layer.weight - lr * bn_layer.weight.grad
        b_bn = bn_layer.bias - lr * bn_layer.bias.grad

    vanilla = nn.Linear(features, out).double()
    with torch.no_grad():  # the equivalent vanilla layer: Ŵ = W·diag(1/σ_H), b̂ = b − W·(μ_H/σ_H)
        vanilla.weight.copy_(bn_layer.weight / sigma_h)
        vanilla.bias.copy_(bn_layer.bias - bn_layer.weight @ (mu_h / sigma_h))
    pre = BNPPreconditioner(vanilla, statistics="batch", eps1=TINY, eps2=TINY)
    F.cross_entropy(vanilla(h), target).backward()
    pre.step()
    with torch.no_grad():
        vanilla.weight -= lr * vanilla.weight.grad
        vanilla.bias -= lr * vanilla.bias.grad
        torch.testing.assert_close(vanilla.weight, w_bn / sigma_h, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(vanilla.bias, b_bn - w_bn @ (mu_h / sigma_h), rtol=1e-10, atol=1e-12)


def test_prop7_conv_bnp_step_equals_bn2d_step_up_to_q2() -> None:
    """The conv analogue (eq. 23) with per-channel statistics over batch and positions (eqs. 21–22).

    Valid padding keeps BN2d followed by the convolution exactly equivalent to the vanilla convolution
    with Ŵ[:, c] = W[:, c]/σ_c. BNP scales by 1/q², so BNP at learning rate q²·α equals BN at α."""
    n, c_in, c_out, side, lr = 3, 3, 4, 6, 0.05
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, c_in, side, side, generator=g, dtype=torch.float64) * torch.tensor([0.1, 1.0, 5.0]).view(
        1, 3, 1, 1
    ) + torch.tensor([1.0, -2.0, 0.5]).view(1, 3, 1, 1)
    target = torch.randn(n, c_out, side - 2, side - 2, generator=g, dtype=torch.float64)
    mu_h, var_h = h.mean((0, 2, 3)), h.var((0, 2, 3), unbiased=False)
    sigma_h = var_h.sqrt()

    torch.manual_seed(3)
    bn_conv = nn.Conv2d(c_in, c_out, 3).double()
    F.mse_loss(bn_conv(F.batch_norm(h, mu_h, var_h, training=False, eps=TINY_EPS)), target).backward()
    with torch.no_grad():
        w_bn = bn_conv.weight - lr * bn_conv.weight.grad
        b_bn = bn_conv.bias - lr * bn_conv.bias.grad

    conv = nn.Conv2d(c_in, c_out, 3).double()
    scale = (1 / sigma_h).view(1, c_in, 1, 1)
    with torch.no_grad():
        conv.weight.copy_(bn_conv.weight * scale)
        conv.bias.copy_(bn_conv.bias - (bn_conv.weight * (mu_h * (1 / sigma_h)).view(1, c_in, 1, 1)).sum((1, 2, 3)))
    pre = BNPPreconditioner(conv, statistics="batch", eps1=TINY, eps2=TINY)
    F.mse_loss(conv(h), target).backward()
    pre.step()
    q2 = max(c_in * 9 / n, ((side - 2) ** 2) ** 0.5)  # Alg. 3 step 3 with r·s output positions
    with torch.no_grad():
        conv.weight -= q2 * lr * conv.weight.grad
        conv.bias -= q2 * lr * conv.bias.grad
        torch.testing.assert_close(conv.weight, w_bn * scale, rtol=1e-9, atol=1e-12)
        expected_b = b_bn - (w_bn * (mu_h / sigma_h).view(1, c_in, 1, 1)).sum((1, 2, 3))
        torch.testing.assert_close(conv.bias, expected_b, rtol=1e-9, atol=1e-12)


def test_batch_size_one_statistics_by_hand() -> None:
    """N = 1: μ_H = h, σ²_H = (h − μ)² with the running μ before the update (text after Alg. 2)."""
    layer = nn.Linear(2, 1)
    pre = BNPPreconditioner(layer, bias_correction=False, rho=0.9)
    rows = [torch.tensor([[1.0, -2.0]]), torch.tensor([[3.0, 0.0]])]
    # step 1: μ = 0 → σ²_H = h²;  μ1 = 0.1·h, σ²1 = 0.9·1 + 0.1·h²
    # step 2: σ²_H = (h2 − μ1)²;  μ2 = 0.9·μ1 + 0.1·h2, σ²2 = 0.9·σ²1 + 0.1·(h2 − μ1)²
    expected = [
        (torch.tensor([0.1, -0.2]), torch.tensor([0.9 + 0.1, 0.9 + 0.4])),
        (
            torch.tensor([0.09 + 0.3, -0.18 + 0.0]),
            torch.tensor([0.9 * 1.0 + 0.1 * 2.9**2, 0.9 * 1.3 + 0.1 * 0.2**2]),
        ),
    ]
    for h, (mu, var) in zip(rows, expected):
        layer.zero_grad()
        layer(h).sum().backward()
        grad_w, grad_b = layer.weight.grad.clone(), layer.bias.grad.clone()
        pre.step()
        running = pre.layers[""].running
        torch.testing.assert_close(running.mu, mu)
        torch.testing.assert_close(running.var, var)
        # transform with the updated statistics and q² = max(n_in / 1, 1) = 2
        var_t = var + 1e-2 * var.max() + 1e-4
        new_w = (grad_w - mu * grad_b[:, None]) / (2 * var_t)
        torch.testing.assert_close(layer.weight.grad, new_w)
        torch.testing.assert_close(layer.bias.grad, grad_b / 2 - new_w @ mu)


def test_default_start_is_the_papers() -> None:
    """Alg. 2 step 2 starts from μ = 0, σ² = 1: after one step of batch statistics (μ_H, σ²_H) the running
    statistics are ρ·0 + (1 − ρ)·μ_H and ρ·1 + (1 − ρ)·σ²_H, in the core and in the callback."""
    assert BNPPreconditioner(nn.Linear(2, 1)).bias_correction is False
    assert BatchNormPreconditioning().bias_correction is False
    layer = nn.Linear(2, 1)
    pre = BNPPreconditioner(layer, rho=0.9)
    h = torch.tensor([[1.0, 10.0], [3.0, 30.0]])  # μ_H = (2, 20), σ²_H = (1, 100)
    layer(h).sum().backward()
    pre.step()
    torch.testing.assert_close(pre.layers[""].running.mu, torch.tensor([0.2, 2.0]))
    torch.testing.assert_close(pre.layers[""].running.var, torch.tensor([0.9 + 0.1, 0.9 + 10.0]))


def test_batch_size_one_bias_corrected_uses_corrected_running_mean() -> None:
    layer = nn.Linear(1, 1)
    pre = BNPPreconditioner(layer, rho=0.5, bias_correction=True)
    for h in (2.0, 6.0):
        layer.zero_grad()
        layer(torch.tensor([[h]])).sum().backward()
        pre.step()
    # step 1: μ = 2, σ² = 4 (exactly the first sample, (2 − 0)²); step 2: σ²_H = (6 − 2)² = 16
    # corrected averages after 2 steps weight the newest by 0.5/0.75 = 2/3
    torch.testing.assert_close(pre.layers[""].running.mu, torch.tensor([2 / 3 * 6 + 1 / 3 * 2]))
    torch.testing.assert_close(pre.layers[""].running.var, torch.tensor([2 / 3 * 16 + 1 / 3 * 4]))


def test_conv_at_batch_one_uses_spatial_statistics() -> None:
    conv = nn.Conv2d(1, 1, 3)
    pre = BNPPreconditioner(conv, statistics="batch")
    h = torch.arange(25.0).view(1, 1, 5, 5)
    conv(h).sum().backward()
    pre.step()  # no error: 25 rows even though N = 1


def test_batch_statistics_refuse_a_dense_layer_with_one_row() -> None:
    layer = nn.Linear(3, 2)
    pre = BNPPreconditioner(layer, statistics="batch")
    layer(torch.randn(1, 3)).sum().backward()
    with pytest.raises(ValueError, match=r"statistics='batch' needs more than one row .* layer '' saw 1"):
        pre.step()


def test_shared_layer_pools_every_call() -> None:
    layer = nn.Linear(3, 2)
    pre = BNPPreconditioner(layer, statistics="batch")
    a, b = uneven_inputs(4, 3, 0).float(), uneven_inputs(6, 3, 1).float()
    (layer(a).sum() + layer(b).square().sum()).backward()
    grad_w, grad_b = layer.weight.grad.clone(), layer.bias.grad.clone()
    pre.step()
    both = torch.cat([a, b])
    mu, var = both.mean(0), both.var(0, unbiased=False)
    var_t = var + 1e-2 * var.max() + 1e-4
    q2 = max(3 / 10, 1.0)
    new_w = (grad_w - mu * grad_b[:, None]) / (q2 * var_t)
    torch.testing.assert_close(layer.weight.grad, new_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.bias.grad, grad_b / q2 - new_w @ mu, rtol=1e-5, atol=1e-6)


def test_layer_without_bias_equilibrates_uncentred_columns() -> None:
    layer = nn.Linear(3, 2, bias=False)
    pre = BNPPreconditioner(layer, statistics="batch")
    h = uneven_inputs(8, 3).float()
    layer(h).sum().backward()
    grad_w = layer.weight.grad.clone()
    pre.step()
    second_moment = h.square().mean(0)  # σ² + μ²: P = diag(1/σ̃) on the uncentred H
    var_t = second_moment + 1e-2 * second_moment.max() + 1e-4
    torch.testing.assert_close(layer.weight.grad, grad_w / (max(3 / 8, 1.0) * var_t), rtol=1e-5, atol=1e-6)


def test_frozen_layer_records_nothing_and_is_skipped() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    model[0].requires_grad_(False)
    pre = BNPPreconditioner(model)
    model(torch.randn(4, 3)).sum().backward()
    assert pre.layers["0"].moments is None
    pre.step()
    assert pre.layers["0"].running.steps == 0 and pre.layers["1"].running.steps == 1


def test_layer_without_gradient_drops_its_statistics() -> None:
    model = nn.ModuleDict({"used": nn.Linear(3, 2), "unused": nn.Linear(3, 2)})
    pre = BNPPreconditioner(model)
    x = torch.randn(4, 3)
    model["unused"](x)  # forward ran, but the output feeds no loss
    model["used"](x).sum().backward()
    pre.step()
    assert pre.layers["unused"].running.steps == 0
    assert pre.layers["unused"].moments is None


def test_forward_never_ran_warns_once_and_leaves_gradient() -> None:
    # a parent BNP does not know that uses its Linear through F.linear, made by exec: BNP cannot read the source
    # of its forward (it would capture the call then: test_attention.py), so the Linear's own hook never runs
    namespace: dict[str, object] = {"nn": nn}
    exec(
        "class Functional(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.out_proj = nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        return nn.functional.linear(x, self.out_proj.weight, self.out_proj.bias)\n",
        namespace,
    )
    model = namespace["Functional"]()  # type: ignore[operator]
    pre = BNPPreconditioner(model)
    for _ in range(2):
        model.zero_grad()
        model(torch.randn(2, 3, 4)).sum().backward()
        before = model.out_proj.weight.grad.clone()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pre.step()
        torch.testing.assert_close(model.out_proj.weight.grad, before)
        messages = [str(w.message) for w in caught if issubclass(w.category, BNPWarning)]
        assert len(messages) == (1 if _ == 0 else 0)
    assert "'out_proj'" in messages[0] if messages else True


def test_eval_mode_and_no_grad_and_paused_record_nothing() -> None:
    layer = nn.Linear(3, 2)
    pre = BNPPreconditioner(layer)
    x = torch.randn(4, 3)
    with torch.no_grad():
        layer(x)
    layer.eval()
    layer(x)
    layer.train()
    with pre.paused():
        layer(x)
    assert pre.layers[""].moments is None


def test_deferred_commit_leaves_statistics_until_committed() -> None:
    layer = nn.Linear(3, 2)
    pre = BNPPreconditioner(layer)
    layer(torch.randn(4, 3)).sum().backward()
    pending = pre.precondition(commit=False)
    assert pre.layers[""].running.steps == 0
    pending.commit()
    assert pre.layers[""].running.steps == 1


def test_precondition_only_touches_layers_owned_by_params() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    pre = BNPPreconditioner(model)
    model(torch.randn(4, 3) + 3).sum().backward()
    before = model[1].weight.grad.clone()
    pre.step(model[0].parameters())
    torch.testing.assert_close(model[1].weight.grad, before)
    assert pre.layers["1"].moments is not None  # kept for the optimizer that owns it
    assert pre.layers["0"].running.steps == 1


def test_detach_removes_hooks_and_attach_is_idempotent() -> None:
    layer = nn.Linear(3, 2)
    pre = BNPPreconditioner(layer)
    pre.attach()
    assert len(layer._forward_hooks) == 1
    pre.detach()
    assert len(layer._forward_hooks) == 0


def test_state_dict_round_trip_and_mismatch() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    pre = BNPPreconditioner(model)
    model(torch.randn(4, 3)).sum().backward()
    pre.step()
    other = BNPPreconditioner(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2)))
    other.load_state_dict(pre.state_dict())
    torch.testing.assert_close(other.layers["1"].running.var, pre.layers["1"].running.var)
    with pytest.raises(ValueError, match=r"missing \['2'\] \(managed now, not in the state\), unexpected \[\]"):
        BNPPreconditioner(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 2))).load_state_dict(
            pre.state_dict()
        )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rho": 1.0}, r"`rho` must be a finite number in \[0, 1\), got 1.0"),
        ({"rho": -0.1}, r"`rho` must be a finite number in \[0, 1\), got -0.1"),
        ({"eps1": 0.0}, r"`eps1` must be a finite number > 0, got 0.0"),
        ({"eps2": -1e-4}, r"`eps2` must be a finite number > 0, got -0.0001"),
        ({"statistics": "ema"}, r"`statistics` must be 'running' or 'batch', got 'ema'"),
        ({"layer_types": ["Linear", "Conv4d"]}, r"`layer_types` must be a subset of .* unknown \['Conv4d'\]"),
        ({"layer_types": []}, r"`layer_types` must name at least one layer type, got \[\]"),
        ({"include": ["enc*"]}, r"`include` pattern 'enc\*' matches no"),
        ({"exclude": ["head"]}, r"`exclude` pattern 'head' matches no"),
        ({"exclude": ["*"]}, r"no Linear/Conv1d/Conv2d/Conv3d layer is left"),
    ],
)
def test_invalid_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BNPPreconditioner(nn.Sequential(nn.Linear(3, 2)), **kwargs)


def test_include_exclude_select_by_name() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Conv1d(1, 1, 1), nn.Linear(3, 2))
    assert set(BNPPreconditioner(model, include=["0", "2"], exclude=["2"]).layers) == {"0"}
    assert set(BNPPreconditioner(model, layer_types=["Conv1d"]).layers) == {"1"}


@pytest.mark.parametrize(("built", "cast"), [(torch.float64, torch.float32), (torch.float32, torch.float64)])
def test_a_model_cast_after_set_up_casts_its_statistics(built: torch.dtype, cast: torch.dtype) -> None:
    """Issue 27 (a survivor of `make mutate`): the model is cast after the preconditioner was built, between two
    steps; the running statistics follow the model's dtype (float64 statistics in a float32 model would make P's
    arithmetic float64), and the steps equal those of a preconditioner built on the cast model."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).to(built)
    pre = BNPPreconditioner(net)
    x = uneven_inputs(6, 4, seed=0).to(built)
    net(x).square().sum().backward()
    pre.step()
    ref = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).to(cast)
    ref.load_state_dict(net.state_dict())
    ref_pre = BNPPreconditioner(ref)
    ref_pre.load_state_dict(pre.state_dict())
    net.to(cast)
    x = uneven_inputs(6, 4, seed=1).to(cast)
    for model, p in ((net, pre), (ref, ref_pre)):
        model.zero_grad()
        model(x).square().sum().backward()
        p.step()
    for (name, layer), ref_layer in zip(pre.layers.items(), ref_pre.layers.values()):
        assert layer.running.mean_acc.dtype == layer.running.var_acc.dtype == cast, name
        torch.testing.assert_close(layer.running.mean_acc, ref_layer.running.mean_acc, rtol=0, atol=0)
        torch.testing.assert_close(layer.running.var_acc, ref_layer.running.var_acc, rtol=0, atol=0)
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_statistics_of_another_shape_are_refused_naming_the_layer_sizes_and_unit() -> None:
    """The unit is the layer's: input features (dense), input channels, or columns (conv_statistics='column')."""
    cases = [
        (nn.Linear(3, 2), nn.Linear(4, 2), {}, "4 input features", "Linear"),
        (nn.Conv2d(2, 3, 3), nn.Conv2d(3, 3, 3), {}, "3 input channels", "Conv2d"),
        (nn.Conv2d(2, 3, 3), nn.Conv2d(3, 3, 3), {"conv_statistics": "column"}, "27 columns", "Conv2d"),
    ]
    for saved_layer, layer, kwargs, has, kind in cases:
        state = BNPPreconditioner(nn.Sequential(saved_layer), **kwargs).state_dict()
        length = state["layers"]["0"]["mean_acc"].numel()
        message = (
            f"BNP statistics of layer '0' have {length} entries, but the layer ({kind}) has {has}: the state was "
            "saved from a model whose layer has another shape. Load it into the same architecture, or start "
            "without the BNP state."
        )
        pre = BNPPreconditioner(nn.Sequential(layer), **kwargs)
        with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
            pre.load_state_dict(state)


@pytest.mark.parametrize("old", ["no hyperparameters", "no conv_statistics"])
def test_an_old_state_counts_as_per_channel_statistics(old: str) -> None:
    """A state saved before ``conv_statistics`` existed holds per-channel statistics: loaded into per-column ones
    it is refused as such (and it loads into per-channel ones)."""
    state = BNPPreconditioner(nn.Sequential(nn.Conv2d(2, 3, 3))).state_dict()
    if old == "no hyperparameters":
        del state["hyperparameters"]
    else:
        del state["hyperparameters"]["conv_statistics"]
    message = (
        "BNP statistics of layer '0' have 2 entries, but it has 18 with conv_statistics='column' (saved with "
        "conv_statistics='channel'); per-channel and per-column statistics cannot be converted into each other. "
        "Resume with the saved `conv_statistics`, or start without the BNP state."
    )
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        BNPPreconditioner(nn.Sequential(nn.Conv2d(2, 3, 3)), conv_statistics="column").load_state_dict(state)
    BNPPreconditioner(nn.Sequential(nn.Conv2d(2, 3, 3))).load_state_dict(state)


@pytest.mark.stack
def test_statistics_saved_with_other_settings_warn_at_the_callers_line() -> None:
    state = BNPPreconditioner(nn.Linear(3, 2), rho=0.9, eps1=0.5).state_dict()
    pre = BNPPreconditioner(nn.Linear(3, 2))
    message = (
        "BNP statistics loaded from a state saved with other settings (eps1: saved 0.5, now 0.01, rho: saved 0.9, "
        "now 0.99); they continue under the current settings."
    )
    with pytest.warns(BNPWarning, match="^" + re.escape(message) + "$") as record:
        pre.load_state_dict(state)
    assert [w.filename for w in record] == [__file__]


def test_a_model_cast_between_steps_continues_its_running_statistics() -> None:
    """After a step the statistics live in the step's flat vectors (their count on the device); a cast model's
    next step gathers them, cast, and goes on: μ = ρ·(1 − ρ)·μ₁ + (1 − ρ)·μ₂ and t = 2, by hand."""
    torch.manual_seed(0)
    model, rho = nn.Sequential(nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 2)), 0.75
    pre = BNPPreconditioner(model, rho=rho)
    x1, x2 = torch.randn(6, 3) + 1, torch.randn(5, 3).double() * 2 - 1
    model(x1).sum().backward()
    pre.step()
    model.double().zero_grad()
    model(x2).sum().backward()
    pre.step()
    assert [layer.running.steps for layer in pre.layers.values()] == [2, 2]
    running = pre.layers["0"].running
    assert running.mean_acc.dtype == torch.float64
    expected = rho * (1 - rho) * x1.double().mean(0) + (1 - rho) * x2.mean(0)
    torch.testing.assert_close(running.mean_acc, expected, rtol=1e-6, atol=1e-7)


def test_running_statistics_live_where_the_model_steps_also_after_a_move() -> None:
    """Issue 27 (`make mutate` survivors): the accumulators, ρ^t + κ and the device step count of every layer are on
    the device of the step: the first step of a model on ``meta`` (its counts start as host ints) and the next step
    of a model moved there after a CPU step (its counts already tensors). ``meta`` makes a tensor left on (or made
    on) the CPU show on a CPU-only machine."""
    meta = torch.device("meta")
    for moved in (False, True):
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        x = torch.randn(5, 3)
        pre = BNPPreconditioner(model.to(meta) if not moved else model)
        if moved:
            model(x).sum().backward()
            pre.step()
            model.to(meta).zero_grad()
        model(x.to(meta)).sum().backward()
        pre.step()
        for layer in pre.layers.values():
            running = layer.running
            assert isinstance(running._steps, torch.Tensor), moved
            tensors = (running.mean_acc, running.var_acc, running.decay, running._steps)
            assert [t.device for t in tensors] == [meta] * 4, moved


def test_a_step_count_set_by_hand_is_the_next_steps() -> None:
    """``running.steps = 0`` restarts the count (and ρ^t) that the next step continues from."""
    layer = nn.Linear(3, 2)
    pre = BNPPreconditioner(nn.Sequential(layer), rho=0.5)
    for _ in range(2):
        layer(torch.randn(4, 3)).sum().backward()
        pre.step()
    running = pre.layers["0"].running
    running.steps = 0
    layer(torch.randn(4, 3)).sum().backward()
    pre.step()
    assert running.steps == 1
    torch.testing.assert_close(running.decay, torch.tensor([0.5 + pre._decay_offset]))


def test_an_optimizer_step_without_a_bnp_step_before_it_commits_nothing() -> None:
    model = nn.Sequential(nn.Linear(3, 2))
    pre = BNPPreconditioner(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    pre.step(opt)
    opt.step()
    opt.step()  # a second optimizer step (nothing pending): no error, nothing more committed
    assert pre.layers["0"].running.steps == 1


def test_step_transforms_name_only_the_layers_the_step_transformed() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    pre = BNPPreconditioner(model)
    model[1](torch.randn(4, 3)).sum().backward()  # layer 0 has no gradient: it is not transformed
    pre.step()
    assert list(pre.step_transforms(model.parameters())) == ["1"]
    assert pre.step_transforms(model[0].parameters()) == {}


def test_report_names_five_skipped_matrices_by_default() -> None:
    model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(8)))
    pre = BNPPreconditioner(model, exclude=[str(i) for i in range(1, 8)])
    report = pre.report()
    assert report.startswith("BNP transforms 1 of the model's 8 trainable weight matrices; it leaves alone 1.weight")
    assert report.count("excluded") == 5 and report.endswith("; and 2 more")


@pytest.mark.stack
def test_a_layers_warning_points_at_the_line_that_called_precondition() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    pre = BNPPreconditioner(model)
    model[1](torch.randn(4, 3)).sum().backward()
    model[0].weight.grad = torch.ones(3, 3)  # a gradient, but its forward never ran
    with pytest.warns(BNPWarning, match="never ran") as record:
        pre.precondition()
    assert [w.filename for w in record] == [__file__]


def test_statistics_set_by_hand_between_steps_are_used_and_the_steps_after_follow_them() -> None:
    """The running state lives in the plan's buffers; an accumulator replaced by hand between steps (a reset) is
    what the next step starts from, and every later step goes on from the state the previous one stored:
    m = ρ·(ρ·0 + (1 − ρ)·μ₂) + (1 − ρ)·μ₃ after a reset to 0 following step 1, by hand."""
    torch.manual_seed(0)
    model, rho = nn.Linear(3, 2), 0.5
    pre = BNPPreconditioner(model, rho=rho)
    xs = [torch.randn(6, 3) + i for i in range(3)]
    for i, x in enumerate(xs):
        model(x).sum().backward()
        pre.step()
        model.zero_grad()
        if i == 0:
            pre.layers[""].running.mean_acc = torch.zeros(3)
    expected = rho * ((1 - rho) * xs[1].mean(0)) + (1 - rho) * xs[2].mean(0)
    torch.testing.assert_close(pre.layers[""].running.mean_acc, expected, rtol=1e-6, atol=1e-7)
    assert pre.layers[""].running.steps == 3
