"""Reasons and names: what BNP says about a layer it leaves alone or cannot precondition in a step names the real
cause (a layer type it does not know, an elementwise scale, a detached preconditioner, an empty batch, a forward run
with other tensors than the module's), and a layer of the root module is named without a leading dot."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_bnp import BNPPreconditioner


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
