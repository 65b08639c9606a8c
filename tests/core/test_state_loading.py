"""Loading a preconditioner's state (issue 45, item 5): all or nothing, refused with the layer named when it cannot be
right (another kind of layer, statistics that are not finite), and a state saved under another ρ gives the running
statistics that an explicit float64 recursion over the ρ's really applied gives."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from lightning_bnp import BNPPreconditioner, LayerKind, register_layer_kind
from lightning_bnp.core.kinds import unregister_layer_kind
from lightning_bnp.core.preconditioner import BNPWarning

BATCHES = [torch.randn(16, 4, generator=torch.Generator().manual_seed(i)) * (1 + i) + 0.5 * i for i in range(6)]


def _trained(model: nn.Module, steps: int = 2, **kwargs: Any) -> BNPPreconditioner:
    pre = BNPPreconditioner(model, **kwargs)
    for i in range(steps):
        model(torch.randn(8, *_input_shape(model), generator=torch.Generator().manual_seed(i))).sum().backward()
        pre.step()
        model.zero_grad()
    return pre


def _input_shape(model: nn.Module) -> tuple[int, ...]:
    first = next(m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d)))
    if isinstance(first, nn.Linear):
        return (first.in_features,)
    return (first.in_channels, *([6] * (first.weight.dim() - 2)))


def _fresh(pre: BNPPreconditioner) -> None:
    for layer in pre.layers.values():
        assert layer.running.steps == 0
        assert not layer.running.mean_acc.any() and not layer.running.var_acc.any()


def test_a_conv_state_into_same_named_dense_layers_is_refused_before_anything_is_loaded() -> None:
    """It raised ``KeyError: 'conv_statistics'`` after the statistics were loaded."""
    state = _trained(nn.Sequential(nn.Linear(3, 4), nn.Unflatten(1, (4, 1)), nn.Conv1d(4, 3, 1))).state_dict()
    target = BNPPreconditioner(nn.Sequential(nn.Linear(3, 4), nn.Identity(), nn.Linear(4, 3)))
    with pytest.raises(ValueError, match=r"layer '2' were saved from a Conv1d layer .*now a Linear layer"):
        target.load_state_dict(state)
    _fresh(target)


def test_a_conv1d_state_into_a_conv2d_of_the_same_name_is_refused_naming_both() -> None:
    """Both have 2 input channels: the statistics loaded silently."""
    state = _trained(nn.Sequential(nn.Conv1d(2, 4, 3))).state_dict()
    target = BNPPreconditioner(nn.Sequential(nn.Conv2d(2, 4, 3)))
    match = (
        r"'0' were saved from a Conv1d layer \(weight shape \(4, 2, 3\)\).*Conv2d layer \(weight shape \(4, 2, 3, 3\)\)"
    )
    with pytest.raises(ValueError, match=match):
        target.load_state_dict(state)
    _fresh(target)


@pytest.mark.parametrize(("key", "value"), [("var_acc", float("nan")), ("mean_acc", float("inf"))])
def test_a_state_with_statistics_that_are_not_finite_is_refused_naming_the_layer(key: str, value: float) -> None:
    """It was accepted, and the warning that followed named another layer and blamed the batch."""
    state = _trained(nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))).state_dict()
    state["layers"]["2"][key][1] = value
    target = BNPPreconditioner(nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)))
    with pytest.raises(ValueError, match=rf"layer '2' \(Linear\) in the state are not finite \(NaN or Inf in {key}\)"):
        target.load_state_dict(state)
    _fresh(target)  # layer '0' (checked first, fine) is not loaded either


def _reference(rhos: list[float], batches: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Alg. 2 step 2 in float64 from μ = 0, σ² = 1 with one ρ per step; returns μ, σ² and the product of the ρ's."""
    mu, var, product = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64), 1.0
    for rho, x in zip(rhos, batches):
        x = x.double()
        mu = rho * mu + (1 - rho) * x.mean(0)
        var = rho * var + (1 - rho) * x.var(0, unbiased=False)
        product *= rho
    return mu, var, product


def _run(pre: BNPPreconditioner, model: nn.Module, batches: list[torch.Tensor]) -> None:
    for x in batches:
        model(x).sum().backward()
        pre.step()
        model.zero_grad()


