"""Issue 24, items 1–2: nn.MultiheadAttention in every form and Linears used through F.linear.

The reference is BNP on the same attention written with four ``nn.Linear`` layers (q, k, v, out) and an
explicit softmax: after several SGD steps both models hold the same parameters.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_bnp.core import BNPPreconditioner
from lightning_bnp.core.layers import BNPWarning

E, HEADS = 8, 2


class Twin(nn.Module):
    """Multi-head attention from four Linears (batch-first internally)."""

    def __init__(self, mha: nn.MultiheadAttention) -> None:
        super().__init__()
        kdim, vdim, bias = mha.kdim, mha.vdim, mha.in_proj_bias is not None
        self.q, self.k, self.v = (
            nn.Linear(E, E, bias=bias),
            nn.Linear(kdim, E, bias=bias),
            nn.Linear(vdim, E, bias=bias),
        )
        self.o = nn.Linear(E, E, bias=mha.out_proj.bias is not None)
        self.batch_first = mha.batch_first
        with torch.no_grad():
            if mha._qkv_same_embed_dim:
                for i, lin in enumerate((self.q, self.k, self.v)):
                    lin.weight.copy_(mha.in_proj_weight[i * E : (i + 1) * E])
            else:
                for lin, w in zip((self.q, self.k, self.v), (mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight)):
                    lin.weight.copy_(w)
            if bias:
                for i, lin in enumerate((self.q, self.k, self.v)):
                    lin.bias.copy_(mha.in_proj_bias[i * E : (i + 1) * E])
            self.o.weight.copy_(mha.out_proj.weight)
            if mha.out_proj.bias is not None:
                self.o.bias.copy_(mha.out_proj.bias)

    def forward(
        self, query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, kpm: Tensor | None
    ) -> Tensor:
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        b, length, _ = query.shape
        d = E // HEADS

        def heads(t: Tensor) -> Tensor:
            return t.view(b, -1, HEADS, d).transpose(1, 2)

        q, k, v = heads(self.q(query)), heads(self.k(key)), heads(self.v(value))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d)
        if attn_mask is not None:
            scores = scores.masked_fill(attn_mask, float("-inf"))
        if kpm is not None:
            scores = scores.masked_fill(kpm[:, None, None, :], float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, length, E)
        out = self.o(out)
        return out if self.batch_first else out.transpose(0, 1)


class Wrapped(nn.Module):
    def __init__(self, mha: nn.MultiheadAttention, need_weights: bool) -> None:
        super().__init__()
        self.attn, self.need_weights = mha, need_weights

    def forward(
        self, query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, kpm: Tensor | None
    ) -> Tensor:
        out = self.attn(query, key, value, attn_mask=attn_mask, key_padding_mask=kpm, need_weights=self.need_weights)
        return out[0]


CASES = {
    "self": dict(form="self"),
    "self-seq-first-causal": dict(form="self", batch_first=False, causal=True),
    "self-no-bias-weights": dict(form="self", bias=False, need_weights=True),
    "cross": dict(form="cross"),
    "cross-key-padding": dict(form="cross", padding=True, need_weights=True),
    "kdim-vdim": dict(form="kv", kdim=5, vdim=3, padding=True),
    "kdim-vdim-seq-first-causal": dict(form="kv", kdim=5, vdim=3, batch_first=False, causal=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_mha_equals_bnp_on_four_linears(case: str) -> None:
    c = {"batch_first": True, "bias": True, "need_weights": False, "causal": False, "padding": False, **CASES[case]}
    torch.manual_seed(0)
    kdim, vdim = c.get("kdim", E), c.get("vdim", E)
    mha = nn.MultiheadAttention(E, HEADS, bias=c["bias"], batch_first=c["batch_first"], kdim=kdim, vdim=vdim)
    model = Wrapped(mha, c["need_weights"]).double()
    twin = Twin(mha).double()
    pre, pre_twin = BNPPreconditioner(model, rho=0.5), BNPPreconditioner(twin, rho=0.5)
    assert len(pre.layers) == 4 and not pre.skipped, pre.report()
    g = torch.Generator().manual_seed(1)
    batch, length, source = 3, 4, 6 if c["form"] != "self" else 4
    for _ in range(4):

        def sample(features: int, n: int) -> Tensor:
            x = torch.randn(batch, n, features, generator=g, dtype=torch.float64) * 2 + 0.5
            return x if c["batch_first"] else x.transpose(0, 1)

        query = sample(E, length)
        key = query if c["form"] == "self" else sample(kdim, source)
        value = key if c["form"] in ("self", "cross") else sample(vdim, source)
        causal = torch.ones(length, source, dtype=torch.bool).triu(1) if c["causal"] else None
        kpm = None
        if c["padding"]:
            kpm = torch.zeros(batch, source, dtype=torch.bool)
            kpm[0, -2:] = True
        target = torch.randn(batch, length, E, generator=g, dtype=torch.float64)
        target = target if c["batch_first"] else target.transpose(0, 1)
        for net, p in ((model, pre), (twin, pre_twin)):
            net.zero_grad()
            F.mse_loss(net(query, key, value, causal, kpm), target).backward()
            p.step()
            with torch.no_grad():
                for param in net.parameters():
                    param.sub_(0.1 * param.grad)
    if mha._qkv_same_embed_dim:
        weights = mha.in_proj_weight.split(E)
    else:
        weights = (mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight)
    for w, lin in zip((*weights, mha.out_proj.weight), (twin.q, twin.k, twin.v, twin.o)):
        torch.testing.assert_close(w, lin.weight, rtol=1e-5, atol=1e-7)
    if c["bias"]:
        for b, lin in zip(mha.in_proj_bias.split(E), (twin.q, twin.k, twin.v)):
            torch.testing.assert_close(b, lin.bias, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(mha.out_proj.bias, twin.o.bias, rtol=1e-5, atol=1e-7)
    # and BNP did transform them: plain SGD on the twin ends elsewhere
    assert all(layer.running.steps == 4 for layer in pre.layers.values())
    # the q, k, v blocks of one packed in_proj_weight (bias or not) were one entry of the transform
    spans = [n for plan in pre._step.plans.values() for config in plan.configs.values() for _, n in config.spans]
    assert spans == ([3, 1] if mha._qkv_same_embed_dim else [1, 1, 1, 1])


def test_qkv_blocks_whose_q2_differ_are_transformed_each_with_its_own() -> None:
    """Cross-attention on few rows: q sees 2 (q² = E/2), k and v see 5 (q² = E/5); the blocks are not grouped
    under one q², and each gradient equals that of BNP on the four-Linear twin."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, HEADS, batch_first=True)
    model, twin = Wrapped(mha, False).double(), Twin(mha).double()
    pre, pre_twin = BNPPreconditioner(model, statistics="batch"), BNPPreconditioner(twin, statistics="batch")
    g = torch.Generator().manual_seed(1)
    query = torch.randn(1, 2, E, generator=g, dtype=torch.float64) * 2 + 0.5
    memory = torch.randn(1, 5, E, generator=g, dtype=torch.float64) * 2 - 0.5
    for net, p in ((model, pre), (twin, pre_twin)):
        net(query, memory, memory, None, None).square().sum().backward()
        p.step()
    q2 = [float(pre.layers[f"attn.{block}"].transform.q2) for block in "qkv"]  # type: ignore[union-attr]
    assert q2 == [E / 2, E / 5, E / 5]
    assert mha.in_proj_weight.grad is not None and mha.in_proj_bias.grad is not None
    for i, lin in enumerate((twin.q, twin.k, twin.v)):
        rows = slice(i * E, (i + 1) * E)
        torch.testing.assert_close(mha.in_proj_weight.grad[rows], lin.weight.grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(mha.in_proj_bias.grad[rows], lin.bias.grad, rtol=1e-10, atol=1e-12)


def test_mha_state_dict_and_f_linear_untouched() -> None:
    mha = nn.MultiheadAttention(E, HEADS, batch_first=True)
    keys = list(mha.state_dict())
    swapped = ("linear", "multi_head_attention_forward", "_check_key_padding_mask")  # during the forward only
    originals = [getattr(F, name, None) for name in swapped]
    BNPPreconditioner(mha)
    x = torch.randn(2, 3, E)
    mha(x, x, x)[0].sum().backward()
    assert list(mha.state_dict()) == keys
    assert [getattr(F, name, None) for name in swapped] == originals
    with pytest.raises(AssertionError):  # the forward raises: F.linear is restored all the same
        mha(x, torch.randn(2, 3, E + 1), x)
    assert [getattr(F, name, None) for name in swapped] == originals


def _covered(model: nn.Module, *inputs: Tensor) -> BNPPreconditioner:
    model.train()
    pre = BNPPreconditioner(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BNPWarning)
        for _ in range(2):
            model.zero_grad()
            out = model(*inputs)
            (out[0] if isinstance(out, tuple) else out).square().mean().backward()
            pre.step()
    # embeddings and positional parameters aside (issue 24's targets), every weight matrix is transformed
    assert all("embedding" in reason for reason in pre.skipped.values()), pre.skipped
    return pre


def test_torch_transformers_every_projection() -> None:
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(E, HEADS, 16, dropout=0.0, batch_first=True), 2)
    pre = _covered(enc, torch.randn(2, 5, E))
    assert pre.report() == "BNP transforms 8 of the model's 8 trainable weight matrices"
    assert len(pre.layers) == 12  # 2 × (q, k, v, out_proj, linear1, linear2)
    tr = nn.Transformer(E, HEADS, 2, 2, 16, dropout=0.0, batch_first=True)
    pre = _covered(tr, torch.randn(2, 5, E), torch.randn(2, 4, E))
    assert pre.report() == "BNP transforms 20 of the model's 20 trainable weight matrices"


