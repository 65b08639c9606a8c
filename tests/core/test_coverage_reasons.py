"""``pre.skipped`` / ``pre.report()`` (core/coverage.py): every weight matrix BNP leaves alone is named with the
reason a user can act on, one model holding each kind of reason (issue 27: the reasons were not pinned)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize

from lightning_bnp import BNPPreconditioner, LayerKind, register_layer_kind
from lightning_bnp.core import BNPWarning
from lightning_bnp.core.conditioning import Equilibration
from lightning_bnp.core.kinds import unregister_layer_kind
from tests.helpers import Affine

FOLLOWS_NOT = "; the optimizer updates those tensors, whose gradient is Jᵀ·∂L/∂weight, for which BNP's transform "
FOLLOWS_NOT += "(eq. 15) has no exact form"


class Table(nn.Module):
    """Not a layer kind: two 2-D parameters whose names say what they are."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_matrix = nn.Parameter(torch.zeros(3, 4))
        self.pos = nn.Parameter(torch.zeros(3, 4))


class Mixed(nn.Linear):
    """A Linear (a registered kind) with one more 2-D parameter that no kind feeds."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self.mixing = nn.Parameter(torch.zeros(4, 4))


def test_each_weight_matrix_left_alone_is_named_with_its_reason() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reparametrized layers are also named in a warning
        model = nn.Sequential(
            parametrizations.weight_norm(nn.Linear(4, 4)),
            torch.nn.utils.weight_norm(nn.Linear(4, 4)),  # the legacy hook
            nn.EmbeddingBag(5, 4),
            Table(),
            Mixed(),
            nn.Linear(4, 4),
            nn.Linear(4, 4),
        )
        pre = BNPPreconditioner(model, include=["0", "1", "4", "5"])
    norm = (
        "left alone: its weight is computed by torch.nn.utils.parametrize (_WeightNorm) from "
        f"parametrizations.weight.original0, parametrizations.weight.original1{FOLLOWS_NOT}"
    )
    legacy = (
        "left alone: its weight is computed by torch.nn.utils.weight_norm (legacy hook: weight = g·v/‖v‖ from "
        f"weight_g and weight_v){FOLLOWS_NOT}"
    )
    assert pre.coverage.transformed == ("4.weight", "5.weight")
    assert pre.skipped == {
        "0.parametrizations.weight.original0": norm,
        "0.parametrizations.weight.original1": norm,  # g, (out, 1): a weight matrix too
        "1.weight_g": legacy,
        "1.weight_v": legacy,
        "2.weight": "embedding (EmbeddingBag: not a layer kind BNP manages)",
        "3.embed_matrix": "embedding / positional parameter 'embed_matrix' of Table",
        "3.pos": "embedding / positional parameter 'pos' of Table",
        "4.mixing": "a parameter of its Mixed layer that no layer kind feeds",
        "6.weight": "not matched by `include` ['0', '1', '4', '5']",
    }
    assert pre.coverage.trainable == 11
    # the first five by default, then a count
    summary = pre.coverage.summary()
    assert summary.startswith("BNP transforms 2 of the model's 11 trainable weight matrices; it leaves alone ")
    assert summary.count("(left alone") == 4 and "2.weight (embedding (EmbeddingBag" in summary
    assert "3.embed_matrix" not in summary and summary.endswith("; and 4 more")
    pre.detach()


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"exclude": "0"}, "excluded by `exclude` pattern '0'"),
        ({"include": "1"}, "not matched by `include` ['1']"),
    ],
)
def test_an_equilibrated_layer_left_out_by_name_is_named_for_that_not_as_reparametrized(
    options: dict[str, str], reason: str
) -> None:
    """BNP follows Equilibration (README "Weight Conditioning"): an equilibrated Linear that ``include`` /
    ``exclude`` leaves out is skipped for that reason, under its leaf's name; one of a type left out of
    ``layer_types`` for that (not "reparametrized … in a form BNP does not follow", as before)."""
    linear = nn.Linear(4, 4)
    parametrize.register_parametrization(linear, "weight", Equilibration())
    pre = BNPPreconditioner(nn.Sequential(linear, nn.Linear(4, 4)), **options)  # type: ignore[arg-type]
    assert pre.skipped == {"0.parametrizations.weight.original": reason}
    pre.detach()
    pre = BNPPreconditioner(nn.Sequential(linear, nn.Conv2d(2, 2, 1)), layer_types=["Conv2d"])
    assert pre.skipped == {"0.parametrizations.weight.original": "layer type 'Linear' is not in `layer_types`"}
    pre.detach()
    managed = BNPPreconditioner(nn.Sequential(linear, nn.Linear(4, 4)))
    assert managed.coverage.transformed == ("0.parametrizations.weight.original", "1.weight")
    managed.detach()


class Double(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x


def test_a_parametrized_module_of_an_unknown_type_is_named_by_its_own_class() -> None:
    """torch swaps a parametrized module's class for ``Parametrized<Name>``: the reason names the user's class."""
    affine = Affine()
    parametrize.register_parametrization(affine, "matrix", Double())
    pre = BNPPreconditioner(nn.Sequential(affine, nn.Linear(4, 4)))
    expected = "unknown layer type tests.helpers.Affine (teach BNP with register_layer_kind)"
    assert pre.skipped == {"0.parametrizations.matrix.original": expected}
    pre.detach()


def test_a_parametrized_positional_parameter_is_named_by_its_own_name() -> None:
    """``<module>.parametrizations.pos.original``: the reason reads the parameter's name (``pos``), not the
    parametrization's path, and calls it a positional parameter, as it does the plain one."""
    table = Table()
    parametrize.register_parametrization(table, "pos", Double())
    pre = BNPPreconditioner(nn.Sequential(table, nn.Linear(4, 4)))
    assert pre.skipped == {
        "0.embed_matrix": "embedding / positional parameter 'embed_matrix' of Table",
        "0.parametrizations.pos.original": "embedding / positional parameter 'pos' of Table",
    }
    pre.detach()


