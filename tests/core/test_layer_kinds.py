"""Issue 29: layer kinds as adapters. A user-registered kind (a linear layer whose weight is stored (in, out)
and applied with ``addmm``, as GPT-2's ``Conv1D``) is preconditioned exactly as BNP preconditions the
equivalent ``nn.Linear``; GPT-2's own ``Conv1D`` out of the box; and what BNP leaves alone is named."""

from __future__ import annotations

import sys
import warnings
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_bnp import BNPPreconditioner, LayerKind, register_layer_kind
from lightning_bnp.core.kinds import ConvNdKind, layer_kinds, unregister_layer_kind
from lightning_bnp.core.moments import feature_moments, masked_feature_moments
from lightning_bnp.core.preconditioner import BNPWarning
from lightning_bnp.core.statistics import Moments
from tests.helpers import Affine, spy_moments
from tests.transposed import TransposedLinear, as_linear_parameters, transposed


class Net(nn.Module):
    """Linear layers with and without bias, one applied to (B, T, F) inputs, one called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 7, bias=False)
        self.c = nn.Linear(7, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(torch.tanh(self.b(h))))
        return self.c(h).mean(1)


def sgd_steps(model: nn.Module, steps: int, **bnp: object) -> dict[str, Tensor]:
    pre = BNPPreconditioner(model, rho=0.9, **bnp)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x = torch.randn(4, 6, 5, generator=g, dtype=torch.float64) * torch.logspace(-1, 1, 5, dtype=torch.float64) + 1
        model.zero_grad()
        model(x).square().sum().backward()
        pre.step()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.05 * p.grad)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_a_registered_transposed_linear_kind_is_exact_against_bnp_on_nn_linear() -> None:
    torch.manual_seed(0)
    reference = Net().double()
    model = transposed(Net().double())
    model.load_state_dict({k: v.t() if k.endswith("weight") else v for k, v in reference.state_dict().items()})
    assert all(isinstance(m, TransposedLinear) for m in model.children())
    expected = sgd_steps(reference, 5)
    got = as_linear_parameters(sgd_steps(model, 5), model)
    assert expected.keys() == got.keys()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-12, atol=1e-12, msg=name)


def test_the_transposed_kind_is_selected_by_its_name_and_by_its_family() -> None:
    model = nn.Sequential(nn.Linear(3, 4), TransposedLinear(4, 2))
    assert set(BNPPreconditioner(model).layers) == {"0", "1"}  # the default "Linear" family
    model = nn.Sequential(nn.Linear(3, 4), TransposedLinear(4, 2))
    assert set(BNPPreconditioner(model, layer_types=["TransposedLinear"]).layers) == {"1"}
    model = nn.Sequential(nn.Linear(3, 4), TransposedLinear(4, 2))
    pre = BNPPreconditioner(model, layer_types="TransposedLinear")
    assert pre.layers["1"].features == 4 and pre.layers["1"].fan_in == 4
    assert pre.skipped == {"0.weight": "layer type 'Linear' is not in `layer_types`"}


def test_step_transform_maps_weight_shaped_vectors_through_the_kinds_rows() -> None:
    """M of the latest step applied to a weight-shaped vector (what z-space regularization does) equals the
    nn.Linear twin's on the transposed vector."""
    torch.manual_seed(0)
    linear = nn.Linear(4, 3).double()
    layer = TransposedLinear.from_linear(linear).double()
    x = torch.randn(6, 4, dtype=torch.float64) * 3 + 1
    vectors = []
    for module in (linear, layer):
        pre = BNPPreconditioner(module)
        module(x).sum().backward()
        pre.step()
        vec_w, vec_b = torch.arange(12.0, dtype=torch.float64).view(3, 4), torch.ones(3, dtype=torch.float64)
        vec_w = vec_w if module is linear else vec_w.t().clone()
        pre.layers[""].transform.apply_(vec_w, vec_b)  # type: ignore[union-attr]
        vectors.append((vec_w if module is linear else vec_w.t(), vec_b))
    torch.testing.assert_close(vectors[0], vectors[1])