def test_torchvision_vit_and_swin_every_projection() -> None:
    tv = pytest.importorskip("torchvision.models")
    torch.manual_seed(0)
    vit = tv.VisionTransformer(16, 8, num_layers=2, num_heads=2, hidden_dim=8, mlp_dim=16, num_classes=3)
    pre = _covered(vit, torch.randn(2, 3, 16, 16))
    assert pre.report().startswith("BNP transforms 10 of the model's 12 trainable weight matrices; it leaves alone")
    assert set(pre.skipped) == {"class_token", "encoder.pos_embedding"}
    swin = tv.swin_t(num_classes=3)
    pre = _covered(swin, torch.randn(1, 3, 32, 32))
    # 12 blocks × (qkv, proj, 2 MLP) + 3 patch merging + stem conv + head; the 12 relative-position tables aside
    assert pre.report().startswith("BNP transforms 53 of the model's 65 trainable weight matrices"), pre.report()
    assert all(name.endswith("relative_position_bias_table") for name in pre.skipped)
    assert sum(name.endswith((".qkv", ".proj")) for name in pre.layers) == 24


def test_a_packed_weight_with_an_excluded_block_is_named() -> None:
    mha = nn.MultiheadAttention(E, HEADS)
    pre = BNPPreconditioner(mha, exclude="k")
    assert list(pre.layers) == ["q", "v", "out_proj"]
    assert pre.skipped == {
        "in_proj_weight": "row blocks ['k'] of it dropped by `include`/`exclude`; the others are transformed"
    }