class FunctionalParent(nn.Module):
    """A parent no kind names that uses its Linear only through its weight (BNP reads that from the source)."""

    def __init__(self, proj: nn.Linear) -> None:
        super().__init__()
        self.proj = proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.proj.weight, self.proj.bias)


def test_a_linear_a_dropped_parent_feeds_in_its_place_is_named_for_the_parents_pattern() -> None:
    """A Linear that is also an attention's ``out_proj`` (or that a parent uses through ``F.linear``) is fed by
    the parent's layer; where it is reached first under its own name (``a``), and ``exclude``/``include`` drop
    the parent's layer, the reason names the pattern, not "reparametrized … in a form BNP does not follow" (as
    before: issue 27, found with the survivors of ``_reason``)."""
    lin = nn.Linear(8, 8)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    mha.out_proj = lin  # type: ignore[assignment]
    model = nn.ModuleDict({"a": lin, "attn": mha, "b": nn.Linear(8, 8)})
    cases = [
        ({"exclude": ["attn"]}, "excluded by `exclude` pattern 'attn'"),
        ({"exclude": ["attn.out_proj"]}, "excluded by `exclude` pattern 'attn.out_proj'"),
        ({"include": ["b"]}, "not matched by `include` ['b']"),
        ({"include": ["?"]}, "not matched by `include` ['?']"),  # `a`, `b`: a is selected under attn's names only
    ]
    for options, reason in cases:
        pre = BNPPreconditioner(model, **options)  # type: ignore[arg-type]
        assert pre.skipped["a.weight"] == reason, options
        pre.detach()
    shared = nn.Linear(4, 4)
    pre = BNPPreconditioner(
        nn.ModuleDict({"a": shared, "p": FunctionalParent(shared), "b": nn.Linear(4, 4)}), exclude="p"
    )
    assert pre.skipped == {"a.weight": "excluded by `exclude` pattern 'p'"}
    pre.detach()


