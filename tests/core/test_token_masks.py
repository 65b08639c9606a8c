"""Issue 24 item 3: token masks. Under ``pre.token_mask(mask)`` the statistics of every managed layer (μ, σ², N,
hence q²) are those of the real tokens alone — checked against explicit torch on the gathered real rows, and
end to end against BNP run on the unpadded sequences — for Linear, nn.MultiheadAttention (self-attention,
cross-attention, key_padding_mask, either layout), accumulation, torch.compile and the host-read count; jagged
nested tensors use their real rows. Under DDP: ``tests/ddp/test_token_masks_ddp.py``; the Lightning callback:
``tests/callbacks/test_token_mask_callback.py``."""

from __future__ import annotations

import copy
import re
import warnings
from typing import Any

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_bnp.core import BNPPreconditioner, BNPWarning
from lightning_bnp.core.statistics import Moments
from tests.helpers import spy_moments
from tests.host_reads import HostReads

LENGTHS = (10, 3, 6, 1)


def padded(lengths: tuple[int, ...] = LENGTHS, features: int = 8, seed: int = 0) -> tuple[Tensor, Tensor]:
    """(B, T, F) tokens whose padded positions hold large junk (and a NaN), and the (B, T) mask of real ones."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]
    x = torch.randn(len(lengths), max(lengths), features, generator=g) * 2 + 1
    x[~mask] = 1e3
    x[~mask][0, 0] = float("nan")
    return x, mask


def check_moments(m: Moments, rows: Tensor) -> None:
    """μ, σ² (biased) and N of ``m`` are those of ``rows`` (R, F), computed by torch directly."""
    assert float(m.rows) == float(m.samples) == float(m.out_positions) == rows.shape[0]
    torch.testing.assert_close(m.mean, rows.mean(0), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(m.var, rows.var(0, correction=0), rtol=1e-6, atol=1e-6)


def test_linear_statistics_are_those_of_the_real_tokens() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4, bias=False))
    pre = BNPPreconditioner(net, statistics="batch")
    seen = spy_moments(pre)
    x, mask = padded()
    with pre.token_mask(mask):
        hidden = torch.tanh(net[0](x))
        net[2](hidden).masked_fill(~mask[..., None], 0.0).sum().backward()
    assert pre._masks.mask is None  # restored on exit
    pre.step()
    check_moments(seen["0"], x[mask])
    check_moments(seen["2"], hidden.detach()[mask])
    fan_in, n = 8, int(mask.sum())
    assert float(pre.layers["0"].transform.q2) == pytest.approx(max(fan_in / n, 1.0))  # type: ignore[union-attr]
    assert float(pre.layers["2"].transform.q2) == pytest.approx(max(16 / n, 1.0))  # type: ignore[union-attr]


def test_an_integer_mask_counts_nonzero_as_real_and_a_nested_context_restores_the_outer() -> None:
    net = nn.Linear(8, 3)
    pre = BNPPreconditioner(net, statistics="batch")
    seen = spy_moments(pre)
    x, mask = padded()
    with pre.token_mask(mask.long()):  # Hugging Face's attention_mask: 1 = real
        with pre.token_mask(None):
            assert pre._masks.mask is None
        net(x).masked_fill(~mask[..., None], 0.0).sum().backward()
    pre.step()
    check_moments(seen[""], x[mask])


def train(net: nn.Module, batches: list[tuple[Tensor, Tensor]], masked: bool, steps: int = 3) -> BNPPreconditioner:
    """SGD + BNP; each step accumulates ``batches``: padded under the mask, or each sequence unpadded alone."""
    pre = BNPPreconditioner(net, rho=0.5)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    for _ in range(steps):
        opt.zero_grad()
        for x, mask in batches:
            if masked:
                with pre.token_mask(mask):
                    net(x).masked_fill(~mask[..., None], 0.0).square().sum().backward()
            else:
                for row, real in zip(x, mask):
                    net(row[real][None]).square().sum().backward()
        pre.step(opt)
        opt.step()
    return pre


def test_masked_training_equals_bnp_on_the_unpadded_sequences_with_accumulation() -> None:
    """Three steps of two accumulated micro-batches (different masks, counts on the device): parameters and
    running statistics equal those of BNP fed each real sequence alone (no padding anywhere)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    twin = copy.deepcopy(net)
    batches = [padded(seed=1), padded((2, 7, 7), seed=2)]
    pre, ref = train(net, batches, masked=True), train(twin, batches, masked=False)
    for (name, p), q in zip(net.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6, msg=name)
    for name, layer in pre.layers.items():
        assert layer.running.steps == ref.layers[name].running.steps == 3
        torch.testing.assert_close(layer.running.mean_acc, ref.layers[name].running.mean_acc, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(layer.running.var_acc, ref.layers[name].running.var_acc, rtol=1e-6, atol=1e-6)


class Block(nn.Module):
    """Self-attention then cross-attention (the memory padded with its own mask), masked loss."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.self_attn = nn.MultiheadAttention(8, 2, batch_first=batch_first)
        self.cross = nn.MultiheadAttention(8, 2, batch_first=batch_first, kdim=6, vdim=5)

    def forward(self, x: Tensor, pad: Tensor, memory: Tensor, memory_pad: Tensor) -> Tensor:
        if not self.batch_first:  # sequence-first: (T, B, F)
            x, memory, memory_value = x.transpose(0, 1), memory.transpose(0, 1), memory.transpose(0, 1)[..., :5]
        else:
            memory_value = memory[..., :5]
        h = self.self_attn(x, x, x, key_padding_mask=pad, need_weights=False)[0]
        out = self.cross(h, memory, memory_value, key_padding_mask=memory_pad)[0]
        return out if self.batch_first else out.transpose(0, 1)


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "sequence_first"])
def test_multihead_attention_statistics_are_those_of_the_real_tokens(batch_first: bool) -> None:
    """q and out_proj: the token mask (the query's); k, v: the call's key_padding_mask (self-attention: the same
    positions; cross-attention: the memory's)."""
    torch.manual_seed(0)
    block = Block(batch_first)
    pre = BNPPreconditioner(block, statistics="batch")
    seen = spy_moments(pre)
    x, mask = padded()
    memory, memory_mask = padded((4, 9, 2, 5), features=6, seed=3)
    token_mask = mask if batch_first else mask.t()  # the layout the layers see
    with pre.token_mask(token_mask):
        out = block(x, ~mask, memory, ~memory_mask)
        out.masked_fill(~mask[..., None], 0.0).sum().backward()
    pre.step()
    check_moments(seen["self_attn.q"], x[mask])
    check_moments(seen["self_attn.k"], x[mask])
    check_moments(seen["self_attn.v"], x[mask])
    check_moments(seen["cross.k"], memory[memory_mask])
    check_moments(seen["cross.v"], memory[memory_mask][:, :5])
    # out_proj's inputs: the attention outputs at the real query positions, recomputed by torch
    with torch.no_grad():
        attn = block.self_attn
        q, k, v = F.linear(x, attn.in_proj_weight, attn.in_proj_bias).chunk(3, -1)
        heads = [t.unflatten(-1, (2, 4)).transpose(1, 2) for t in (q, k, v)]
        a = F.scaled_dot_product_attention(*heads, attn_mask=mask[:, None, None, :]).transpose(1, 2).flatten(2)
        h = attn.out_proj(a)
    check_moments(seen["self_attn.out_proj"], a[mask])
    check_moments(seen["cross.q"], h[mask])
    assert "cross.out_proj" in seen and float(seen["cross.out_proj"].rows) == int(mask.sum())


def test_a_mask_that_does_not_fit_a_layer_names_the_layer_and_both_shapes() -> None:
    net = nn.Sequential(nn.Linear(8, 8), nn.Flatten(), nn.Linear(80, 3))
    pre = BNPPreconditioner(net)
    x, mask = padded()
    with pytest.raises(ValueError, match=r"'2' \(Linear\): the token mask of shape \(4, 10\) does not fit its input "
                                         r"of shape \(4, 80\)"):  # fmt: skip
        with pre.token_mask(mask):
            net(x)
    with pre.token_mask(mask, layers="0"):  # the head sees one row per sequence: left out, every row counts
        net(x).sum().backward()
    seen = spy_moments(pre)
    pre.step()
    assert float(seen["0"].rows) == int(mask.sum()) and seen["2"].rows == 4
    with pytest.raises(ValueError, match=r"`layers` pattern 'encoder\.\*' matches no BNP layer"):
        pre.set_token_mask(mask, layers="encoder.*")
    with pytest.raises(TypeError, match=r"`mask` must be a bool tensor .* got a tensor of dtype torch.float32"):
        pre.set_token_mask(mask.float())
    with pytest.raises(TypeError, match=r"`mask` must be a bool tensor \(True = real token\) .* got list$"):
        pre.set_token_mask([[True, False]])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`mask` needs the leading dimensions .* got shape \(\)$"):
        pre.set_token_mask(torch.tensor(True))
    pre.set_token_mask(mask[0])  # one dimension is a mask (for a (T, F) input); it is checked at the forward
    pre.set_token_mask(None)


def test_a_masked_step_reads_nothing_back_from_the_device() -> None:
    torch.manual_seed(0)
    net = nn.ModuleDict({"mlp": nn.Sequential(nn.Linear(8, 16), nn.Tanh()), "attn": nn.MultiheadAttention(16, 2)})
    net["attn"].batch_first = True
    pre = BNPPreconditioner(net)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    counts = []
    for step in range(4):
        x, mask = padded(seed=step)
        x = x.nan_to_num(posinf=0.0)
        with HostReads() as reads:
            opt.zero_grad()
            with pre.token_mask(mask):
                h = net["mlp"](x)
                net["attn"](h, h, h, key_padding_mask=~mask)[0].square().mean().backward()
            pre.step(opt)
            opt.step()
        counts.append(dict(reads.reads))
    assert counts == [{}] * 4
    assert all(layer.running.steps == 4 for layer in pre.layers.values())


def test_jagged_nested_tensors_use_their_real_rows() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    pre = BNPPreconditioner(net, statistics="batch")
    seen = spy_moments(pre)
    rows = [torch.randn(n, 8) for n in LENGTHS]
    nested = torch.nested.nested_tensor(rows, layout=torch.jagged)
    net(nested).values().square().sum().backward()
    pre.step()
    check_moments(seen["0"], torch.cat(rows))
    check_moments(seen["2"], torch.tanh(net[0](torch.cat(rows))).detach())


def test_a_nested_tensor_that_bnp_cannot_read_names_the_layer() -> None:
    net = nn.Linear(8, 4)
    pre = BNPPreconditioner(net)
    nested = torch.nested.nested_tensor([torch.randn(n, 8) for n in LENGTHS], layout=torch.jagged)
    with pytest.raises(ValueError, match=r"BNP layer '' \(Linear\) got a nested tensor while a token mask"):
        with pre.token_mask(torch.ones(4, 10, dtype=torch.bool)):
            net(nested)
    with warnings.catch_warnings():  # torch's own warning about the strided layout: once per process, so it is
        warnings.simplefilter("ignore", UserWarning)  # not there when another test made one first
        strided = torch.nested.nested_tensor([torch.randn(n, 8) for n in LENGTHS])
    with pytest.raises(ValueError, match=r"BNP layer '' \(Linear\) got a nested tensor of layout torch.strided \(4 "
                                         r"sequences\); BNP reads the real rows of a jagged one"):  # fmt: skip
        net(strided)


def test_token_masks_under_compile_are_one_graph_and_equal_eager() -> None:
    """The hooks under a mask trace into the compiled forward without a graph break (fullgraph=True), and the
    step's statistics equal eager's; changing the mask's values does not recompile."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    twin = copy.deepcopy(net)
    eager, compiled_pre = BNPPreconditioner(twin, statistics="batch"), BNPPreconditioner(net, statistics="batch")
    seen_eager, seen = spy_moments(eager), spy_moments(compiled_pre)
    counter = torch._dynamo.testing.CompileCounter()
    forward = torch.compile(net, backend=counter, fullgraph=True)
    for seed, lengths in enumerate([LENGTHS, (2, 10, 9, 4), (10, 10, 1, 5)]):  # one shape
        x, mask = padded(lengths, seed=seed)
        for model, pre in ((twin, eager), (forward, compiled_pre)):
            with pre.token_mask(mask):
                model(x).masked_fill(~mask[..., None], 0.0).sum().backward()
            pre.step()
        for name in ("0", "2"):
            assert float(seen[name].rows) == float(seen_eager[name].rows) == int(mask.sum())
            torch.testing.assert_close(seen[name].mean, seen_eager[name].mean, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(seen[name].var, seen_eager[name].var, rtol=1e-6, atol=1e-6)
        check_moments(seen["0"], x[mask])
    assert counter.frame_count == 1


def test_a_step_without_a_real_token_keeps_the_statistics_and_a_nan_token_is_still_reported() -> None:
    net = nn.Linear(4, 2)
    pre = BNPPreconditioner(net)
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, real in enumerate([True, False, True]):
            net.zero_grad()
            with pre.token_mask(torch.full((2, 5), real)):
                net(torch.randn(2, 5, 4, generator=g)).sum().backward()
            before, grad = pre.layers[""].running.mean_acc.clone(), net.weight.grad.clone()  # type: ignore[union-attr]
            pre.step()
            assert pre.layers[""].running.steps == (1 if step < 2 else 2)
            if not real:  # every token padding: statistics kept, gradient untransformed (M = I)
                assert torch.equal(pre.layers[""].running.mean_acc, before)
                assert torch.equal(net.weight.grad, grad)
        pre.flush_warnings()
        assert not [w for w in caught if issubclass(w.category, BNPWarning)]
        x = torch.randn(2, 5, 4, generator=g)
        x[0, 1, 2] = float("nan")  # a real token
        with pre.token_mask(torch.ones(2, 5, dtype=torch.bool)):
            net(x).sum().backward()
        pre.step()
        pre.flush_warnings()
    assert any("NaN or Inf" in str(w.message) for w in caught if issubclass(w.category, BNPWarning))


def test_transformer_encoder_with_its_float_key_padding_mask() -> None:
    """nn.TransformerEncoder turns src_key_padding_mask into a float mask (−inf = padding) before its attention:
    the k and v blocks read that one; every layer of both encoder layers counts the 20 real tokens."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    pre = BNPPreconditioner(encoder, statistics="batch")
    seen = spy_moments(pre)
    x, mask = padded()
    with pre.token_mask(mask):
        out = encoder(x, src_key_padding_mask=~mask)
    out.masked_fill(~mask[..., None], 0.0).sum().backward()
    pre.step()
    for block in "qkv":
        check_moments(seen[f"layers.0.self_attn.{block}"], x[mask])
    assert len(seen) == 12 and all(float(m.rows) == int(mask.sum()) for m in seen.values())


def test_the_layers_a_mask_applies_to_are_named_by_layer_or_module_patterns() -> None:
    """``layers`` patterns match a layer's name (``self_attn.q``) or its module's (``self_attn`` for all four of
    its layers); several patterns are the union of what each matches; a pattern matching nothing (the empty one
    too) or no pattern at all is refused, naming the argument."""
    block = Block(batch_first=True)
    block.head = nn.Linear(8, 3)
    pre = BNPPreconditioner(block)
    attention = {f"self_attn.{p}" for p in ("q", "k", "v", "out_proj")}
    pre.set_token_mask(torch.ones(2, 3, dtype=torch.bool), layers="self_attn")
    assert pre._masks.applies_to == attention
    pre.set_token_mask(torch.ones(2, 3, dtype=torch.bool), layers=["self_attn.q", "cross.k", "head"])
    assert pre._masks.applies_to == {"self_attn.q", "cross.k", "head"}
    pre.set_token_mask(torch.ones(2, 3, dtype=torch.bool), layers=["cross", "self_attn.out_proj"])
    assert pre._masks.applies_to == {"cross.q", "cross.k", "cross.v", "cross.out_proj", "self_attn.out_proj"}
    for patterns in ("", ["head", ""]):
        with pytest.raises(ValueError, match=r"^`layers` pattern '' matches no BNP layer; layers are \['self_attn\.q'"):
            pre.set_token_mask(torch.ones(2, 3, dtype=torch.bool), layers=patterns)
    with pytest.raises(ValueError, match=r"^`layers` must be None or a non-empty list of patterns, got \[\]$"):
        pre.set_token_mask(torch.ones(2, 3, dtype=torch.bool), layers=[])


def test_what_a_masked_forward_cannot_read_is_refused_with_the_whole_reason() -> None:
    net = nn.Sequential(nn.Linear(8, 8), nn.Flatten(), nn.Linear(80, 3))
    pre = BNPPreconditioner(net)
    x, mask = padded()
    message = (
        "BNP layer '2' (Linear): the token mask of shape (4, 10) does not fit its input of shape (4, 80) (the mask "
        "needs the input's leading dimensions; a MultiheadAttention's, those of its query, key or value). Pass the "
        "mask in the layout this layer sees, or leave the layer out with `token_mask(mask, layers=...)`"
    )
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        with pre.token_mask(mask):
            net(x)
    linear = nn.Linear(8, 4)
    pre = BNPPreconditioner(linear)
    nested = torch.nested.nested_tensor([torch.randn(n, 8) for n in LENGTHS], layout=torch.jagged)
    message = (
        "BNP layer '' (Linear) got a nested tensor while a token mask of shape (4, 10) is set: a nested tensor holds "
        "no padding (its real rows are used without a mask); leave this layer out of the mask with `layers`"
    )
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        with pre.token_mask(torch.ones(4, 10, dtype=torch.bool)):
            linear(nested)
    with warnings.catch_warnings():  # torch's own warning about the strided layout (once per process)
        warnings.simplefilter("ignore", UserWarning)
        strided = torch.nested.nested_tensor([torch.randn(n, 8) for n in LENGTHS])
    message = (
        "BNP layer '' (Linear) got a nested tensor of layout torch.strided (4 sequences); BNP reads the real rows of "
        "a jagged one (torch.nested.nested_tensor(..., layout=torch.jagged)) into a dense layer (Linear and its "
        "kinds). Pass a jagged nested tensor, or a padded tensor with `token_mask`, or exclude the layer with "
        "`exclude`"
    )
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        linear(strided)


class _Ops(TorchDispatchMode):
    """The aten operators run inside it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_setting_a_mask_runs_no_tensor_op_and_an_integer_one_is_compared_with_zero_once_per_set_in_the_forward() -> (
    None
):
    """The callback sets a mask for every batch: setting it runs nothing (no copy, no kernel on its device); an
    integer one (Hugging Face's ``attention_mask``) becomes ``mask != 0`` at the first forward that reads it after it
    is set (inside a captured step, where a graph reads the batch's own mask), once for every layer and forward until
    the next set; a bool one is used as given."""
    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    pre = BNPPreconditioner(net)
    x, mask = padded()
    integer = mask.long()
    for given in (mask, integer):
        with _Ops() as ran:
            pre.set_token_mask(given)
        assert ran.ops == []
    with _Ops() as ran:
        net(x)
        net(x)
    assert ran.ops.count("aten.ne") == 1
    integer.zero_()[:, 0] = 1  # the same tensor, set again: compared anew (a batch written into a captured input)
    pre.set_token_mask(integer)
    with _Ops() as ran:
        net(x)
    assert ran.ops.count("aten.ne") == 1
    pre.set_token_mask(None)
