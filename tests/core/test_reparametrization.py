"""Reparametrized weights (issue 25, item 1): one rule for every way torch reparametrizes a weight.

Pruned layers (``torch.nn.utils.prune``) are preconditioned on their leaves ``weight_orig``/``bias_orig``
by eq. 15 (checked against the explicit M = (1/q²)·P·Pᵀ); every reparametrization eq. 15 cannot follow
exactly is left alone with one BNPWarning naming the layer and the reason, at construction or, when it
happens after setup, at the next step. Nothing stops silently.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils import parametrizations, parametrize, prune

from lightning_bnp.core import BNPPreconditioner, BNPWarning
from lightning_bnp.core.conditioning import apply_weight_conditioning

EPS1, EPS2 = 1e-2, 1e-4


def uneven(n: int, features: int, seed: int = 0) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, features, generator=g, dtype=torch.float64) * torch.logspace(-1, 1, features).double() + 0.7


def explicit_step(h: Tensor, g_w: Tensor, g_b: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """M·g row by row with M = (1/q²)·P·Pᵀ, P = [[1, −μᵀ], [0, I]]·diag(1, 1/σ̃) (batch statistics, eq. 15);
    without a bias P = diag(1/σ̃) from the uncentred second moment."""
    n, features = h.shape
    q2 = max(features / n, 1.0)
    if g_b is None:
        var = h.square().mean(0)
        var_t = var + EPS1 * var.max() + EPS2
        return g_w / (q2 * var_t), None
    mu, var = h.mean(0), h.var(0, unbiased=False)
    var_t = var + EPS1 * var.max() + EPS2
    u = torch.eye(features + 1, dtype=torch.float64)
    u[0, 1:] = -mu
    p = u @ torch.diag(torch.cat([torch.ones(1, dtype=torch.float64), var_t.rsqrt()]))
    m = p @ p.T / q2
    g = torch.cat([g_b[:, None], g_w], dim=1) @ m.T  # each row i: M·[g_b[i], g_w[i, :]]
    return g[:, 1:], g[:, 0]


def pruned_layer(which: str) -> nn.Linear:
    torch.manual_seed(3)
    layer = nn.Linear(5, 4).double()
    if which in ("weight", "both"):
        prune.random_unstructured(layer, "weight", amount=0.4)
    if which in ("bias", "both"):
        prune.random_unstructured(layer, "bias", amount=0.5)
    return layer


@pytest.mark.parametrize("which", ["weight", "bias", "both"])
def test_pruned_layer_is_preconditioned_on_its_leaves_by_eq15(which: str) -> None:
    layer = pruned_layer(which)
    h = uneven(16, 5)
    weight_leaf = layer.weight_orig if hasattr(layer, "weight_orig") else layer.weight
    bias_leaf = layer.bias_orig if hasattr(layer, "bias_orig") else layer.bias
    pre = BNPPreconditioner(layer, statistics="batch", eps1=EPS1, eps2=EPS2)
    (layer(h) ** 2).sum().backward()
    g_w, g_b = weight_leaf.grad.clone(), bias_leaf.grad.clone()
    pre.step()
    want_w, want_b = explicit_step(h, g_w, g_b)
    torch.testing.assert_close(weight_leaf.grad, want_w, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(bias_leaf.grad, want_b, rtol=1e-10, atol=1e-12)


def test_layer_pruned_after_setup_is_followed_from_the_next_step() -> None:
    torch.manual_seed(3)
    layer = nn.Linear(5, 4).double()
    pre = BNPPreconditioner(layer, statistics="batch", eps1=EPS1, eps2=EPS2)
    h = uneven(16, 5)
    layer(h).sum().backward()
    pre.step()
    layer.zero_grad()
    prune.l1_unstructured(layer, "weight", amount=0.3)  # as Lightning's ModelPruning does at an epoch end
    prune.l1_unstructured(layer, "bias", amount=0.25)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # followed, not named
        (layer(h) ** 2).sum().backward()
        g_w, g_b = layer.weight_orig.grad.clone(), layer.bias_orig.grad.clone()
        pre.step()
    want_w, want_b = explicit_step(h, g_w, g_b)
    torch.testing.assert_close(layer.weight_orig.grad, want_w, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(layer.bias_orig.grad, want_b, rtol=1e-10, atol=1e-12)
    prune.remove(layer, "weight")  # made permanent: the same Parameter object is `weight` again
    assert pre.layers[""].weight is layer.weight


def test_pruned_layer_in_an_optimizer_step() -> None:
    """``pre.step(optimizer)`` finds the pruned layer by its leaf (the optimizer's own tensor)."""
    layer = pruned_layer("both")
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    pre = BNPPreconditioner(layer)
    layer(uneven(8, 5)).sum().backward()
    pre.step(opt)
    opt.step()
    assert pre.layers[""].transform is not None and pre.layers[""].transform.mu is not None  # centred
    assert pre.layers[""].running.steps == 1


Reparametrize = Callable[[nn.Linear], object]
LEFT_ALONE: dict[str, tuple[Reparametrize, str]] = {
    "parametrizations.weight_norm": (parametrizations.weight_norm, r"parametrize \(_WeightNorm\)"),
    "parametrizations.spectral_norm": (parametrizations.spectral_norm, r"parametrize \(_SpectralNorm\)"),
    "parametrizations.orthogonal": (parametrizations.orthogonal, r"parametrize \(_Orthogonal\)"),
    "user parametrization": (
        lambda m: parametrize.register_parametrization(m, "weight", nn.Tanh()),
        r"parametrize \(Tanh\)",
    ),
    "parametrized bias": (
        lambda m: parametrize.register_parametrization(m, "bias", nn.Tanh()),
        r"its bias is computed by torch.nn.utils.parametrize \(Tanh\)",
    ),
    "legacy weight_norm": (lambda m: torch.nn.utils.weight_norm(m), r"weight_norm \(legacy hook"),
    "legacy spectral_norm": (lambda m: torch.nn.utils.spectral_norm(m), r"spectral_norm \(legacy hook"),
}


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch's deprecation of the legacy weight_norm
@pytest.mark.parametrize("case", list(LEFT_ALONE))
def test_other_reparametrizations_are_left_alone_with_one_warning_at_setup(case: str) -> None:
    reparametrize, reason = LEFT_ALONE[case]
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2))
    reparametrize(net[0])  # type: ignore[arg-type]
    with pytest.warns(BNPWarning, match=rf"BNP layer '0' .* is left alone: .*{reason}") as record:
        pre = BNPPreconditioner(net)
    assert len([w for w in record if issubclass(w.category, BNPWarning)]) == 1
    assert list(pre.layers) == ["2"]
    grads_before = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no further word, and no torch warning about a non-leaf .grad
        net(uneven(8, 5).float()).sum().backward()
        grads_before = {n: p.grad.clone() for n, p in net[0].named_parameters()}
        pre.step()
    for n, p in net[0].named_parameters():  # left alone: untouched
        torch.testing.assert_close(p.grad, grads_before[n], rtol=0, atol=0)
    assert pre.layers["2"].transform is not None


