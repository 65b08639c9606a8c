"""Reasons and names: what BNP says about a layer it leaves alone or cannot precondition in a step names the real
cause (a layer type it does not know, an elementwise scale, a detached preconditioner, an empty batch, a forward run
with other tensors than the module's), and a layer of the root module is named without a leading dot."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations

from lightning_bnp import BNPPreconditioner
from lightning_bnp.core.kinds import LayerKind, register_layer_kind, unregister_layer_kind
from lightning_bnp.core.layers import BNPWarning
from tests.helpers import Affine


class RootFunctional(nn.Module):
    """A root module that uses its own Linear through ``F.linear`` (BNP reads that from the source)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.linear(x, self.fc.weight, self.fc.bias))


def test_a_layer_the_root_module_feeds_through_f_linear_is_named_without_a_leading_dot() -> None:
    model = RootFunctional()
    pre = BNPPreconditioner(model)
    assert sorted(pre.layers) == ["fc", "head"]
    pre.detach()
    pre = BNPPreconditioner(model, exclude=["fc"])
    assert list(pre.layers) == ["head"]
    assert pre.skipped == {"fc.weight": "excluded by `exclude` pattern 'fc'"}
    pre.detach()


def test_the_blocks_of_a_root_attention_are_named_q_k_v_and_out_proj() -> None:
    pre = BNPPreconditioner(nn.MultiheadAttention(4, 2), exclude="k")
    assert list(pre.layers) == ["q", "v", "out_proj"]
    assert pre.skipped == {
        "in_proj_weight": "row blocks ['k'] of it dropped by `include`/`exclude`; the others are transformed"
    }
    pre.detach()


@pytest.mark.parametrize("rnn", [nn.LSTM, nn.GRU, nn.RNN])
def test_a_multi_layer_recurrent_layers_weights_are_named_by_its_layers_not_by_its_bias_flag(
    rnn: type[nn.Module],
) -> None:
    """``nn.LSTM``'s ``bias`` is a bool flag, not a tensor: a one-layer module is transformed (issue 44), a two-layer
    one is named for its layers ≥ 1 (core/recurrent.py), not for its ``bias``."""
    model = nn.ModuleDict({"rnn": rnn(3, 4), "deep": rnn(3, 4, num_layers=2), "head": nn.Linear(4, 2)})
    pre = BNPPreconditioner(model)
    assert [name for name in pre.layers if name.startswith("rnn.")] and not pre.coverage.skipped.keys() & {
        "rnn.weight_ih_l0",
        "rnn.weight_hh_l0",
    }
    names = [f"deep.weight_{b}_l{i}" for i in (0, 1) for b in ("ih", "hh")]
    assert sorted(pre.skipped) == sorted(names)
    assert all(f"{rnn.__name__} with num_layers=2" in reason for reason in pre.skipped.values())
    pre.detach()


class Scaled(nn.Module):
    """A linear layer ``x @ w.T + b`` with a ``bias`` attribute that is not its bias (a flag, or a buffer)."""

    def __init__(self, bias: object) -> None:
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(4))
        if isinstance(bias, torch.Tensor):
            self.register_buffer("bias", bias)
        else:
            self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w.t() + self.b


class ScaledKind(LayerKind):
    name = "Scaled"
    module_type = Scaled
    weight_name = "w"
    bias_name = "b"


@pytest.fixture
def scaled_kind() -> Iterator[None]:
    register_layer_kind(ScaledKind())
    yield
    unregister_layer_kind(ScaledKind.name)