def test_a_copy_of_an_attention_model_never_feeds_the_originals_statistics() -> None:
    """Issue 25 for the attention kinds: their pre-hooks and hooks are copy-safe too, so a deepcopy (an EMA or
    teacher copy) carries inert hooks, and ``BNPPreconditioner(copy)`` manages the copy on its own."""
    import copy

    torch.manual_seed(0)
    model = nn.MultiheadAttention(8, 2, batch_first=True)
    pre = BNPPreconditioner(model)
    twin = copy.deepcopy(model)
    x = torch.randn(3, 4, 8)
    twin(x, x, x)[0].sum().backward()
    assert all(layer.moments is None for layer in pre.layers.values())
    own = BNPPreconditioner(twin)
    twin(x, x, x)[0].sum().backward()
    assert all(layer.moments is not None for layer in own.layers.values())
    assert all(layer.moments is None for layer in pre.layers.values())


@pytest.mark.parametrize("case", ["bias-corrected", "paper-view", "compiled-step", "mask-on-q-only"])
def test_qkv_blocks_transformed_as_one_keep_each_blocks_own_statistics(case: str) -> None:
    """Issue 24: the step transforms the q, k, v row blocks of ``in_proj_weight`` as one grouped matrix (one bias
    update for the three). Each block keeps its own μ, σ̃² and q²: with different running states loaded into q, k
    and v (and, for ``mask-on-q-only``, a token mask on the query's block alone, so that q's N and q² differ from
    k's and v's: counts on the device), the gradients equal those of BNP on the four-Linear twin with the same
    states, block by block."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, HEADS, batch_first=True)
    model, twin = Wrapped(mha, False).double(), Twin(mha).double()
    options = {"rho": 0.5, "bias_correction": case != "paper-view"}
    pre, pre_twin = BNPPreconditioner(model, **options), BNPPreconditioner(twin, **options)  # type: ignore[arg-type]
    if case == "compiled-step":
        pre.compile_step(backend="aot_eager")
    g = torch.Generator().manual_seed(2)
    state, state_twin = pre.state_dict(), pre_twin.state_dict()
    for i, block in enumerate("qkv"):  # a different state per block
        layer = {
            "mean_acc": torch.randn(E, generator=g, dtype=torch.float64) * (i + 1),
            "var_acc": torch.rand(E, generator=g, dtype=torch.float64) * 3 + 0.1 * (i + 1),
            "steps": 2 + 3 * i,
        }
        state["layers"][f"attn.{block}"] = {**state["layers"][f"attn.{block}"], **layer}
        state_twin["layers"][block] = {**state_twin["layers"][block], **layer}
        state_twin["layers"][block].pop("decay", None)
        state["layers"][f"attn.{block}"].pop("decay", None)
    pre.load_state_dict(state)
    pre_twin.load_state_dict(state_twin)
    x = torch.randn(2, 3, E, generator=g, dtype=torch.float64) * 2 + 0.5
    target = torch.randn(2, 3, E, generator=g, dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    for net, p, q_name in ((model, pre, "attn.q"), (twin, pre_twin, "q")):
        net.zero_grad()
        if case == "mask-on-q-only":
            with p.token_mask(mask, layers=q_name):
                F.mse_loss(net(x, x, x, None, None), target).backward()
        else:
            F.mse_loss(net(x, x, x, None, None), target).backward()
        p.step()
    assert mha.in_proj_weight.grad is not None and mha.in_proj_bias.grad is not None
    # the three blocks were one entry of the transform
    assert [n for plan in pre._step.plans.values() for config in plan.configs.values() for _, n in config.spans] == [
        3,
        1,
    ]
    for i, lin in enumerate((twin.q, twin.k, twin.v)):
        rows = slice(i * E, (i + 1) * E)
        torch.testing.assert_close(mha.in_proj_weight.grad[rows], lin.weight.grad, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(mha.in_proj_bias.grad[rows], lin.bias.grad, rtol=1e-10, atol=1e-12)
    q2 = [pre.layers[f"attn.{block}"].transform.q2 for block in "qkv"]  # type: ignore[union-attr]
    if case == "mask-on-q-only":  # q's 3 real rows against k's and v's 6: q² = max(E/N, 1) differs
        assert float(q2[0]) == E / 3 and float(q2[1]) == float(q2[2]) == E / 6


def _project(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """A helper a parent hands its Linear's weight to (as torchvision's Swin hands ``qkv.weight`` on)."""
    return F.linear(x, weight, bias)


class UnknownFunctionalParent(nn.Module):
    """A parent no layer kind names that uses its Linears only through their weights: ``F.linear`` directly, and
    a helper that calls it."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(6, 12), nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = F.linear(x, self.qkv.weight, self.qkv.bias).chunk(3, dim=-1)
        attn = (q @ k.transpose(-1, -2)).softmax(-1) @ v
        return _project(attn, self.proj.weight, self.proj.bias)


