"""What sets one layer kind apart is said by the kind (issue 34): the weight it watches, what an entry of its
statistics is, whether saved statistics fit it; and the model is scanned once for kinds and claims."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_bnp.core.attention import FunctionalLinearKind
from lightning_bnp.core.kinds import LayerKind, layer_kinds, select_layer_kinds
from lightning_bnp.core.model_scan import scan_model


def test_a_kind_that_watches_a_weight_captures_and_the_others_do_not() -> None:
    kinds = layer_kinds()
    mha = nn.MultiheadAttention(4, 2)
    out_proj = kinds["MultiheadAttention.out_proj"]
    assert out_proj.captures and out_proj.watched(mha) is mha.out_proj.weight
    for name in ("Linear", "Conv2d", "Embedding", "MultiheadAttention.q"):
        assert not kinds[name].captures and not hasattr(kinds[name], "watched")

    class Watching(LayerKind):
        name = "Watching"

        def watched(self, module: nn.Module) -> Tensor:
            return module.weight  # type: ignore[return-value]

    assert Watching.captures and FunctionalLinearKind.captures and not LayerKind.captures


def test_statistics_unit_and_whether_saved_options_fit() -> None:
    kinds = layer_kinds()
    conv, linear = kinds["Conv2d"], kinds["Linear"]
    column = conv.configure(conv_statistics="column")
    assert linear.statistics_unit(nn.Linear(2, 2)) == "input features"
    assert conv.statistics_unit(nn.Conv2d(2, 2, 3)) == "input channels"
    assert column.statistics_unit(nn.Conv2d(2, 2, 3)) == "columns"
    assert kinds["Embedding"].statistics_unit(nn.Embedding(5, 2)) == "input features"
    assert not conv.statistics_differ(conv_statistics="channel", rho=0.5) and not conv.statistics_differ()
    assert conv.statistics_differ(conv_statistics="column") and column.statistics_differ(conv_statistics="channel")
    assert not linear.statistics_differ(conv_statistics="column")


class Parent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.nn.functional.linear(x, self.proj.weight, self.proj.bias))


def test_one_scan_holds_the_kinds_inferred_from_a_source_and_the_claims() -> None:
    model = nn.Sequential(Parent(), nn.MultiheadAttention(4, 2))
    scan = scan_model(model, ["Linear"])
    assert [k.name for k in scan.kinds["0"]] == ["Parent.proj"]
    assert scan.claimer_names(model[0].proj) == ("0", "0.proj")
    assert scan.claimer_names(model[1].out_proj) == ("1", "1.out_proj")
    assert scan.claimer_names(model[0].head) == ()
    assert set(select_layer_kinds(scan)) == {"0.proj", "0.head", "1.q", "1.k", "1.v", "1.out_proj"}
    assert scan_model(model, ["Conv2d"]).kinds["0"] == []  # sources are read only where Linear is selected