@pytest.mark.usefixtures("scaled_kind")
@pytest.mark.parametrize("bias", [True, torch.zeros(4)], ids=["bool flag", "buffer"])
def test_a_registered_kind_is_checked_by_its_own_weight_and_bias_names(bias: object) -> None:
    """A kind with ``weight_name="w"``, ``bias_name="b"``: the module's own ``bias`` attribute is not its bias, so
    it does not make BNP leave the layer alone; the layer is managed and transformed as an ``nn.Linear`` is."""
    torch.manual_seed(0)
    scaled = Scaled(bias)
    linear = nn.Linear(3, 4)
    with torch.no_grad():
        linear.weight.copy_(scaled.w)
        linear.bias.copy_(scaled.b)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BNPWarning)
        pre = BNPPreconditioner(nn.Sequential(scaled), layer_types=["Scaled"])
        reference = BNPPreconditioner(nn.Sequential(linear))
    assert list(pre.layers) == ["0"] and pre.skipped == {}
    x = torch.randn(8, 3) + 1.0
    for module, p in ((scaled, pre), (linear, reference)):
        module(x).square().sum().backward()
        p.step()
    torch.testing.assert_close(scaled.w.grad, linear.weight.grad)
    torch.testing.assert_close(scaled.b.grad, linear.bias.grad)
    pre.detach()
    reference.detach()


@pytest.mark.usefixtures("scaled_kind")
def test_a_registered_kinds_reparametrized_weight_is_named_by_the_kinds_weight_name() -> None:
    """``w`` under weight norm: the layer is left alone, the warning and the reason naming ``w``."""
    scaled = parametrizations.weight_norm(Scaled(True), "w")
    model = nn.Sequential(scaled, nn.Linear(4, 2))
    why = (
        "its w is computed by torch.nn.utils.parametrize (_WeightNorm) from parametrizations.w.original0, "
        "parametrizations.w.original1; the optimizer updates those tensors, whose gradient is Jᵀ·∂L/∂w, for which "
        "BNP's transform (eq. 15) has no exact form"
    )
    with pytest.warns(BNPWarning) as caught:
        pre = BNPPreconditioner(model, layer_types=["Scaled", "Linear"])
    assert [str(w.message) for w in caught] == [
        f"BNP layer '0' (ParametrizedScaled) is left alone: {why}. Exclude it with `exclude` to silence this "
        "warning (README 'Reparametrized layers')."
    ]
    assert list(pre.layers) == ["1"]
    assert pre.skipped == {
        "0.parametrizations.w.original0": f"left alone: {why}",
        "0.parametrizations.w.original1": f"left alone: {why}",
    }
    pre.detach()


def test_convnexts_layer_scale_is_named_an_elementwise_scale_not_an_unknown_layer_type() -> None:
    """torchvision's ``CNBlock.layer_scale`` ((C, 1, 1), multiplied elementwise): named as what it is and not
    counted among the weight matrices; a real unknown layer's matrix still names its type."""
    from torchvision.models.convnext import CNBlock

    model = nn.Sequential(CNBlock(8, layer_scale=1e-6, stochastic_depth_prob=0.0), Affine(8))
    pre = BNPPreconditioner(model)
    scale = "elementwise scale or shift of CNBlock, shape (8, 1, 1): not a layer's weight matrix (one dimension "
    scale += "above 1), left to the optimizer"
    unknown = "unknown layer type tests.helpers.Affine (teach BNP with register_layer_kind)"
    assert pre.skipped == {"0.layer_scale": scale, "1.matrix": unknown}
    assert pre.report() == (
        f"BNP transforms 3 of the model's 4 trainable weight matrices; it leaves alone 0.layer_scale ({scale}); "
        f"1.matrix ({unknown})"
    )
    pre.detach()


DETACHED = (
    "BNPPreconditioner.{}() on a detached preconditioner: detach() removed its forward hooks, so it has recorded no "
    "statistics since and leaves every gradient untransformed. Call `attach()` before the next forward pass to "
    "precondition again, or build a new BNPPreconditioner."
)