def test_every_layer_left_alone_is_an_error() -> None:
    net = parametrizations.orthogonal(nn.Linear(4, 4))
    with pytest.warns(BNPWarning, match="left alone"), pytest.raises(ValueError, match="no layer is left for BNP"):
        BNPPreconditioner(net)


def test_layer_reparametrized_after_setup_is_named_at_the_next_step_and_left_alone() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2))
    pre = BNPPreconditioner(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net(uneven(8, 5).float()).sum().backward()
    pre.step(opt)
    opt.step()
    parametrizations.spectral_norm(net[0])
    named = []
    for _ in range(2):  # named once, at the first step after the change
        opt.zero_grad()
        net(uneven(8, 5).float()).sum().backward()
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            pre.step(opt)
        opt.step()
        named.append([str(w.message) for w in record if issubclass(w.category, BNPWarning)])
    assert len(named[0]) == 1 and not named[1]
    assert "BNP layer '0'" in named[0][0] and "reparametrized after BNP was set up" in named[0][0]
    assert "parametrize (_SpectralNorm)" in named[0][0]
    assert pre.layers["0"].running.steps == 1  # no longer updated
    assert pre.layers["2"].running.steps == 3
    net2 = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2))
    pre2 = BNPPreconditioner(net2)  # a plain loop: pre.step() without an optimizer
    net2(uneven(8, 5).float()).sum().backward()
    pre2.step()
    parametrize.register_parametrization(net2[0], "weight", nn.Tanh())
    net2.zero_grad()
    net2(uneven(8, 5).float()).sum().backward()
    with pytest.warns(BNPWarning, match=r"BNP layer '0' .*reparametrized after BNP was set up.*parametrize \(Tanh\)"):
        pre2.step()