@pytest.mark.parametrize("bias_correction", [False, True])
@pytest.mark.parametrize("old_state", [False, True])
@pytest.mark.parametrize("third_rho", [0.5, 0.7])
def test_resuming_under_another_rho_gives_the_statistics_of_the_rhos_applied(bias_correction: bool, old_state: bool,
                                                                             third_rho: float) -> None:  # fmt: skip
    """The training stayed exact, but ``running.mu``/``.var`` (and κ(D), from ``data_view``) recomputed ρ^t with the
    new ρ: σ² off by 0.2 here. A state saved before the ρ's product was kept loads too (its ρ is the saved one).
    Resumed a second time under a third ρ (0.7): the state saved after the first resume holds the product of the
    first ρ's and the step it was folded at, and only the steps since that one take the second ρ."""
    model = nn.Linear(4, 2)
    first = BNPPreconditioner(model, rho=0.9, bias_correction=bias_correction)
    _run(first, model, BATCHES[:3])
    state = first.state_dict()
    if old_state:  # as written before the kinds and the ρ's product were saved
        state.pop("kinds")
        for layer_state in state["layers"].values():
            layer_state.pop("decay_base"), layer_state.pop("base_steps")
    first.detach()
    second = BNPPreconditioner(model, rho=0.5, bias_correction=bias_correction)
    with pytest.warns(BNPWarning, match="rho: saved 0.9, now 0.5"):
        second.load_state_dict(state)
    _run(second, model, BATCHES[3:5])
    third_state = second.state_dict()
    second.detach()
    third = BNPPreconditioner(model, rho=third_rho, bias_correction=bias_correction)  # resumed again
    if third_rho == 0.5:  # the same ρ
        third.load_state_dict(third_state)
    else:
        with pytest.warns(BNPWarning, match="rho: saved 0.5, now 0.7"):
            third.load_state_dict(third_state)
    _run(third, model, BATCHES[5:])
    mu, var, product = _reference([0.9] * 3 + [0.5] * 2 + [third_rho], BATCHES)
    running = third.layers[""].running
    assert running.steps == 6
    data_mu, data_var = (mu) / (1 - product), (var - product) / (1 - product)
    if bias_correction:  # the accumulators start at 0: μ = m/(1 − Πρ), σ² = v/(1 − Πρ) with v = σ²_paper − Πρ
        mu, var = data_mu, data_var
    torch.testing.assert_close(running.mu.double(), mu, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(running.var.double(), var, rtol=1e-5, atol=1e-6)
    view_mu, view_var = running.data_view()
    torch.testing.assert_close(view_mu.double(), data_mu, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(view_var.double(), data_var, rtol=1e-5, atol=1e-6)


def test_a_state_of_other_layers_says_what_to_do_and_loads_the_common_ones_with_strict_false() -> None:
    saved = _trained(nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)))
    target = BNPPreconditioner(nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 5), nn.Linear(5, 3)))
    with pytest.raises(ValueError, match=r"missing \['3'\].*unexpected \[\].*`include`, `exclude`.*strict=False"):
        target.load_state_dict(saved.state_dict())
    _fresh(target)
    with pytest.warns(BNPWarning, match=r"missing \['3'\] \(not in the state\) keep their statistics"):
        target.load_state_dict(saved.state_dict(), strict=False)
    for name in ("0", "2"):
        assert target.layers[name].running.steps == 2
        torch.testing.assert_close(target.layers[name].running.var, saved.layers[name].running.var, rtol=0, atol=0)
    assert target.layers["3"].running.steps == 0
    with pytest.raises(TypeError, match="`strict` must be a bool"):
        target.load_state_dict(saved.state_dict(), strict="no")  # type: ignore[arg-type]


def test_a_state_of_the_same_layers_loads_silently() -> None:
    state = _trained(nn.Sequential(nn.Conv1d(2, 4, 3))).state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        BNPPreconditioner(nn.Sequential(nn.Conv1d(2, 4, 3))).load_state_dict(state)


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))


def test_a_state_of_other_layers_is_refused_with_every_way_out_in_the_message() -> None:
    """The whole message: what differs, why it happens, and the three ways out (same selection, ``strict=False``
    and what it leaves fresh, no BNP state)."""
    state = _trained(_mlp()).state_dict()
    target = BNPPreconditioner(nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 5), nn.Linear(5, 3)))
    message = (
        "BNP state does not match the managed layers: missing ['3'] (managed now, not in the state), unexpected [] "
        "(in the state, not managed now). It was saved from another model or another layer selection (`layer_types`, "
        "`include`, `exclude`, `embeddings`): build the preconditioner with the selection it was saved with; or load "
        "the layers both have with `load_state_dict(state, strict=False)` (the others start fresh: μ = 0, σ² = 1); "
        "or start without the BNP state."
    )
    with pytest.raises(ValueError) as caught:
        target.load_state_dict(state)
    assert str(caught.value) == message
    _fresh(target)