class CalledTwin(UnknownFunctionalParent):
    """The same computation with the Linears called (BNP's plain Linear kind, the reference)."""

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.proj((q @ k.transpose(-1, -2)).softmax(-1) @ v)


def test_a_linear_an_unknown_parent_uses_through_f_linear_is_preconditioned_exactly() -> None:
    """Issue 24, item 2: with no kind registered for the parent, BNP reads from the parent's source that it uses
    ``self.qkv.weight`` / ``self.proj.weight`` without calling the Linears, captures their ``F.linear`` calls, and
    transforms both — equal to BNP on the twin that calls them, with no warning."""
    from lightning_bnp.core.attention import FunctionalLinearKind

    torch.manual_seed(0)
    model, twin = UnknownFunctionalParent(), CalledTwin()
    twin.load_state_dict(model.state_dict())
    pre, pre_twin = BNPPreconditioner(model), BNPPreconditioner(twin)
    assert {name: type(layer.kind) for name, layer in pre.layers.items()} == {
        "qkv": FunctionalLinearKind,  # at the root: the child's name, as for an MHA's q, k, v and out_proj
        "proj": FunctionalLinearKind,
    }
    assert pre.report() == "BNP transforms 2 of the model's 2 trainable weight matrices"
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, twin)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", BNPWarning)
        for step in range(3):
            x = torch.randn(4, 5, 6) * (step + 1) + 2.0
            for m, p, opt in zip((model, twin), (pre, pre_twin), optimizers):
                opt.zero_grad()
                m(x).square().sum().backward()
                p.step()
                opt.step()
    for name, p in twin.named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[name], p, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pre.layers["proj"].running.var, pre_twin.layers["proj"].running.var)
    assert pre.layers["qkv"].running.steps == 3