def test_register_layer_kind_refuses_wrong_arguments() -> None:
    with pytest.raises(TypeError, match="must be an instance of a LayerKind subclass"):
        register_layer_kind(TransposedLinear)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'Linear' is already registered"):
        register_layer_kind(type("Again", (LayerKind,), {"name": "Linear", "module_type": nn.Linear})())
    with pytest.raises(ValueError, match="non-empty `name`"):
        register_layer_kind(LayerKind())
    with pytest.raises(ValueError, match="`family` 'Dense' is not a registered layer type"):
        register_layer_kind(type("K", (LayerKind,), {"name": "K", "family": "Dense"})())
    with pytest.raises(ValueError, match="not a user-registered layer kind"):
        unregister_layer_kind("Linear")


def test_a_kind_registered_later_is_accepted_in_layer_types_and_unknown_names_are_refused() -> None:
    class Scaled(nn.Linear):
        pass

    with pytest.raises(ValueError, match=r"unknown \['Scaled'\]"):
        BNPPreconditioner(nn.Sequential(Scaled(2, 2)), layer_types=["Scaled"])
    kind = type("ScaledKind", (LayerKind,), {"name": "Scaled", "module_type": Scaled})()
    register_layer_kind(kind)
    try:
        assert "Scaled" in layer_kinds()
        model = nn.Sequential(Scaled(2, 2), nn.Linear(2, 2))
        pre = BNPPreconditioner(model, layer_types=["Linear", "Scaled"])
        assert pre.layers["0"].kind is kind  # the most specific kind wins over nn.Linear's
        assert pre.layers["1"].kind.name == "Linear"
        pre.detach()
        pre = BNPPreconditioner(model)  # a Scaled layer is not managed as a Linear one when "Scaled" is not wanted
        assert list(pre.layers) == ["1"] and pre.skipped == {"0.weight": "layer type 'Scaled' is not in `layer_types`"}
    finally:
        unregister_layer_kind("Scaled")


def test_a_users_kind_for_the_same_class_as_a_built_in_one_applies_when_it_alone_is_selected() -> None:
    """Two kinds for ``nn.Linear``'s ``weight``: the one ``layer_types`` selects applies (before, the built-in one,
    registered first, shadowed the user's: "no LinearTwin layer is left ... candidates are []"); both selected: the
    built-in one, registered first."""
    register_layer_kind(type("LinearTwinKind", (LayerKind,), {"name": "LinearTwin", "module_type": nn.Linear})())
    try:
        model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2))
        for layer_types, name in (
            (["LinearTwin"], "LinearTwin"),
            (["Linear"], "Linear"),
            (["Linear", "LinearTwin"], "Linear"),
        ):
            pre = BNPPreconditioner(model, layer_types=layer_types)
            assert [layer.kind.name for layer in pre.layers.values()] == [name, name], layer_types
            assert pre.skipped == {}
            assert "2 of the model's 2 trainable weight matrices" in pre.report()
            pre.detach()
    finally:
        unregister_layer_kind("LinearTwin")


# ----------------------------------------------------------------- what BNP leaves alone