def test_weight_conditioning_keeps_its_documented_composition() -> None:
    """BNP preconditions the gradient of ``parametrizations.weight.original`` by eq. 15 (README)."""
    torch.manual_seed(0)
    layer = nn.Linear(5, 4).double()
    apply_weight_conditioning(layer, mode="row")
    pre = BNPPreconditioner(layer, statistics="batch", eps1=EPS1, eps2=EPS2)
    h = uneven(16, 5)
    (layer(h) ** 2).sum().backward()
    original = layer.parametrizations.weight.original
    g_w, g_b = original.grad.clone(), layer.bias.grad.clone()
    pre.step()
    want_w, want_b = explicit_step(h, g_w, g_b)
    torch.testing.assert_close(original.grad, want_w, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(layer.bias.grad, want_b, rtol=1e-10, atol=1e-12)


def test_weight_conditioning_on_a_weight_normed_layer_names_the_reparametrization() -> None:
    layer = parametrizations.weight_norm(nn.Linear(4, 3))
    with pytest.raises(
        ValueError,
        match=r"layer '' has no `weight` parameter to condition: its weight is computed by "
        r"torch.nn.utils.parametrize \(_WeightNorm\)",
    ):
        apply_weight_conditioning(layer)
    pruned = prune.l1_unstructured(nn.Linear(4, 3), "weight", amount=0.5)
    with pytest.raises(ValueError, match=r"its weight is pruned by torch.nn.utils.prune"):
        apply_weight_conditioning(pruned)


def test_uninitialised_lazy_layer_is_refused_naming_it() -> None:
    net = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"layers \['0'\] are uninitialised lazy modules .* Run one forward first"):
        BNPPreconditioner(net)
    net(torch.randn(3, 5))  # materialized: managed
    assert list(BNPPreconditioner(net).layers) == ["0", "2"]


def test_loading_statistics_of_another_shape_names_the_shape_not_conv_statistics() -> None:
    torch.manual_seed(0)
    small = BNPPreconditioner(nn.Linear(8, 3))
    big = BNPPreconditioner(nn.Linear(12, 3))
    with pytest.raises(
        ValueError, match=r"have 8 entries, but the layer \(Linear\) has 12 input features.*another shape"
    ):
        big.load_state_dict(small.state_dict())
    with pytest.raises(ValueError, match=r"have 2 entries, but the layer \(Conv2d\) has 4 input channels"):
        BNPPreconditioner(nn.Conv2d(4, 3, 3)).load_state_dict(BNPPreconditioner(nn.Conv2d(2, 3, 3)).state_dict())
    conv = BNPPreconditioner(nn.Conv2d(2, 3, 3), conv_statistics="column")
    with pytest.raises(ValueError, match="conv_statistics"):  # the other conv_statistics is still named
        conv.load_state_dict(BNPPreconditioner(nn.Conv2d(2, 3, 3)).state_dict())


# ------------------------------------------------------------------ pins found by mutation testing (issue 27)
def test_a_parametrization_on_another_tensor_does_not_hide_the_plain_weight() -> None:
    """A layer whose own extra tensor is parametrized (not its weight, not its bias) keeps ``weight`` as its leaf;
    a layer whose weight is registered as None has no leaf (NO_LEAF, not None)."""
    from lightning_bnp.core.layers import NO_LEAF, weight_leaf

    class Double(nn.Module):
        def forward(self, t: Tensor) -> Tensor:
            return 2 * t

    layer = nn.Linear(3, 2)
    layer.register_parameter("scale", nn.Parameter(torch.ones(2)))
    parametrize.register_parametrization(layer, "scale", Double())
    assert weight_leaf(layer) is layer._parameters["weight"]
    no_weight = nn.Linear(3, 2)
    no_weight.register_parameter("weight", None)
    assert weight_leaf(no_weight) is NO_LEAF