def test_frozen_weights_left_alone_are_named_frozen_after_the_trainable_ones_and_not_counted() -> None:
    """A packed weight with a dropped row block and an excluded Linear, each trainable and frozen: the frozen
    ones' reasons start with "frozen; ", they come after the trainable ones and are not counted among the
    trainable matrices (2 transformed out_proj + the trainable in_proj_weight and head = 4); the weights after a
    packed one are still sorted (its out_proj is transformed)."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn, self.still = nn.MultiheadAttention(4, 2), nn.MultiheadAttention(4, 2)
            self.head, self.fixed = nn.Linear(4, 3), nn.Linear(3, 3)

    model = Model()
    model.still.in_proj_weight.requires_grad_(False)
    model.fixed.requires_grad_(False)
    pre = BNPPreconditioner(model, exclude=["attn.k", "still.v", "fixed", "head"])
    dropped = "of it dropped by `include`/`exclude`; the others are transformed"
    assert pre.coverage.transformed == ("attn.out_proj.weight", "still.out_proj.weight")
    assert list(pre.coverage.skipped.items()) == [
        ("attn.in_proj_weight", f"row blocks ['attn.k'] {dropped}"),
        ("head.weight", "excluded by `exclude` pattern 'head'"),
        ("still.in_proj_weight", f"frozen; row blocks ['still.v'] {dropped}"),
        ("fixed.weight", "frozen; excluded by `exclude` pattern 'fixed'"),
    ]
    assert pre.coverage.trainable == 4


class Tagger(nn.Module):
    """A sequence tagger of the recurrent kinds BNP knows (issue 44): an embedding, a bidirectional LSTM encoder, a
    two-layer GRU, an LSTM with a projection, a GRU cell unrolled by hand, and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.encoder = nn.LSTM(8, 16, bidirectional=True, batch_first=True)
        self.deep = nn.GRU(32, 16, num_layers=2, batch_first=True)
        self.projected = nn.LSTM(16, 16, proj_size=8, batch_first=True)
        self.decoder = nn.GRUCell(8, 8)
        self.head = nn.Linear(8, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        states = self.projected(self.deep(self.encoder(self.embed(tokens))[0])[0])[0]
        h = None
        outputs = []
        for t in range(states.shape[1]):
            h = self.decoder(states[:, t], h)
            outputs.append(self.head(h))
        return torch.stack(outputs, 1)


def test_a_recurrent_model_has_every_weight_matrix_transformed_or_named_with_its_reason() -> None:
    model = Tagger()
    pre = BNPPreconditioner(model)
    matrices = {name for name, p in model.named_parameters() if p.dim() >= 2}
    assert set(pre.coverage.transformed) | set(pre.skipped) == matrices
    assert set(pre.coverage.transformed) == {
        *(f"encoder.weight_{b}_l0{d}" for b in ("ih", "hh") for d in ("", "_reverse")),
        "projected.weight_ih_l0",
        "projected.weight_hh_l0",
        "decoder.weight_ih",
        "decoder.weight_hh",
        "head.weight",
    }
    deep = "GRU with num_layers=2: the inputs of its layers ≥ 1 and every layer's h_(t−1) stay inside the fused"
    assert pre.skipped["embed.weight"] == "embedding (embeddings=False)"
    assert all(pre.skipped[f"deep.weight_{b}_l{i}"].startswith(deep) for b in ("ih", "hh") for i in (0, 1))
    assert pre.skipped["projected.weight_hr_l0"].startswith("the projection of an LSTM with proj_size")
    assert len(pre.skipped) == 6 and pre.coverage.trainable == 15
    with warnings.catch_warnings():
        warnings.simplefilter("error", BNPWarning)  # every managed layer ran and got its statistics
        model(torch.randint(0, 50, (2, 4))).square().sum().backward()
        pre.step()
    assert all(layer.transform is not None for layer in pre.layers.values())
    pre.detach()


class Mix(nn.Module):
    """A parametrization with a weight matrix of its own: ``x @ mixing``."""

    def __init__(self) -> None:
        super().__init__()
        self.mixing = nn.Parameter(torch.eye(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.mixing


def test_a_parametrizations_own_parameters_are_named_for_the_tensor_they_shape() -> None:
    """``0.parametrizations.pos.0.mixing`` shapes ``pos``: named for it (not ``'pos.0'``), also when the
    parametrization's own matrix is parametrized in turn (``….pos.0.parametrizations.mixing.original``: the
    outermost parametrized module owns it, not the parametrization module, which is no layer type to teach BNP)."""
    table, mix = Table(), Mix()
    parametrize.register_parametrization(table, "pos", mix)
    positional = "embedding / positional parameter 'pos' of Table"
    pre = BNPPreconditioner(nn.Sequential(table, nn.Linear(4, 4)))
    assert pre.skipped == {
        "0.embed_matrix": "embedding / positional parameter 'embed_matrix' of Table",
        "0.parametrizations.pos.original": positional,
        "0.parametrizations.pos.0.mixing": positional,
    }
    pre.detach()
    parametrize.register_parametrization(mix, "mixing", Double())
    pre = BNPPreconditioner(nn.Sequential(table, nn.Linear(4, 4)))
    assert pre.skipped["0.parametrizations.pos.0.parametrizations.mixing.original"] == positional
    assert len(pre.skipped) == 3
    pre.detach()


def test_a_module_merely_named_parametrizations_is_not_read_as_a_parametrization() -> None:
    """A container named ``parametrizations`` above an orthogonal Linear: the Linear's reason (as without the
    container's name), where the root container was called an unknown layer type."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BNPWarning)  # the reparametrized layer is also named in a warning
        orthogonal = parametrizations.orthogonal(nn.Linear(4, 4))
        model = nn.ModuleDict({"parametrizations": nn.ModuleDict({"x": orthogonal}), "b": nn.Linear(4, 4)})
        pre = BNPPreconditioner(model)
    reason = (
        "left alone: its weight is computed by torch.nn.utils.parametrize (_Orthogonal) from "
        f"parametrizations.weight.original{FOLLOWS_NOT}"
    )
    assert pre.skipped == {"parametrizations.x.parametrizations.weight.original": reason}
    pre.detach()


class Adapted(nn.Linear):
    """A Linear holding an adapter Linear of its own (a hand-written LoRA-style layer)."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self.adapter = nn.Linear(4, 4)


def test_a_parametrized_root_module_is_named_for_its_parametrization() -> None:
    """The model itself parametrized (its parameter ``parametrizations.weight.original``, the marker at the start of
    the name): named for its parametrization, as one further down is."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BNPWarning)  # the reparametrized layer is also named in a warning
        model = parametrizations.orthogonal(Adapted())
        pre = BNPPreconditioner(model)
    assert list(pre.layers) == ["adapter"]
    assert pre.skipped == {
        "parametrizations.weight.original": (
            "left alone: its weight is computed by torch.nn.utils.parametrize (_Orthogonal) from "
            f"parametrizations.weight.original{FOLLOWS_NOT}"
        )
    }
    pre.detach()


def test_a_linear_inside_an_included_linear_is_named_for_the_include_it_does_not_match() -> None:
    """``include`` matches a layer by its own name (``a``), not its parent's: ``a.adapter`` is left out by the
    pattern, which the reason names (it said "reparametrized … in a form BNP does not follow": the parent's name
    was taken for one of the adapter's)."""
    pre = BNPPreconditioner(nn.ModuleDict({"a": Adapted(), "b": nn.Linear(4, 4)}), include=["a"])
    assert list(pre.layers) == ["a"]
    assert pre.skipped == {
        "a.adapter.weight": "not matched by `include` ['a']",
        "b.weight": "not matched by `include` ['a']",
    }
    pre.detach()
    nested = nn.ModuleDict({"x": nn.ModuleDict({"a": Adapted()}), "b": nn.Linear(4, 4)})
    pre = BNPPreconditioner(nested, include=["x.a"])
    assert pre.skipped["x.a.adapter.weight"] == "not matched by `include` ['x.a']"
    pre.detach()


def test_a_packed_weight_is_judged_by_the_kinds_that_feed_it() -> None:
    """An attention's ``in_proj_weight`` is fed by its q, k, v kinds alone (a GRU's ``weight_hh_l0`` by its hh
    kinds), under their layer names where ``layer_types`` selects them: left out of ``layer_types``, or by an
    ``include`` that matches only ``attn.out_proj`` or the name of an unselected kind's layer, it is named for that
    (it was "reparametrized … in a form BNP does not follow", or excluded by the out_proj's pattern)."""
    attention = nn.ModuleDict({"attn": nn.MultiheadAttention(4, 2), "b": nn.Linear(4, 4)})
    pre = BNPPreconditioner(attention, layer_types=["MultiheadAttention.out_proj"])
    assert list(pre.layers) == ["attn.out_proj"]
    assert pre.skipped == {
        "attn.in_proj_weight": "layer type 'MultiheadAttention.q' is not in `layer_types`",
        "b.weight": "layer type 'Linear' is not in `layer_types`",
    }
    pre.detach()
    pre = BNPPreconditioner(attention, include=["attn.out_proj", "b"])
    assert pre.skipped == {"attn.in_proj_weight": "not matched by `include` ['attn.out_proj', 'b']"}
    pre.detach()
    with_conv = nn.ModuleDict({"attn": nn.MultiheadAttention(4, 2), "kconv": nn.Conv1d(4, 4, 1)})
    pre = BNPPreconditioner(with_conv, layer_types=["MultiheadAttention.q", "Conv1d"], include=["*k*"])
    assert list(pre.layers) == ["kconv"]  # `*k*` matches attn.k, whose kind is not selected: not attn.q
    assert pre.skipped == {
        "attn.in_proj_weight": "not matched by `include` ['*k*']",
        "attn.out_proj.weight": "layer type 'Linear' is not in `layer_types`",
    }
    pre.detach()
    pre = BNPPreconditioner(with_conv, layer_types=["MultiheadAttention.out_proj", "Conv1d"], exclude=["attn.out_proj"])
    assert pre.skipped == {  # out_proj: fed by the attention's selected kind in its place, which `exclude` drops
        "attn.in_proj_weight": "layer type 'MultiheadAttention.q' is not in `layer_types`",
        "attn.out_proj.weight": "excluded by `exclude` pattern 'attn.out_proj'",
    }
    pre.detach()
    recurrent = nn.ModuleDict({"rnn": nn.GRU(4, 3), "b": nn.Linear(4, 4)})
    pre = BNPPreconditioner(recurrent, layer_types=["GRU.ih_l0.n", "GRU.ih_l0.rz"])
    assert pre.skipped == {
        "rnn.weight_hh_l0": "layer type 'GRU.hh_l0.rz' is not in `layer_types`",
        "b.weight": "layer type 'Linear' is not in `layer_types`",
    }
    pre.detach()


def test_row_blocks_of_a_packed_weight_left_out_of_layer_types_are_named_for_that() -> None:
    """``attn.v`` whose kind ``layer_types`` leaves out is not "dropped by `include`/`exclude`" (as it was said);
    ``attn.k``, excluded by name, is."""
    model = nn.ModuleDict({"attn": nn.MultiheadAttention(4, 2), "b": nn.Linear(4, 4)})
    kinds = ["MultiheadAttention.q", "MultiheadAttention.k", "MultiheadAttention.out_proj"]
    pre = BNPPreconditioner(model, layer_types=kinds, exclude=["attn.k"])
    assert list(pre.layers) == ["attn.q", "attn.out_proj"]
    assert pre.skipped["attn.in_proj_weight"] == (
        "row blocks ['attn.v'] of it not in `layer_types`; row blocks ['attn.k'] of it dropped by "
        "`include`/`exclude`; the others are transformed"
    )
    pre.detach()


def test_row_blocks_only_left_out_of_layer_types_are_not_said_dropped_by_a_pattern() -> None:
    """Without ``include``/``exclude``, the reason names ``layer_types`` alone (and row blocks dropped by patterns
    only, the patterns alone: ``test_frozen_weights_left_alone_are_named_frozen_after_the_trainable_ones_…``)."""
    model = nn.ModuleDict({"attn": nn.MultiheadAttention(4, 2), "b": nn.Linear(4, 4)})
    pre = BNPPreconditioner(model, layer_types=["MultiheadAttention.q", "MultiheadAttention.out_proj"])
    assert pre.skipped["attn.in_proj_weight"] == (
        "row blocks ['attn.k', 'attn.v'] of it not in `layer_types`; the others are transformed"
    )
    pre.detach()


def test_an_attention_whose_q_k_and_v_are_all_excluded_names_the_first_pattern() -> None:
    """``exclude`` matches ``attn.q``, the layer's name (module name plus the kind's suffix)."""
    model = nn.ModuleDict({"attn": nn.MultiheadAttention(4, 2), "b": nn.Linear(4, 4)})
    pre = BNPPreconditioner(model, exclude=["attn.k", "attn.q", "attn.v"])
    assert list(pre.layers) == ["attn.out_proj", "b"]
    assert pre.skipped == {"attn.in_proj_weight": "excluded by `exclude` pattern 'attn.k'"}
    pre.detach()


class Shapes(nn.Module):
    """Parameters of an unknown type with few dimensions above 1."""

    def __init__(self) -> None:
        super().__init__()
        self.row = nn.Parameter(torch.zeros(1, 4))  # 2-D: a weight matrix, whatever its sizes
        self.slab = nn.Parameter(torch.zeros(4, 2, 1))  # two dimensions above 1 (one above 2): a matrix
        self.scale = nn.Parameter(torch.ones(4, 1, 1))  # ≥ 3 dimensions, one above 1: elementwise
        self.shift = nn.Parameter(torch.zeros(1, 1, 4))  # another: neither counted


def test_only_a_parameter_of_three_or_more_dimensions_with_one_above_1_is_an_elementwise_scale() -> None:
    pre = BNPPreconditioner(nn.Sequential(Shapes(), nn.Linear(4, 4)))
    unknown = "unknown layer type tests.core.test_coverage_reasons.Shapes (teach BNP with register_layer_kind)"
    assert pre.skipped == {
        "0.row": unknown,
        "0.slab": unknown,
        "0.scale": (
            "elementwise scale or shift of Shapes, shape (4, 1, 1): not a layer's weight matrix (one dimension "
            "above 1), left to the optimizer"
        ),
        "0.shift": (
            "elementwise scale or shift of Shapes, shape (1, 1, 4): not a layer's weight matrix (one dimension "
            "above 1), left to the optimizer"
        ),
    }
    assert pre.coverage.trainable == 3  # 1.weight, 0.row, 0.slab
    pre.detach()


class Gated(nn.Linear):
    """A Linear with a gate matrix that its kind does not feed."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self.gate = nn.Parameter(torch.zeros(4, 4))


class GatedKind(LayerKind):
    name = "Gated"
    module_type = Gated

    def left_alone(self, module: nn.Module, attribute: str) -> str | None:
        return f"the gate {attribute!r} of a Gated layer is left to the optimizer"


def test_a_kinds_left_alone_reason_is_asked_only_for_a_parameter_no_kind_feeds() -> None:
    """``LayerKind.left_alone`` explains a parameter no kind feeds: the weight it feeds, excluded, is named for the
    pattern."""
    register_layer_kind(GatedKind())
    try:
        model = nn.ModuleDict({"g": Gated(), "h": Gated()})
        pre = BNPPreconditioner(model, layer_types=["Gated"], exclude=["h"])
        assert list(pre.layers) == ["g"]
        assert pre.skipped == {
            "g.gate": "the gate 'gate' of a Gated layer is left to the optimizer",
            "h.weight": "excluded by `exclude` pattern 'h'",
            "h.gate": "the gate 'gate' of a Gated layer is left to the optimizer",
        }
        pre.detach()
    finally:
        unregister_layer_kind("Gated")


def test_a_managed_layer_frozen_for_now_is_named_as_transformed_once_it_trains() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[0].weight.requires_grad_(False)
    pre = BNPPreconditioner(model)
    assert list(pre.layers) == ["0", "1"]  # managed all the same: unfreezing later works
    assert pre.coverage.transformed == ("1.weight",)
    assert pre.skipped == {"0.weight": "frozen (requires_grad=False); transformed once it trains"}
    assert pre.coverage.trainable == 1
    pre.detach()