def test_skipped_names_each_weight_matrix_bnp_leaves_alone_with_its_reason() -> None:
    model = nn.Sequential(
        nn.Linear(4, 4), Affine(), nn.Linear(4, 4), nn.Linear(4, 4), nn.Bilinear(4, 4, 4), nn.Embedding(3, 4)
    )
    model[3].requires_grad_(False)
    model[3].bias.requires_grad_(True)
    pre = BNPPreconditioner(model, exclude="2")
    assert pre.coverage.transformed == ("0.weight",)
    assert pre.skipped == {
        "1.matrix": "unknown layer type tests.helpers.Affine (teach BNP with register_layer_kind)",
        "2.weight": "excluded by `exclude` pattern '2'",
        "4.weight": "unknown layer type torch.nn.modules.linear.Bilinear (teach BNP with register_layer_kind)",
        "5.weight": "embedding (embeddings=False)",
        "3.weight": "frozen (requires_grad=False); transformed once it trains",
    }
    assert pre.report(limit=2) == (
        "BNP transforms 1 of the model's 5 trainable weight matrices; it leaves alone 1.matrix (unknown layer type "
        "tests.helpers.Affine (teach BNP with register_layer_kind)); 2.weight (excluded by `exclude` "
        "pattern '2'); and 3 more"
    )
    assert BNPPreconditioner(nn.Sequential(nn.Linear(2, 2))).report() == (
        "BNP transforms 1 of the model's 1 trainable weight matrices"
    )


def test_a_custom_linear_like_layer_is_named_until_its_kind_is_registered() -> None:
    class Custom(TransposedLinear):
        pass

    model = nn.Sequential(nn.Linear(3, 4), Affine())
    assert list(BNPPreconditioner(model).skipped) == ["1.matrix"]
    model = nn.Sequential(TransposedLinear(3, 4), Custom(4, 2))  # a subclass of a registered kind is that kind
    assert BNPPreconditioner(model).skipped == {}


def test_transformer_encoder_attention_projections_are_transformed_or_named_when_excluded() -> None:
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    pre = BNPPreconditioner(model)
    assert pre.skipped == {}  # issue 24: in_proj's q, k, v blocks and out_proj (through F.linear) are managed
    assert pre.report() == "BNP transforms 8 of the model's 8 trainable weight matrices"
    pre.detach()
    pre = BNPPreconditioner(model, exclude="layers.0.self_attn")
    reason = "excluded by `exclude` pattern 'layers.0.self_attn'"
    assert pre.skipped == {f"layers.0.self_attn.{name}": reason for name in ("in_proj_weight", "out_proj.weight")}
    assert pre.report().startswith("BNP transforms 6 of the model's 8 trainable weight matrices; it leaves alone ")


# ----------------------------------------------------------------------------- GPT-2
def gpt2_pair() -> tuple[nn.Module, nn.Module]:
    """A small GPT-2 (random init, nothing downloaded) and its twin with every Conv1D an nn.Linear."""
    transformers = pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    config = transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, n_positions=16, vocab_size=40, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).double()
    twin = transformers.GPT2LMHeadModel(config).double()
    twin.load_state_dict(model.state_dict())

    def to_linear(module: nn.Module) -> None:
        for name, child in module.named_children():
            if isinstance(child, Conv1D):
                linear = nn.Linear(child.nx, child.nf).double()
                with torch.no_grad():
                    linear.weight.copy_(child.weight.t())
                    linear.bias.copy_(child.bias)
                setattr(module, name, linear)
            else:
                to_linear(child)

    to_linear(twin)
    return model, twin


def test_gpt2_conv1d_layers_are_all_transformed_and_equal_bnp_on_nn_linear() -> None:
    model, twin = gpt2_pair()
    names = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    projections = [f"transformer.h.{i}.{name}" for i in range(2) for name in names]
    results = []
    for net in (model, twin):
        with pytest.warns(BNPWarning, match=r"'lm_head' shares its weight with 'transformer.wte' \(Embedding\)"):
            pre = BNPPreconditioner(net, rho=0.9)
        assert set(pre.layers) == {*projections, "lm_head"}
        assert pre.skipped == {"transformer.wpe.weight": "embedding (embeddings=False)"}
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            ids = torch.randint(0, 40, (3, 10), generator=g)
            net.zero_grad()
            net(input_ids=ids, labels=ids).loss.backward()
            pre.step()
            with torch.no_grad():
                for p in net.parameters():
                    p.sub_(0.5 * p.grad)
        assert all(pre.layers[name].running.steps == 3 for name in projections)
        pre.detach()
        results.append(dict(net.named_parameters()))
    gpt2, linear = results
    stored_transposed = {f"{name}.weight" for name in projections}
    for name, value in linear.items():
        got = gpt2[name].t() if name in stored_transposed else gpt2[name]
        torch.testing.assert_close(got, value, rtol=1e-9, atol=1e-10, msg=name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BNPWarning)
        assert len(BNPPreconditioner(model, layer_types="transformers.Conv1D").layers) == 8


