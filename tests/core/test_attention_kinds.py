"""Issue 27 (mutation survivors of ``core/attention.py``): what the attention kinds read from one forward call —
which argument is the q, k or v input (positional or keyword), which rows a token mask or a
``key_padding_mask`` marks, the kinds' names — and the ``F.linear`` capture: nested captures, every swapped
``torch.nn.functional`` global restored, the cached inversion of a ``key_padding_mask``, and the traceable
``_check_key_padding_mask`` (its compiled branch run in eager with ``torch.compiler.is_compiling`` patched)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_bnp.core import BNPPreconditioner
from lightning_bnp.core.attention import (
    _LAST_KEYS,
    _ORIGINAL_CHECK_KPM,
    _ORIGINAL_LINEAR,
    _ORIGINAL_MHA,
    FunctionalLinearKind,
    MHAOutProjKind,
    MHAProjectionKind,
    _real_keys,
    _traceable_check_key_padding_mask,
    capturing,
    register_functional_linear,
    stop_capturing,
)
from lightning_bnp.core.kinds import layer_kinds, unregister_layer_kind

T, Fa = True, False


def _compiling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)


# ------------------------------------------------------------------ the q, k, v projections
def test_each_mha_projection_reads_its_own_argument_positionally_or_by_keyword() -> None:
    mha = nn.MultiheadAttention(4, 2, batch_first=True)
    q, k, v = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 5, 4)
    out = (torch.randn(2, 3, 4), None)
    for block, (letter, keyword, tensor) in enumerate(zip("qkv", ("query", "key", "value"), (q, k, v))):
        kind = MHAProjectionKind(block)
        assert (kind.name, kind.suffix, kind.block) == (f"MultiheadAttention.{letter}", f".{letter}", block)
        assert kind.input_name == keyword
        assert kind.row_block(mha) == (block, 3)  # a packed in_proj_weight: block i of 3
        assert kind.input(mha, (q, k, v), {}) is tensor
        assert kind.input(mha, (q,), {"key": k, "value": v}) is tensor  # the query positional, the rest by name
        assert kind.input(mha, (), {"query": q, "key": k, "value": v}) is tensor
        # the attention output (the first of MHA's outputs), or the output itself when it is not a tuple
        ((h, o),) = kind.calls(mha, (q,), {"key": k, "value": v}, out)
        assert h is tensor and o is out[0]
        ((h, o),) = kind.calls(mha, (q, k, v), {}, out[0])
        assert h is tensor and o is out[0]
    separate = nn.MultiheadAttention(4, 2, kdim=3, vdim=5)  # three weights: no row blocks of one matrix
    assert [MHAProjectionKind(b).row_block(separate) for b in range(3)] == [None, None, None]
    assert [MHAProjectionKind(b).features(separate) for b in range(3)] == [4, 3, 5]


def test_key_and_value_rows_come_from_the_key_padding_mask_positional_or_by_keyword() -> None:
    mha = nn.MultiheadAttention(4, 2, batch_first=True)
    q, k = torch.randn(2, 3, 4), torch.randn(2, 4, 4)
    kpm = torch.tensor([[Fa, Fa, T, T], [Fa, Fa, Fa, T]])  # True = padding
    real = torch.tensor([[T, T, Fa, Fa], [T, T, T, Fa]])
    everything = torch.ones(2, 4, dtype=torch.bool)  # a token mask that differs from the padding
    for block in (1, 2):
        kind = MHAProjectionKind(block)
        assert torch.equal(kind.token_rows(mha, (q, k, k, kpm), {}, k, everything), real)
        assert torch.equal(kind.token_rows(mha, (q, k, k), {"key_padding_mask": kpm}, k, everything), real)
        assert torch.equal(kind.token_rows(mha, (q, k, k), {}, k, everything), everything)  # no padding mask
        # neither fits the input's rows: None (the preconditioner then names the layer and both shapes)
        assert kind.token_rows(mha, (q, k, k, kpm), {}, torch.randn(2, 5, 4), everything) is None
        assert kind.token_rows(mha, (q, k, k), {}, k, torch.ones(2, 3, dtype=torch.bool)) is None
    # the query's rows are the token mask, whatever key_padding_mask says
    query_mask = torch.tensor([[T, Fa, T], [T, T, Fa]])
    assert torch.equal(MHAProjectionKind(0).token_rows(mha, (q, k, k, kpm), {}, q, query_mask), query_mask)
    assert MHAProjectionKind(0).token_rows(mha, (q, k, k), {}, q, query_mask.t()) is None
    # sequence-first: the key's rows are (S, N), key_padding_mask stays (N, S)
    seq_first = nn.MultiheadAttention(4, 2)
    assert torch.equal(
        MHAProjectionKind(1).token_rows(seq_first, (q, k, k, kpm), {}, k.transpose(0, 1), everything.t()), real.t()
    )


def test_out_proj_rows_are_the_query_mask_in_position_batch_order() -> None:
    kind = MHAOutProjKind(nn.MultiheadAttention, "out_proj", name="MultiheadAttention.out_proj")
    mha = nn.MultiheadAttention(4, 2, batch_first=True)
    q = torch.randn(2, 3, 4)  # (N, L, E)
    mask = torch.tensor([[T, T, Fa], [T, Fa, Fa]])  # (N, L)
    flat = torch.tensor([T, T, T, Fa, Fa, Fa])  # rows of the (L·N, E) attention output: (l, n) order
    h = torch.randn(6, 4)
    assert torch.equal(kind.token_rows(mha, (q, q, q), {}, h, mask), flat)
    assert torch.equal(kind.token_rows(mha, (), {"query": q, "key": q, "value": q}, h, mask), flat)
    assert torch.equal(kind.token_rows(mha, (q, q, q), {}, torch.randn(3, 2, 4), mask), mask.t())  # (L, N, E) rows
    assert kind.token_rows(mha, (q, q, q), {}, h, mask.t()) is None  # (L, N): not the query's (N, L)
    assert kind.token_rows(mha, (q, q, q), {}, torch.randn(5, 4), mask) is None  # not one row per token
    assert kind.token_rows(mha, (), {"key": q}, h, mask) is None  # no query to read the layout from
    seq_first = nn.MultiheadAttention(4, 2)
    assert torch.equal(kind.token_rows(seq_first, (q.transpose(0, 1),), {}, h, mask.t()), flat)


# ------------------------------------------------------------------ Linears used through F.linear
class Parent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(4, 2, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(torch.tanh(F.linear(x, self.a.weight, self.a.bias)), self.b.weight)


def test_a_functional_linear_kind_is_named_after_its_parent_class_and_feeds_the_child() -> None:
    kind = FunctionalLinearKind(Parent, "a")
    assert (kind.name, kind.suffix, kind.child) == ("Parent.a", ".a", "a")
    assert kind.module_types() == (Parent,)
    parent = Parent()
    assert kind.claims(parent) == (parent.a,) and kind.claims(nn.Module()) == ()
    assert kind.weight(parent) is parent.a.weight and kind.bias(parent) is parent.a.bias
    assert kind.features(parent) == kind.fan_in(parent) == 3
    assert FunctionalLinearKind(Parent, "b").bias(parent) is None
    # by a dotted name (resolved once its module is imported; the name keeps the class's): this module's Parent
    by_name = FunctionalLinearKind(f"{__name__}.Parent", "b")
    assert (by_name.name, by_name.suffix) == ("Parent.b", ".b")
    assert by_name.module_types() == (Parent,)
    assert FunctionalLinearKind("not_imported_pkg.sub.Parent", "b").module_types() == ()
    assert FunctionalLinearKind(Parent, "a", name="Custom.a").name == "Custom.a"


def test_register_functional_linear_registers_one_kind_per_child_and_bnp_manages_them() -> None:
    class Block(Parent):
        pass

    kinds = register_functional_linear(Block, ["a", "b"])
    try:
        assert [(k.name, k.suffix, k.parent_type) for k in kinds] == [
            ("Block.a", ".a", Block),
            ("Block.b", ".b", Block),
        ]
        assert all(layer_kinds()[k.name] is k for k in kinds)
        model = nn.Sequential(Block())
        pre = BNPPreconditioner(model)
        assert list(pre.layers) == ["0.a", "0.b"]
        assert [pre.layers[n].kind for n in ("0.a", "0.b")] == kinds
        x = torch.randn(5, 3)
        model(x).square().sum().backward()
        pre.step()  # the inputs were captured from the F.linear calls: the statistics are theirs
        with torch.no_grad():
            h = torch.tanh(model[0].a(x))
        a, b = (pre.layers[n].running for n in ("0.a", "0.b"))
        assert a.steps == b.steps == 1
        torch.testing.assert_close(a.data_view(), (x.mean(0), x.var(0, correction=0)))
        torch.testing.assert_close(b.data_view()[1], h.square().mean(0))  # no bias: uncentred
        pre.detach()
    finally:
        for k in kinds:
            unregister_layer_kind(k.name)


# ------------------------------------------------------------------ the F.linear capture
def _swapped() -> tuple[object, object, object]:
    return F.linear, F.multi_head_attention_forward, getattr(F, "_check_key_padding_mask", None)


def _restore() -> None:  # whatever a failed test left swapped
    F.linear, F.multi_head_attention_forward = _ORIGINAL_LINEAR, _ORIGINAL_MHA
    if _ORIGINAL_CHECK_KPM is not None:
        F._check_key_padding_mask = _ORIGINAL_CHECK_KPM


def test_captures_nest_and_the_last_stop_restores_every_swapped_global() -> None:
    originals = (_ORIGINAL_LINEAR, _ORIGINAL_MHA, _ORIGINAL_CHECK_KPM)
    assert _swapped() == originals
    w1, w2, x = torch.randn(3, 4), torch.randn(2, 4), torch.randn(5, 4)
    try:
        calls1 = capturing(w1)
        assert F.linear is not _ORIGINAL_LINEAR and F.multi_head_attention_forward is not _ORIGINAL_MHA
        # (a torch without F._check_key_padding_mask has nothing to swap there)
        assert _swapped()[2] is (_traceable_check_key_padding_mask if _ORIGINAL_CHECK_KPM is not None else None)
        calls2 = capturing(w2)
        out1 = F.linear(x, w1)
        assert stop_capturing(w1) is calls1 and len(calls1) == 1 and calls1[0][0] is x and calls1[0][1] is out1
        assert F.linear is not _ORIGINAL_LINEAR  # w2 is still watched
        out2 = F.linear(x, w2)
        stopped = stop_capturing(w2)
        assert stopped is calls2 and len(stopped) == 1 and stopped[0][1] is out2
        assert _swapped() == originals
        # one stop too many (a weight never or no longer captured): nothing recorded, nothing swapped
        assert stop_capturing(w1) == []
        assert _swapped() == originals
        capturing(w1)
        stop_capturing(w1)
        assert _swapped() == originals
    finally:
        _restore()


def test_a_traced_capture_records_the_same_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    _compiling(monkeypatch)  # the lock-free branch that torch.compile traces
    w, x = torch.randn(3, 4), torch.randn(5, 4)
    try:
        capturing(w)
        out = F.linear(x, w)
        calls = stop_capturing(w)
        assert len(calls) == 1 and calls[0][0] is x and calls[0][1] is out
        assert _swapped() == (_ORIGINAL_LINEAR, _ORIGINAL_MHA, _ORIGINAL_CHECK_KPM)
    finally:
        _restore()


# ------------------------------------------------------------------ key_padding_mask
def test_real_keys_inverts_the_padding_once_per_mask_version_and_layout() -> None:
    padding = torch.tensor([[Fa, T, Fa], [Fa, Fa, T]])
    real = _real_keys(padding, transpose=False)
    assert torch.equal(real, torch.tensor([[T, Fa, T], [T, T, Fa]]))
    assert _real_keys(padding, transpose=False) is real  # the v block reuses the k block's inversion
    assert torch.equal(_real_keys(padding, transpose=True), torch.tensor([[T, T], [Fa, T], [T, Fa]]))
    padding[0, 0] = True  # changed in place: a new version, inverted again
    assert torch.equal(_real_keys(padding, transpose=False), torch.tensor([[Fa, Fa, T], [T, T, Fa]]))
    inf = -math.inf
    assert torch.equal(_real_keys(torch.tensor([[0.0, inf, -1.0]]), transpose=False), torch.tensor([[T, Fa, T]]))


def test_real_keys_caches_nothing_while_compiling(monkeypatch: pytest.MonkeyPatch) -> None:
    before = _LAST_KEYS[0]
    _compiling(monkeypatch)
    padding = torch.tensor([[Fa, T]])
    first = _real_keys(padding, transpose=False)
    second = _real_keys(padding, transpose=False)
    assert torch.equal(first, torch.tensor([[T, Fa]])) and torch.equal(second, first) and second is not first
    assert _LAST_KEYS[0] is before


def test_the_traceable_key_padding_mask_check(monkeypatch: pytest.MonkeyPatch) -> None:
    good, bad_n, bad_s = torch.zeros(2, 5, dtype=torch.bool), torch.zeros(3, 5), torch.zeros(2, 4)
    if _ORIGINAL_CHECK_KPM is not None:  # eager: torch's own check and messages (a torch that has one)
        _traceable_check_key_padding_mask(good, 5, 2)
        with pytest.raises(AssertionError, match=r"Expected key_padded_mask.shape\[0\] to be 2, but got 3"):
            _traceable_check_key_padding_mask(bad_n, 5, 2)
        with pytest.raises(AssertionError, match=r"Expected key_padded_mask.shape\[1\] to be 5, but got 4"):
            _traceable_check_key_padding_mask(bad_s, 5, 2)
    # traced: the same checks, messages without the values
    _compiling(monkeypatch)
    _traceable_check_key_padding_mask(good, 5, 2)
    for bad in (bad_n, bad_s):
        with pytest.raises(AssertionError, match=r"^key_padding_mask: not \(N, S\)$"):
            _traceable_check_key_padding_mask(bad, 5, 2)
