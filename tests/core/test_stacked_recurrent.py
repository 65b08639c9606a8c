"""Issue 44: :func:`split_recurrent` writes a multi-layer ``nn.RNN``/``nn.LSTM``/``nn.GRU`` as one-layer modules
sharing its parameters — the same outputs and final states (to round-off, float64), the same parameters in the same
order, the same state dict keys both ways — and BNP then preconditions every layer exactly (the reference of
``test_recurrent``: layer 1's x_t is layer 0's output)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from lightning_bnp.core import BNPPreconditioner
from lightning_bnp.core.stacked_recurrent import StackedRecurrent, split_recurrent
from tests.core.test_recurrent import F64, check_pair, expect_pair, previous_rows, random_loss

CASES = [
    (nn.LSTM, {"bidirectional": True}),
    (nn.LSTM, {"proj_size": 3, "batch_first": True}),
    (nn.GRU, {"batch_first": True, "bidirectional": True}),
    (nn.RNN, {"nonlinearity": "relu"}),
]


def _pair(cls: type[nn.Module], options: dict[str, Any]) -> tuple[nn.Module, StackedRecurrent]:
    torch.manual_seed(0)
    fused = cls(3, 4, num_layers=3, **options).double()
    return fused, StackedRecurrent(fused)


def _close(a: Any, b: Any) -> None:
    if isinstance(a, Tensor):
        torch.testing.assert_close(a, b, **F64)
    else:
        for x, y in zip(a, b, strict=True):
            _close(x, y)


@pytest.mark.parametrize(("cls", "options"), CASES)
@pytest.mark.parametrize("given", [False, True])
def test_the_split_computes_what_the_fused_module_computes(
    cls: type[nn.Module], options: dict[str, Any], given: bool
) -> None:
    fused, split = _pair(cls, options)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 3, generator=g, dtype=torch.float64)  # (B, T, F) read as (T, B, F) when not batch-first
    directions, width = (2 if fused.bidirectional else 1), (fused.proj_size or 4)
    hx: Any = None
    if given:
        h0 = torch.randn(3 * directions, 2 if fused.batch_first else 5, width, generator=g, dtype=torch.float64)
        hx = (
            (h0, torch.randn(3 * directions, h0.shape[1], 4, generator=g, dtype=torch.float64))
            if cls is nn.LSTM
            else h0
        )
    _close(split(x, hx), fused(x, hx))
    assert [id(p) for p in split.parameters()] == [id(p) for p in fused.parameters()]


def test_a_packed_batch_runs_through_the_split_as_through_the_fused_module() -> None:
    fused, split = _pair(nn.GRU, {"bidirectional": True})
    x = torch.randn(5, 3, 3, dtype=torch.float64)
    packed = pack_padded_sequence(x, torch.tensor([5, 2, 4]), enforce_sorted=False)
    (out_split, h_split), (out_fused, h_fused) = split(packed), fused(packed)
    _close(pad_packed_sequence(out_split)[0], pad_packed_sequence(out_fused)[0])
    _close(h_split, h_fused)


@pytest.mark.parametrize(("cls", "options"), CASES)
def test_the_state_dict_keeps_the_fused_modules_keys_both_ways(cls: type[nn.Module], options: dict[str, Any]) -> None:
    fused, split = _pair(cls, options)
    model = nn.Sequential(nn.Linear(3, 3).double(), split)
    before = nn.Sequential(copy.deepcopy(model[0]), copy.deepcopy(fused))
    assert list(model.state_dict()) == list(before.state_dict())
    for (key, value), other in zip(model.state_dict().items(), before.state_dict().values()):
        assert torch.equal(value, other), key
    fresh = split_recurrent(nn.Sequential(nn.Linear(3, 3), cls(3, 4, num_layers=3, **options).double()))
    fresh.load_state_dict(before.state_dict())  # strict: a checkpoint from before the split
    for p, q in zip(fresh.parameters(), before.parameters()):
        assert torch.equal(p, q)
    before.load_state_dict(model.state_dict())  # and back


def test_split_recurrent_replaces_the_multi_layer_modules_of_a_model_in_place() -> None:
    model = nn.ModuleDict({"deep": nn.LSTM(3, 4, num_layers=2), "one": nn.GRU(3, 4), "head": nn.Linear(4, 2)})
    weight = model["deep"].weight_ih_l1
    assert split_recurrent(model) is model
    assert isinstance(model["deep"], StackedRecurrent) and isinstance(model["one"], nn.GRU)
    assert model["deep"].layers[1].weight_ih_l0 is weight
    assert isinstance(split_recurrent(nn.RNN(3, 4, num_layers=2)), StackedRecurrent)
    with pytest.raises(TypeError, match=r"`module` must be an nn\.RNN, nn\.LSTM or nn\.GRU, got Linear"):
        StackedRecurrent(nn.Linear(3, 4))  # type: ignore[arg-type]


def test_bnp_preconditions_every_layer_of_the_split_exactly() -> None:
    torch.manual_seed(0)
    model = split_recurrent(nn.LSTM(3, 4, num_layers=2, bidirectional=True).double())
    pre = BNPPreconditioner(model, statistics="batch")
    assert not pre.skipped and len(pre.layers) == 8
    x = torch.randn(3, 2, 3, dtype=torch.float64)
    with torch.no_grad():
        first = model.layers[0](x)[0]  # layer 1's input
        second = model.layers[1](first)[0]
    random_loss(model(x)).backward()
    raw = {f"{i}{n}": p.grad.clone() for i, layer in enumerate(model.layers) for n, p in layer.named_parameters()}
    pre.step()
    for index, (inputs, outputs) in enumerate(((x, first), (first, second))):
        layer = model.layers[index]
        own = {n[1:]: g for n, g in raw.items() if n.startswith(str(index))}
        for d in range(2):
            tail = "_l0" + ("_reverse" if d else "")
            z = previous_rows(
                inputs.transpose(0, 1),
                torch.zeros(2, 4, dtype=torch.float64),
                outputs.transpose(0, 1)[..., 4 * d : 4 * d + 4],
                [3, 3],
                reverse=bool(d),
            )
            check_pair(layer, expect_pair(own, z, tail, "batch"), tail, **F64)
    pre.detach()