def test_the_conv1d_kind_does_not_import_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-2's Conv1D kind is resolved from ``sys.modules``: a model can only hold a Conv1D once the user has
    imported ``transformers.pytorch_utils``, and BNP never imports it (``transformers`` is not a dependency)."""
    monkeypatch.delitem(sys.modules, "transformers.pytorch_utils", raising=False)
    kind = layer_kinds()["transformers.Conv1D"]
    assert kind.module_types() == ()
    BNPPreconditioner(nn.Linear(2, 2), layer_types=["Linear", "transformers.Conv1D"]).detach()
    assert "transformers.pytorch_utils" not in sys.modules


def test_step_transform_reproduces_the_steps_own_transform_on_a_grouped_convolution() -> None:
    """Applied to the raw gradient of the latest step, the stored M gives what the step made of it (the
    groups of the convolution included: μ and σ̃² per input channel of the layer's own group)."""
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 6, 3, groups=2).double()
    pre = BNPPreconditioner(conv)
    x = torch.randn(5, 4, 6, 6, dtype=torch.float64) * torch.tensor([1.0, 3.0, 0.5, 2.0]).double().view(1, 4, 1, 1)
    conv(x + 1).square().sum().backward()
    raw_w, raw_b = conv.weight.grad.clone(), conv.bias.grad.clone()  # type: ignore[union-attr]
    pre.step()
    transform = pre.layers[""].transform
    assert transform is not None and transform.mu is not None and transform.groups == 2
    transform.apply_(raw_w, raw_b)
    torch.testing.assert_close(raw_w, conv.weight.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(raw_b, conv.bias.grad, rtol=1e-12, atol=1e-12)


def test_step_transform_without_a_bias_vector_maps_the_weight_alone() -> None:
    """``vec_b=None`` on a centred layer is M applied to (vec_w, 0): the weight part is vec_w / (q²σ̃²), and the
    kind's bias view is not asked for (the q block of an attention: a slice of its in_proj bias)."""
    torch.manual_seed(0)
    E = 4
    net = nn.Module()
    net.attn = nn.MultiheadAttention(E, 2, batch_first=True).double()
    pre = BNPPreconditioner(net, layer_types=["MultiheadAttention.q"])
    x = torch.randn(3, 5, E, dtype=torch.float64) + 0.5
    net.attn(x, x, x, need_weights=False)[0].square().sum().backward()
    pre.step()
    transform = pre.layers["attn.q"].transform
    assert transform is not None and transform.mu is not None
    vec = torch.randn(3 * E, E, dtype=torch.float64)
    want = vec.clone()
    want[:E] /= transform.q2 * transform.var_t
    transform.apply_(vec, None)
    torch.testing.assert_close(vec, want, rtol=1e-12, atol=1e-12)


class Pair(nn.Module):
    """One weight applied to its first input and to an optional keyword input (named by ``second``), each cast to
    the weight's dtype and scaled by ``input_scale``: returns both outputs (the second ``None`` without it)."""

    def __init__(self, in_features: int, out_features: int, input_scale: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features))
        self.bias = nn.Parameter(torch.randn(out_features))
        self.input_scale, self.second = input_scale, "other"

    def forward(self, x: Tensor, **kwargs: Tensor) -> tuple[Tensor, Tensor | None]:
        def apply(h: Tensor) -> Tensor:
            return (h.to(self.weight.dtype) * self.input_scale) @ self.weight.T + self.bias

        other = kwargs.get(self.second)
        return apply(x), None if other is None else apply(other)