def test_a_parent_that_calls_its_linear_keeps_the_plain_linear_kind() -> None:
    """Reading ``self.fc.weight`` (here for a penalty) while calling ``self.fc(x)``: the Linear's own hook sees
    every call, so BNP keeps the plain Linear kind."""

    class Penalized(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x: Tensor) -> Tensor:
            return self.fc(x) + self.fc.weight.square().sum()

    pre = BNPPreconditioner(Penalized())
    assert [(name, layer.kind.name) for name, layer in pre.layers.items()] == [("fc", "Linear")]


def test_the_inferred_kinds_name_the_parent_class_and_its_source_is_read_once_per_class(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kinds inferred for a parent's ``F.linear`` children are named ``<parent class>.<child>`` and apply to
    that class; its ``forward`` source is read once per class, not for every model or preconditioner."""
    import inspect

    from lightning_bnp.core.attention import inferred_functional_linears

    class Parent(UnknownFunctionalParent):  # a fresh class: nothing read for it yet
        pass

    reads: list[object] = []
    getsource = inspect.getsource

    def spy(obj: Any) -> str:
        reads.append(obj)
        return getsource(obj)

    monkeypatch.setattr(inspect, "getsource", spy)
    for _ in range(3):
        kinds = inferred_functional_linears(Parent())
        assert [(k.name, k.module_types()) for k in kinds] == [("Parent.proj", (Parent,)), ("Parent.qkv", (Parent,))]
    assert reads == [Parent.forward]
