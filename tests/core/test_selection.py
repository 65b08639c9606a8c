"""``select_layers`` on its own (BNP and Weight Conditioning check their arguments before calling it; here it
is called directly, as a public helper): its argument errors name the argument and the value. The preconditioner's
own selection (by the kinds of its scanned model) names its ``layer_types`` the same way."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from lightning_bnp import BNPPreconditioner
from lightning_bnp.core.selection import select_layers


@pytest.mark.parametrize("name", ["include", "exclude"])
def test_select_layers_names_the_pattern_argument_it_refuses(name: str) -> None:
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    with pytest.raises(ValueError, match=rf"^`{name}` must be None or a non-empty list of patterns, got \[\]$"):
        select_layers(model, ["Linear"], **{name: []})
    with pytest.raises(TypeError, match=rf"^`{name}` must be a string or a list of strings, got 3$"):
        select_layers(model, ["Linear"], **{name: 3})
    assert list(select_layers(model, "Linear", **{name: "0"})) == (["0"] if name == "include" else ["1"])


def test_select_layers_refuses_no_layer_type_and_names_the_types_a_pattern_did_not_match() -> None:
    """Issue 27 (`make mutate` survivors): an empty ``layer_types`` is refused as such; a pattern that matches no
    layer names the pattern, every selected type (joined by ``/``) and the candidates."""
    model = nn.Sequential(nn.Linear(2, 3), nn.Conv1d(3, 1, 1))
    with pytest.raises(ValueError, match=r"^`layer_types` must name at least one layer type, got \[\]$"):
        select_layers(model, [])
    with pytest.raises(
        ValueError, match=r"^`exclude` pattern 'head\*' matches no Linear/Conv1d layer; candidates are \['0', '1'\]$"
    ):
        select_layers(model, ["Linear", "Conv1d"], exclude=["head*"])


@pytest.mark.parametrize(
    ("model", "options", "message"),
    [
        (
            nn.Sequential(nn.Linear(2, 2)),
            {"include": ["nope"]},
            "`include` pattern 'nope' matches no Linear/Conv1d/Conv2d/Conv3d layer; candidates are ['0']",
        ),
        (
            nn.Sequential(nn.Linear(2, 2)),
            {"exclude": ["0"]},
            "no Linear/Conv1d/Conv2d/Conv3d layer is left for BNP after include=None, exclude=['0']; candidates are "
            "['0']",
        ),
        (
            nn.Sequential(nn.Linear(2, 2), nn.Conv1d(2, 2, 1)),
            {"layer_types": ["Conv1d", "MultiheadAttention.q"], "exclude": ["x"]},
            "`exclude` pattern 'x' matches no Conv1d/MultiheadAttention.q layer; candidates are ['1']",
        ),
    ],
    ids=["include", "nothing-left", "layer-types"],
)
def test_a_preconditioner_names_its_layer_types_when_the_patterns_select_nothing(
    model: nn.Module, options: dict[str, Any], message: str
) -> None:
    """The kinds of the scanned model, named as ``layer_types`` gave them (the default: the four dense types)."""
    with pytest.raises(ValueError) as caught:
        BNPPreconditioner(model, **options)
    assert str(caught.value) == message
