"""The entries of a step's transform (issue 27 survivors of ``_transform`` and ``_row_block_spans``): a Linear, a
cross-attention whose q, k, v blocks have different q² and a self-attention whose blocks share one. On the host
(q² floats) the cross-attention's blocks are three entries and the self-attention's one grouped entry; with the
step function of ``compile_step`` (q² tensors, so every run of blocks is one entry, each block with its own q²)
the function gets the same gradients. Both equal BNP on the model written with plain Linears. ``torch.compile``
itself is replaced by a recorder here (the selection of tests that mutation testing runs has no compilation):
what is pinned is what the function is given and that its result is the step's."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_bnp.core import BNPPreconditioner
from lightning_bnp.core.statistics import Moments
from lightning_bnp.core.step_plan import row_block_runs, row_block_spans

E, HEADS, LENGTH, SOURCE = 8, 2, 2, 5


class LinearAttention(nn.Module):
    """Multi-head attention from four Linears (batch-first), the reference for ``nn.MultiheadAttention``."""

    def __init__(self, mha: nn.MultiheadAttention) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(E, E) for _ in range(4))
        with torch.no_grad():
            for i, lin in enumerate((self.q, self.k, self.v)):
                lin.weight.copy_(mha.in_proj_weight[i * E : (i + 1) * E])
                lin.bias.copy_(mha.in_proj_bias[i * E : (i + 1) * E])
            self.o.weight.copy_(mha.out_proj.weight)
            self.o.bias.copy_(mha.out_proj.bias)

    def forward(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        b, length, _ = query.shape

        def heads(t: Tensor) -> Tensor:
            return t.view(b, -1, HEADS, E // HEADS).transpose(1, 2)

        q, k, v = heads(self.q(query)), heads(self.k(key)), heads(self.v(value))
        scores = q @ k.transpose(-1, -2) / math.sqrt(E // HEADS)
        return self.o((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, length, E))


class Decoder(nn.Module):
    """A Linear, a cross-attention (queries: 2 rows, memory: 5) and a self-attention (2 rows)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(E, E)
        self.cross = nn.MultiheadAttention(E, HEADS, batch_first=True)
        self.selfattn = nn.MultiheadAttention(E, HEADS, batch_first=True)

    def forward(self, query: Tensor, memory: Tensor) -> Tensor:
        h = self.cross(self.lin(query), memory, memory, need_weights=False)[0]
        return self.selfattn(h, h, h, need_weights=False)[0]


class LinearDecoder(nn.Module):
    def __init__(self, decoder: Decoder) -> None:
        super().__init__()
        self.lin = copy.deepcopy(decoder.lin)
        self.cross, self.selfattn = LinearAttention(decoder.cross), LinearAttention(decoder.selfattn)

    def forward(self, query: Tensor, memory: Tensor) -> Tensor:
        h = self.cross(self.lin(query), memory, memory)
        return self.selfattn(h, h, h)


class Recorder:
    """Stands in for ``torch.compile``: returns the function itself, recording the arguments of every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __call__(self, fn: Any, **options: Any) -> Any:
        assert options == {"fullgraph": True}

        def run(*args: Any) -> Any:
            self.calls.append(args)
            return fn(*args)

        return run


def _pairs(model: Decoder, twin: LinearDecoder) -> list[tuple[Tensor, Tensor]]:
    """(gradient of the attention model's part, the plain-Linear twin's), block by block."""
    assert twin.lin.weight.grad is not None and model.lin.weight.grad is not None
    pairs = [(model.lin.weight.grad, twin.lin.weight.grad), (model.lin.bias.grad, twin.lin.bias.grad)]
    for mha, lin in ((model.cross, twin.cross), (model.selfattn, twin.selfattn)):
        assert mha.in_proj_weight.grad is not None and mha.in_proj_bias.grad is not None
        for i, block in enumerate((lin.q, lin.k, lin.v)):
            rows = slice(i * E, (i + 1) * E)
            pairs.append((mha.in_proj_weight.grad[rows], block.weight.grad))
            pairs.append((mha.in_proj_bias.grad[rows], block.bias.grad))
        pairs += [(mha.out_proj.weight.grad, lin.o.weight.grad), (mha.out_proj.bias.grad, lin.o.bias.grad)]
    return pairs  # type: ignore[return-value]


def _steps(model: nn.Module, pre: BNPPreconditioner, inputs: list[tuple[Tensor, Tensor, Tensor]]) -> None:
    for query, memory, target in inputs:
        model.zero_grad()
        F.mse_loss(model(query, memory), target).backward()
        pre.step()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.1 * p.grad)  # type: ignore[operator]


def _inputs(steps: int) -> list[tuple[Tensor, Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(1, LENGTH, E, generator=g, dtype=torch.float64) * 2 + 0.5,
            torch.randn(1, SOURCE, E, generator=g, dtype=torch.float64) * 2 - 0.5,
            torch.randn(1, LENGTH, E, generator=g, dtype=torch.float64),
        )
        for _ in range(steps)
    ]


def _check(model: Decoder, twin: LinearDecoder, pre: BNPPreconditioner) -> None:
    for mine, theirs in _pairs(model, twin):
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12)
    # q² = n_in / N: the cross-attention's q sees 2 rows, its k and v 5; the rest 2
    q2 = {name: float(layer.transform.q2) for name, layer in pre.layers.items()}  # type: ignore[union-attr]
    assert q2 == {
        "lin": E / 2,
        "cross.q": E / 2,
        "cross.k": E / 5,
        "cross.v": E / 5,
        "cross.out_proj": E / 2,
        "selfattn.q": E / 2,
        "selfattn.k": E / 2,
        "selfattn.v": E / 2,
        "selfattn.out_proj": E / 2,
    }


def _spans(pre: BNPPreconditioner) -> list[tuple[int, int]]:
    return [span for plan in pre._step.plans.values() for config in plan.configs.values() for span in config.spans]


def test_blocks_of_differing_q2_after_a_layer_are_entries_of_their_own_beside_a_grouped_run() -> None:
    """Host q²: the cross-attention's q, k, v (q² 4, 1.6, 1.6) follow the Linear and are three entries, each its
    own block of rows; the self-attention's blocks are one entry. Three steps equal BNP on the plain Linears."""
    torch.manual_seed(0)
    model = Decoder().double()
    twin = LinearDecoder(model).double()
    pre, ref = BNPPreconditioner(model, rho=0.5), BNPPreconditioner(twin, rho=0.5)
    assert list(pre.layers) == [
        "lin",
        "cross.q",
        "cross.k",
        "cross.v",
        "cross.out_proj",
        "selfattn.q",
        "selfattn.k",
        "selfattn.v",
        "selfattn.out_proj",
    ]
    for step in _inputs(3):
        _steps(model, pre, [step])
        _steps(twin, ref, [step])
        _check(model, twin, pre)
    assert _spans(pre) == [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (5, 3), (8, 1)]