@pytest.mark.stack
def test_the_setup_warning_for_a_layer_left_alone_names_the_callers_line() -> None:
    """The warning points at the line that built the preconditioner, however deep inside BNP it is raised."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    parametrizations.spectral_norm(model[0])
    with pytest.warns(BNPWarning, match="left alone") as record:
        BNPPreconditioner(model)
    assert [w.filename for w in record if issubclass(w.category, BNPWarning)] == [__file__]


class ComputedWeight(nn.Linear):
    """A Linear whose ``weight`` is a plain tensor set on the module (not a Parameter), beside a ``weight_orig``
    Parameter of its own (no pruning hook) or a parametrized extra tensor ``scale``: BNP cannot know which
    trainable tensor its weight comes from."""

    def __init__(self, extra: str) -> None:
        super().__init__(5, 4)
        weight = self.weight.detach().clone()
        del self.weight
        self.weight = weight  # a tensor attribute, not a parameter
        if extra == "weight_orig":
            self.weight_orig = nn.Parameter(weight.clone())
        else:
            self.scale = nn.Parameter(torch.ones(4))
            parametrize.register_parametrization(self, "scale", nn.Tanh())


@pytest.mark.parametrize(
    ("extra", "class_name"),  # torch.nn.utils.parametrize gives the module a class of its own
    [("weight_orig", "ComputedWeight"), ("parametrized scale", "ParametrizedComputedWeight")],
)
def test_a_weight_that_is_not_a_parameter_is_left_alone_naming_the_layer_and_the_reason(
    extra: str, class_name: str
) -> None:
    """Neither a ``weight_orig`` Parameter without a pruning hook (not pruned) nor a parametrization of another
    tensor (not the weight's) makes such a weight one BNP follows: the layer is left alone with the whole message."""
    torch.manual_seed(0)
    net = nn.Sequential(ComputedWeight(extra), nn.ReLU(), nn.Linear(4, 2))
    message = (
        f"BNP layer '0' ({class_name}) is left alone: its weight is not a parameter of the module (a tensor set or "
        "computed outside it), so its gradient is not the one an optimizer uses. Exclude it with `exclude` to "
        "silence this warning (README 'Reparametrized layers')."
    )
    with pytest.warns(BNPWarning, match=f"^{re.escape(message)}$"):
        pre = BNPPreconditioner(net)
    assert list(pre.layers) == ["2"]


class Scale(nn.Module):
    """A parametrization with a trainable parameter of its own (``parametrizations.weight.0.gain``)."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(()))

    def forward(self, t: Tensor) -> Tensor:
        return self.gain * t


def test_a_chain_of_parametrizations_is_named_in_order_with_the_chains_own_originals() -> None:
    """The message lists every parametrization of the chain, in order, and the chain's own tensors only
    (``original``; not the parameters inside the parametrizations)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2))
    parametrize.register_parametrization(net[0], "weight", Scale())
    parametrize.register_parametrization(net[0], "weight", nn.Tanh())
    message = (
        "BNP layer '0' (ParametrizedLinear) is left alone: its weight is computed by torch.nn.utils.parametrize "
        "(Scale, Tanh) "
        "from parametrizations.weight.original; the optimizer updates those tensors, whose gradient is "
        "Jᵀ·∂L/∂weight, for which BNP's transform (eq. 15) has no exact form. Exclude it with `exclude` to "
        "silence this warning (README 'Reparametrized layers')."
    )
    with pytest.warns(BNPWarning, match=f"^{re.escape(message)}$"):
        BNPPreconditioner(net)


def test_manageable_keeps_the_modules_it_can_precondition_and_names_the_others() -> None:
    """``manageable`` returns the very modules it keeps, warns with the category it is given, and refuses a set
    where none is left (the whole message, naming every selected layer) or a lazy one (the whole message)."""
    from lightning_bnp.core.reparametrization import manageable

    plain, orthogonal = nn.Linear(3, 3), parametrizations.orthogonal(nn.Linear(3, 3))
    with pytest.warns(UserWarning, match=r"^BNP layer 'b' \(ParametrizedLinear\) is left alone: its weight"):
        kept = manageable({"a": plain, "b": orthogonal}, UserWarning)
    assert list(kept) == ["a"] and kept["a"] is plain
    none_left = (
        "no layer is left for BNP: every selected layer (['b', 'c']) is reparametrized in a way BNP cannot "
        "precondition (the warnings name the reason for each)"
    )
    with pytest.warns(UserWarning), pytest.raises(ValueError, match=f"^{re.escape(none_left)}$"):
        manageable({"c": torch.nn.utils.parametrizations.spectral_norm(nn.Linear(3, 3)), "b": orthogonal}, UserWarning)
    lazy = (
        "layers ['0'] are uninitialised lazy modules (e.g. nn.LazyLinear): BNP sizes its statistics from the "
        "weight's shape, which is known only after a first forward pass. Run one forward first "
        "(`model(example_input)`; the Lightning callback does it with `example_input_array`), or exclude them "
        "with `exclude`, e.g. exclude=['0']."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(lazy)}$"):
        BNPPreconditioner(nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 2)))


class Double(nn.Module):
    def forward(self, t: Tensor) -> Tensor:
        return 2 * t


def test_a_recurrent_block_whose_own_weight_is_reparametrized_is_left_alone_and_the_other_kept() -> None:
    """A kind says which tensors it feeds (an LSTM's ``weight_hh_l0`` for its hh block): that block is left alone
    with the reason, the ih block of the same module stays managed (the module's ``weight``, which it has not, is
    not what decides)."""
    lstm = nn.LSTM(4, 3)
    parametrize.register_parametrization(lstm, "weight_hh_l0", Double())
    with pytest.warns(BNPWarning) as caught:
        pre = BNPPreconditioner(nn.ModuleDict({"rnn": lstm, "head": nn.Linear(3, 2)}))
    assert list(pre.layers) == ["rnn.ih_l0", "head"]
    assert [str(w.message) for w in caught] == [
        "BNP layer 'rnn.hh_l0' (ParametrizedLSTM) is left alone: its weight_hh_l0 is computed by "
        "torch.nn.utils.parametrize (Double) from parametrizations.weight_hh_l0.original; the optimizer updates "
        "those tensors, whose gradient is Jᵀ·∂L/∂weight_hh_l0, for which BNP's transform (eq. 15) has no exact "
        "form. Exclude it with `exclude` to silence this warning (README 'Reparametrized layers')."
    ]
    pre.detach()
