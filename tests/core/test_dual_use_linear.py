"""A Linear that its parent calls and also uses through ``F.linear`` (issue 37, item 6): both inputs count, pooled
as one layer called twice, under the layer's own name."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

from lightning_bnp import BNPPreconditioner
from lightning_bnp.core.attention import FunctionalLinearKind


class CallsAndReads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @override
    def forward(self, x: Tensor) -> Tensor:
        y = torch.tanh(self.lin(x))
        return F.linear(y, self.lin.weight, self.lin.bias)


class CallsTwice(CallsAndReads):
    """The same function, with the Linear called twice: a layer BNP has always pooled over both calls."""

    @override
    def forward(self, x: Tensor) -> Tensor:
        return self.lin(torch.tanh(self.lin(x)))


def _steps(block: nn.Module) -> tuple[nn.Module, BNPPreconditioner]:
    torch.manual_seed(0)
    net = nn.Sequential(block, nn.Linear(4, 2))
    net.load_state_dict(_reference_state())
    pre = BNPPreconditioner(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(6, 4, generator=g) * torch.tensor([0.1, 1.0, 3.0, 10.0]) + 2.0
        opt.zero_grad()
        net(x).square().sum().backward()
        pre.step(opt)
        opt.step()
    return net, pre


def _reference_state() -> dict[str, Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(CallsTwice(), nn.Linear(4, 2)).state_dict()


def test_both_inputs_of_a_linear_called_and_used_through_f_linear_count() -> None:
    net, pre = _steps(CallsAndReads())
    ref_net, ref_pre = _steps(CallsTwice())
    assert list(pre.layers) == list(ref_pre.layers) == ["0.lin", "1"]
    for name, layer in ref_pre.layers.items():
        torch.testing.assert_close(pre.layers[name].running.mu, layer.running.mu, rtol=0, atol=0)
        torch.testing.assert_close(pre.layers[name].running.var, layer.running.var, rtol=0, atol=0)
    for p, q in zip(net.parameters(), ref_net.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert isinstance(pre.layers["0.lin"].kind, FunctionalLinearKind)
    assert "0.lin.weight" in pre.coverage.transformed


def test_a_linear_only_called_stays_a_plain_linear() -> None:
    pre = BNPPreconditioner(nn.Sequential(CallsTwice()))
    assert type(pre.layers["0.lin"].kind).__name__ == "LinearKind"


class ReadsForDtype(nn.Module):
    """Reads ``self.lin.weight`` for its dtype only: one input, the Linear's own hook sees it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @override
    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x.to(self.lin.weight.dtype))


class PassesOverLines(CallsAndReads):
    @override
    def forward(self, x: Tensor) -> Tensor:
        y = torch.tanh(self.lin(x))
        return torch.nn.functional.linear(
            y,
            self.lin.weight,
            bias=self.lin.bias,
        )


def test_a_weight_read_for_anything_else_keeps_the_plain_linear() -> None:
    pre = BNPPreconditioner(nn.Sequential(ReadsForDtype()))
    assert type(pre.layers["0.lin"].kind).__name__ == "LinearKind"


def test_an_f_linear_call_over_several_lines_is_read() -> None:
    pre = BNPPreconditioner(nn.Sequential(PassesOverLines()))
    assert isinstance(pre.layers["0.lin"].kind, FunctionalLinearKind)