def test_a_resume_under_other_settings_warns_naming_each_change_and_that_the_current_ones_hold() -> None:
    state = _trained(_mlp()).state_dict()  # ρ = 0.99, ε1 = 0.01
    target = BNPPreconditioner(_mlp(), rho=0.5, eps1=0.1)
    with pytest.warns(BNPWarning) as caught:
        target.load_state_dict(state)
    assert [str(w.message) for w in caught] == [
        "BNP statistics loaded from a state saved with other settings (eps1: saved 0.01, now 0.1, rho: saved 0.99, "
        "now 0.5); they continue under the current settings."
    ]
    assert all(layer.running.steps == 2 for layer in target.layers.values())


@pytest.mark.stack  # pins the line a warning names: outside `make mutate` (its trampolines are frames)
def test_the_warnings_of_a_partial_load_and_of_changed_settings_point_at_the_callers_line() -> None:
    saved = _trained(_mlp())
    partial = BNPPreconditioner(nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 5), nn.Linear(5, 3)))
    with pytest.warns(BNPWarning, match=r"missing \['3'\] \(not in the state\)") as caught:
        partial.load_state_dict(saved.state_dict(), strict=False)
    assert [w.filename for w in caught] == [__file__]
    changed = BNPPreconditioner(_mlp(), rho=0.5)
    with pytest.warns(BNPWarning, match=r"rho: saved 0.99, now 0.5") as caught:
        changed.load_state_dict(saved.state_dict())
    assert [w.filename for w in caught] == [__file__]


def test_a_layer_of_another_kind_is_refused_with_the_whole_message() -> None:
    state = _trained(nn.Sequential(nn.Conv1d(2, 4, 3))).state_dict()
    target = BNPPreconditioner(nn.Sequential(nn.Conv2d(2, 4, 3)))
    message = (
        "BNP statistics of layer '0' were saved from a Conv1d layer (weight shape (4, 2, 3)), but '0' is now a Conv2d "
        "layer (weight shape (4, 2, 3, 3)): the state was saved from a model whose layer of that name is another kind "
        "of layer; nothing was loaded. Load it into the same architecture, or start without the BNP state."
    )
    with pytest.raises(ValueError) as caught:
        target.load_state_dict(state)
    assert str(caught.value) == message
    _fresh(target)


def test_statistics_not_finite_in_every_saved_tensor_are_all_named_with_the_whole_message() -> None:
    """μ's and σ²'s accumulators and the running ρ^t (``decay``): each one not finite would make P not finite."""
    state = _trained(_mlp()).state_dict()
    decay_only = copy.deepcopy(state)
    decay_only["layers"]["2"]["decay"][0] = float("inf")
    target = BNPPreconditioner(_mlp())
    with pytest.raises(ValueError, match=r"layer '2' \(Linear\) in the state are not finite \(NaN or Inf in decay\)"):
        target.load_state_dict(decay_only)
    _fresh(target)
    for key in ("mean_acc", "var_acc", "decay"):
        state["layers"]["2"][key][0] = float("nan")
    message = (
        "BNP statistics of layer '2' (Linear) in the state are not finite (NaN or Inf in mean_acc, var_acc, decay): "
        "the state was saved from a run whose statistics had already gone wrong; nothing was loaded. Resume from an "
        "earlier checkpoint, or start without the BNP state."
    )
    with pytest.raises(ValueError) as caught:
        target.load_state_dict(state)
    assert str(caught.value) == message
    _fresh(target)


class Scaled(nn.Linear):
    """A Linear of its own layer kind, whose statistics are named by the module (``statistics_unit``)."""


class ScaledKind(LayerKind):
    name = "Scaled"
    module_type = Scaled

    def statistics_unit(self, module: nn.Module) -> str:
        return f"inputs of each of its {module.out_features} outputs"


def test_statistics_of_another_length_are_refused_naming_the_unit_the_kind_gives_for_the_module() -> None:
    register_layer_kind(ScaledKind())
    try:
        state = _trained(nn.Sequential(Scaled(3, 2)), layer_types=["Scaled"]).state_dict()
        target = BNPPreconditioner(nn.Sequential(Scaled(4, 2)), layer_types=["Scaled"])
        message = (
            "BNP statistics of layer '0' have 3 entries, but the layer (Scaled) has 4 inputs of each of its 2 "
            "outputs: the state was saved from a model whose layer has another shape. Load it into the same "
            "architecture, or start without the BNP state."
        )
        with pytest.raises(ValueError) as caught:
            target.load_state_dict(state)
        assert str(caught.value) == message
        _fresh(target)
    finally:
        unregister_layer_kind("Scaled")