class PairKind(LayerKind):
    """The rows ``Pair``'s weight multiplies are its inputs cast to the output's dtype and scaled by the module's
    ``input_scale``: ``moments`` needs the module and the output. Without the keyword input, its pair has no
    input tensor (skipped) and comes first."""

    name = "Pair"
    module_type = Pair

    def calls(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> list[Any]:
        first, second = output
        return [(kwargs.get(module.second), first if second is None else second), (args[0], first)]

    def moments(self, module: nn.Module, h: Tensor, output: Any) -> Moments:
        return feature_moments(h.to(output.dtype) * module.input_scale)

    def masked_moments(self, module: nn.Module, h: Tensor, output: Any, real: Tensor) -> Moments:
        return masked_feature_moments(h.to(output.dtype) * module.input_scale, real)


def assert_moments_of_rows(m: Moments, rows: Tensor) -> None:
    assert float(m.rows) == rows.shape[0]
    torch.testing.assert_close(m.mean, rows.mean(0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m.var, rows.var(0, correction=0), rtol=1e-12, atol=1e-12)


def test_a_kind_with_several_calls_counts_every_tensor_pair_of_training_forwards_only() -> None:
    """``LayerKind.calls``: every (input, output) pair of a training forward counts, from positional and keyword
    inputs, reduced by the kind's ``moments`` (given the module and the output); a pair without an input tensor
    is skipped and the pairs after it still count; forwards in eval mode or under ``paused()`` count nothing."""
    register_layer_kind(PairKind())
    try:
        torch.manual_seed(0)
        net = nn.ModuleDict({"pair": Pair(3, 2, input_scale=0.5).double()})
        pre = BNPPreconditioner(net, layer_types=["Pair"], statistics="batch")
        seen = spy_moments(pre)
        a, b, c, junk = (torch.randn(n, 3) * 3 + 1 for n in (4, 5, 6, 7))  # float32 inputs of a float64 layer
        pair = net["pair"]
        with pre.paused():
            loss = pair(junk)[0].sum()
        pair.eval()
        loss = loss + pair(junk, other=junk)[0].sum()
        pair.train()
        first, second = pair(a, other=b)
        assert second is not None
        loss = loss + first.sum() + second.square().sum() + pair(c)[0].sum()
        loss.backward()
        pre.step()
        assert_moments_of_rows(seen["pair"], torch.cat([a, b, c]).double() * 0.5)
        # under a token mask: the kind's masked_moments, given the output too
        mask = torch.tensor([True, False, True, True])
        with pre.token_mask(mask):
            pair(a)[0].sum().backward()
        pre.step()
        assert_moments_of_rows(seen["pair"], a[mask].double() * 0.5)
        # a jagged nested input: its real rows, through the kind's moments
        rows = [torch.randn(n, 3) for n in (2, 5)]
        pair(torch.nested.nested_tensor(rows, layout=torch.jagged))[0].values().sum().backward()
        pre.step()
        assert_moments_of_rows(seen["pair"], torch.cat(rows).double() * 0.5)
    finally:
        unregister_layer_kind("Pair")


class WholeOutputKind(PairKind):
    """Pair's weight, with the module's whole output as the one output of its call: ``(first, second)``, whose
    second item is ``None`` without the keyword input."""

    name = "WholeOutput"

    def calls(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> list[Any]:
        return [(args[0], output)]

    def moments(self, module: nn.Module, h: Tensor, output: Any) -> Moments:
        return feature_moments(h.double() * module.input_scale)


def test_a_call_whose_output_is_a_tuple_holding_something_else_than_tensors_is_skipped() -> None:
    """``LayerKind.calls`` pairs an input with a tensor or a tuple of tensors (any one reached counts): a tuple that
    holds ``None`` is no such output, and that call counts nothing (it raised reading a ``grad_fn`` of ``None``)."""
    register_layer_kind(WholeOutputKind())
    try:
        pair = Pair(3, 2, input_scale=0.5).double()
        pre = BNPPreconditioner(nn.ModuleDict({"pair": pair}), layer_types=["WholeOutput"], statistics="batch")
        seen = spy_moments(pre)
        a, b, c = (torch.randn(n, 3, dtype=torch.float64) for n in (4, 5, 6))
        first, second = pair(a, other=b)  # a tuple of tensors: counted
        assert second is not None
        (first.sum() + second.sum() + pair(c)[0].sum()).backward()  # pair(c): (tensor, None), skipped
        pre.step()
        assert_moments_of_rows(seen["pair"], a * 0.5)
    finally:
        unregister_layer_kind("WholeOutput")


# ----------------------------------------------------------------- LayerKind's defaults (issue 27)
def test_the_per_class_flags_say_which_defaults_a_subclass_keeps() -> None:
    def override(method: str) -> type[LayerKind]:
        return type(method, (LayerKind,), {method: lambda self, *a: None})

    plain = type("Plain", (LayerKind,), {})
    assert (plain.same_rows, plain.default_input, plain.default_calls) == (True, True, True)
    assert (override("rows").same_rows, override("bias_rows").same_rows) == (False, False)
    assert (override("rows").default_input, override("rows").default_calls) == (True, True)
    assert (override("input").default_input, override("input").same_rows, override("input").default_calls) == (
        False,
        True,
        True,
    )
    assert (override("calls").default_calls, override("calls").default_input) == (False, True)


def test_the_default_input_is_the_first_argument_else_the_keyword_and_calls_pairs_it_with_the_output() -> None:
    kind, module = LayerKind(), nn.Linear(3, 3)
    x, y, out = torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3)
    assert kind.input(module, (x, y), {}) is x
    assert kind.input(module, (), {"input": x}) is x
    assert kind.input(module, (), {}) is None
    ((h, o),) = kind.calls(module, (x, y), {}, out)
    assert h is x and o is out
    ((h, o),) = kind.calls(module, (), {"input": x}, out)
    assert h is x and o is out

    class Stashed(LayerKind):  # an input read from the module: the default calls passes the module on
        def input(self, module: nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> object:
            return module.stashed

    module.stashed = y
    ((h, o),) = Stashed().calls(module, (x,), {}, out)
    assert h is y and o is out


def test_the_default_weight_is_the_trainable_leaf_of_the_named_parameter() -> None:
    class Gated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(2, 4))
            self.gate = nn.Parameter(torch.randn(3, 4))

    class Double(nn.Module):
        def forward(self, w: Tensor) -> Tensor:
            return 2 * w

    kind = type("GatedKind", (LayerKind,), {"name": "Gated", "module_type": Gated, "weight_name": "gate"})()
    gated = Gated()
    gate = gated.gate
    assert kind.weight(gated) is gate
    torch.nn.utils.parametrize.register_parametrization(gated, "gate", Double())
    assert kind.weight(gated) is gated.parametrizations.gate.original
    assert kind.weight(gated) is gate  # parametrize keeps the parameter as `original`
    pruned = nn.Linear(4, 3)
    torch.nn.utils.prune.l1_unstructured(pruned, "weight", amount=0.5)
    assert LayerKind().weight(pruned) is pruned.weight_orig  # "weight": the leaf under pruning, not weight_orig·mask


def test_the_default_fan_in_is_the_length_of_one_of_the_kinds_rows() -> None:
    class Tail(LayerKind):  # rows read from the module: the last `module.rows` rows of the weight
        def rows(self, module: nn.Module, weight: Tensor) -> Tensor:
            return weight[-module.rows :]

    linear = nn.Linear(5, 3)
    linear.rows = 1  # a single row
    assert Tail().fan_in(linear) == Tail().features(linear) == 5
    assert repr(Tail()) == "Tail(name='')"
    assert repr(type("Mine", (LayerKind,), {"name": "My.kind"})()) == "Mine(name='My.kind')"


def test_a_conv_kind_reduces_per_channel_unless_configured_for_columns() -> None:
    kind = ConvNdKind("Conv2d", nn.Conv2d)
    assert (kind.name, kind.module_types(), kind.columns) == ("Conv2d", (nn.Conv2d,), False)
    conv = nn.Conv2d(2, 3, 3, bias=False).double()
    x = torch.randn(4, 2, 5, 5, dtype=torch.float64)
    channel = kind.moments(conv, x, conv(x))
    torch.testing.assert_close(channel.mean, x.mean((0, 2, 3)))
    assert kind.features(conv) == 2 and kind.fan_in(conv) == 18
    assert kind.configure() is kind and kind.configure(conv_statistics="channel") is kind
    column = kind.configure(conv_statistics="column")
    assert (column.name, column.module_types(), column.columns) == ("Conv2d", (nn.Conv2d,), True)
    assert column.features(conv) == 18 and column.moments(conv, x, conv(x)).mean.shape == (18,)
    assert column.configure(conv_statistics="column") is column
    assert column.configure().columns is False


def test_embedding_kind_statistics_dtype_padding_and_mask_shape() -> None:
    kind = layer_kinds()["Embedding"]
    emb = nn.Embedding(4, 2, padding_idx=0).double()
    tokens = torch.tensor([[0, 1, 1, 3], [2, 0, 1, 1]])
    real = torch.tensor([[True, True, True, False], [True, True, True, True]])
    out = emb(tokens)
    assert kind.moments(emb, tokens, out).mean.dtype == torch.float64  # a float64 model: float64 statistics
    masked = kind.masked_moments(emb, tokens, out, real)
    assert masked.mean.dtype == torch.float64
    # the real tokens: not the padding index 0, not the masked-out 3: 1, 1, 2, 1, 1
    torch.testing.assert_close(masked.mean, torch.tensor([0.0, 0.8, 0.2, 0.0], dtype=torch.float64))
    assert float(masked.rows) == 5
    assert kind.token_rows(emb, (tokens,), {}, tokens, real) is real
    assert kind.token_rows(emb, (tokens,), {}, tokens, real.t()) is None
    assert kind.refuse(emb) is None
    message = kind.refuse(nn.Embedding(4, 2, sparse=True))
    assert message is not None and message.endswith(
        "use sparse=False, or leave the embedding to the optimizer (embeddings=False, or `exclude` it)"
    )


def test_register_layer_kind_errors_name_the_type_and_the_way_out() -> None:
    with pytest.raises(TypeError, match=r"must be an instance of a LayerKind subclass, got 3 \(int\)$"):
        register_layer_kind(3)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError,
        match=r"'Linear' is already registered \(LinearKind\(name='Linear'\)\); pass "
        r"replace=True to replace it$",
    ):
        register_layer_kind(type("Again", (LayerKind,), {"name": "Linear", "module_type": nn.Linear})())


def test_a_bias_of_another_name_is_that_parameter_or_tensor_attribute_else_none() -> None:
    """``bias_name`` other than "bias": the registered parameter (``None`` when registered as ``None``), else a
    tensor the attribute gives (here a property reaching a child's bias); a missing or non-tensor attribute is
    no bias."""

    class Shifted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(2, 3))
            self.inner = nn.Linear(3, 2)
            self.shift = nn.Parameter(torch.randn(2))
            self.register_parameter("unset", None)
            self.scale = 2.0

        @property
        def offset(self) -> Tensor:
            return self.inner.bias

    def kind(bias_name: str) -> LayerKind:
        return type("ShiftedKind", (LayerKind,), {"name": "Shifted", "module_type": Shifted, "bias_name": bias_name})()

    module = Shifted()
    assert kind("shift").bias(module) is module.shift
    assert kind("unset").bias(module) is None
    assert kind("offset").bias(module) is module.inner.bias
    assert kind("scale").bias(module) is None  # a float
    assert kind("forward").bias(module) is None  # a method
    assert kind("missing").bias(module) is None