@pytest.mark.parametrize("method", ["step", "precondition"])
def test_a_step_after_detach_says_the_preconditioner_is_detached_once_and_transforms_nothing(method: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    pre = BNPPreconditioner(model)
    model(torch.randn(5, 3)).sum().backward()
    pre.detach()
    before = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    with pytest.warns(BNPWarning) as caught:
        getattr(pre, method)()
        getattr(pre, method)()  # once per detach
    assert [str(w.message) for w in caught] == [DETACHED.format(method)]
    for p, grad in zip(model.parameters(), before):
        torch.testing.assert_close(p.grad, grad, rtol=0, atol=0)
    pre.attach()  # attached again: a step transforms, without the warning
    model.zero_grad()
    model(torch.randn(5, 3)).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", BNPWarning)
        pre.step()
    assert all(layer.transform is not None for layer in pre.layers.values())
    pre.detach()  # a new detach: its first step says so again (once per detach, not once per preconditioner)
    model(torch.randn(5, 3)).sum().backward()
    with pytest.warns(BNPWarning) as caught:
        getattr(pre, method)()
        getattr(pre, method)()
    assert [str(w.message) for w in caught] == [DETACHED.format(method)]


def test_a_zero_row_batch_leaves_the_zero_gradient_and_the_statistics_as_they_are_without_a_warning() -> None:
    """A forward on 0 rows ran: its gradient is 0, which every M leaves 0, and no row updates the running
    statistics; it is not a forward that never ran (the warning is for that)."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    pre = BNPPreconditioner(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BNPWarning)
        model(torch.zeros(0, 3)).sum().backward()
        pre.step()
        assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
        assert all(layer.transform is None and layer.running.steps == 0 for layer in pre.layers.values())
        model(torch.randn(5, 3)).sum().backward()  # the next batch is a first step
        pre.step()
    assert all(layer.transform is not None and layer.running.steps == 1 for layer in pre.layers.values())
    pre.detach()


FOREIGN = (
    "BNP layer {!r} ({}): its statistics were recorded from a forward that ran with another tensor as its weight "
    "than the module's own (e.g. torch.func.functional_call(model, params, x)), and the backward put the gradient on "
    "that tensor: the module's weight got none in this step, so BNP transformed nothing and dropped the statistics. "
    "Call the module itself (model(x)) so that its own weight gets the gradient, or precondition the gradients of "
    "the tensors the forward used: copy them to the module's parameters' `.grad` before step()."
)


@pytest.mark.parametrize(
    ("make", "names"),
    [
        (lambda: nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)), [("0", "Linear"), ("1", "Linear")]),
        (RootFunctional, [("fc", "RootFunctional"), ("head", "Linear")]),  # fc: its parent's F.linear call
    ],
    ids=["hooked", "captured from F.linear"],
)
def test_a_forward_through_functional_call_with_other_tensors_is_named_at_the_step(
    make: Callable[[], nn.Module], names: list[tuple[str, str]]
) -> None:
    """The hooks record the statistics, the gradients land on the cloned tensors: the step names each layer whose
    statistics came from such a forward and whose own weight got no gradient, and what to do."""
    torch.manual_seed(0)
    model = make()
    pre = BNPPreconditioner(model)
    params = {name: p.detach().clone().requires_grad_() for name, p in model.named_parameters()}
    torch.func.functional_call(model, params, torch.randn(5, 3)).sum().backward()
    assert all(p.grad is None for p in model.parameters()) and all(p.grad is not None for p in params.values())
    with pytest.warns(BNPWarning) as caught:
        pre.step()
    assert sorted(str(w.message) for w in caught) == [FOREIGN.format(*name) for name in names]
    assert all(layer.moments is None and layer.transform is None for layer in pre.layers.values())
    with warnings.catch_warnings():  # the module itself: transformed, nothing to say
        warnings.simplefilter("error", BNPWarning)
        model(torch.randn(5, 3)).sum().backward()
        pre.step()
        # the same tensors as the module's (a functional_call with its own parameters): nothing to say either
        dict_params = dict(model.named_parameters())
        model.zero_grad()
        torch.func.functional_call(model, dict_params, torch.randn(5, 3)).sum().backward()
        pre.step()
    assert all(layer.transform is not None for layer in pre.layers.values())
    pre.detach()