class Marked(Tensor):
    """A tensor subclass: not a plain gradient tensor."""


def test_a_run_of_row_blocks_is_one_entry_only_for_one_plain_2d_gradient_and_one_host_q2() -> None:
    """``row_block_spans``: the q, k, v blocks of one attention are one entry where their gradient is one plain 2-D
    tensor (and their host q² agree), else each block is an entry of its own: blocks whose gradients are different
    tensors, a gradient that is not 2-D, a tensor subclass (the grouped transform is written for plain tensors;
    each block alone takes its rows as any layer does) or differing q²."""
    blocks = list(BNPPreconditioner(nn.MultiheadAttention(E, HEADS)).layers.values())[:3]
    runs = row_block_runs(blocks)
    assert runs == ((0, 3),)
    empty = Moments.empty(E, torch.device("cpu"))

    def spans(grads: list[Tensor], q2s: list[float] | None = None) -> tuple[tuple[int, int], ...]:
        ready = [(layer, empty, grad) for layer, grad in zip(blocks, grads)]
        return row_block_spans(runs, ready, [None] * 3, q2s)

    grad = torch.randn(3 * E, E)
    grouped, apart = ((0, 3),), ((0, 1), (1, 1), (2, 1))
    assert spans([grad] * 3) == spans([grad] * 3, [2.0] * 3) == grouped
    assert spans([grad, grad.clone(), grad]) == apart
    assert spans([grad.unsqueeze(-1)] * 3) == apart
    assert spans([grad.as_subclass(Marked)] * 3) == apart
    assert spans([grad] * 3, [2.0, 1.0, 2.0]) == spans([grad] * 3, [1.0, 2.0, 2.0]) == apart


def test_the_graph_step_gets_tensor_q2s_with_one_entry_per_run_and_transforms_as_the_eager_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the step function of ``compile_step`` (a recorder in place of ``torch.compile``): it runs every step,
    given one step config built once for the layout, whose entries group every run of row blocks (the
    cross-attention's too, its q² differing: q² are tensors, a (3, 1) one per run, a 0-dim one per other layer);
    the gradients and each layer's q² equal BNP on the plain Linears."""
    recorder = Recorder()
    monkeypatch.setattr(torch, "compile", recorder)
    torch.manual_seed(0)
    model = Decoder().double()
    twin = LinearDecoder(model).double()
    pre, ref = BNPPreconditioner(model, rho=0.5), BNPPreconditioner(twin, rho=0.5)
    assert pre.compile_step() is pre
    for step in _inputs(3):
        _steps(model, pre, [step])
        _steps(twin, ref, [step])
        _check(model, twin, pre)
    assert len(recorder.calls) == 3
    configs = [call[1] for call in recorder.calls]
    assert all(config is configs[0] for config in configs)  # built once for the layout
    assert configs[0].spans == ((0, 1), (1, 3), (4, 1), (5, 3), (8, 1))
    for call in recorder.calls:
        q2s = call[9]
        assert [tuple(q.shape) for q in q2s] == [(), (3, 1), (), (3, 1), ()]
        assert [q.tolist() for q in q2s] == [E / 2, [[E / 2], [E / 5], [E / 5]], E / 2, [[E / 2]] * 3, E / 2]
