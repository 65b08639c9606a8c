"""What BNP says and does when layers share a weight (tied weights, row blocks of one packed weight, a Linear its
parent uses through ``F.linear``) and when two preconditioners share one model: the whole messages (each names
the layers and the way out), where the warnings point, and tied modules pooled as one layer (issue 27
survivors of ``make_layers`` and ``BNPPreconditioner.attach``)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor, nn

from lightning_bnp.core import BNPPreconditioner, BNPWarning
from lightning_bnp.core.kinds import layer_kinds
from lightning_bnp.core.layers import make_layers
from lightning_bnp.core.model_scan import scan_model
from lightning_bnp.core.selection import DEFAULT_LAYER_TYPES
from tests.transposed import TransposedLinear

D = 4


class TiedAutoencoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec = nn.Linear(D, D), nn.Linear(D, D)
        self.dec.weight = self.enc.weight  # the biases stay separate

    def forward(self, x: Tensor) -> Tensor:
        return self.dec(torch.tanh(self.enc(x)))


def test_a_weight_tied_without_its_bias_is_refused_with_the_reason_and_the_way_out() -> None:
    with pytest.raises(ValueError) as raised:
        BNPPreconditioner(TiedAutoencoder())
    assert str(raised.value) == (
        "layers 'enc' and 'dec' share one weight but not their bias; BNP's P couples a weight with its bias "
        "(eq. 15), so a shared weight needs a shared bias (or none). Exclude one of them with `exclude`, "
        "e.g. exclude=['dec']."
    )


@pytest.mark.stack  # pins the line a warning names: outside `make mutate` (its trampolines are frames)
def test_the_warning_for_a_weight_shared_with_an_unmanaged_module_points_at_the_callers_line() -> None:
    with pytest.warns(BNPWarning, match=r"'enc' shares its weight with 'dec' \(Linear\)") as caught:
        BNPPreconditioner(TiedAutoencoder(), exclude="dec").detach()
    assert [w.filename for w in caught] == [__file__]


class TiedEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.out = nn.Embedding(7, D), nn.Linear(D, 7, bias=False)
        self.out.weight = self.emb.weight


class TiedTransposed(nn.Module):
    """A square weight used as an ``nn.Linear``'s (out, in) and as a :class:`TransposedLinear`'s (in, out)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.tr = nn.Linear(D, D, bias=False), TransposedLinear(D, D, bias=False)
        self.tr.weight = self.lin.weight  # type: ignore[assignment]


def test_a_weight_shared_by_two_kinds_is_refused_naming_both_and_embeddings_false_only_for_an_embedding() -> None:
    with pytest.raises(ValueError) as raised:
        BNPPreconditioner(TiedEmbedding(), embeddings=True)
    assert str(raised.value) == (
        "layers 'emb' (Embedding) and 'out' (Linear) share one weight but are different kinds of layer (e.g. an "
        "embedding tied to the output layer): BNP would transform the shared gradient twice, with two different "
        "P. Manage one of them: exclude=['out'] or exclude=['emb'] (or embeddings=False)."
    )
    with pytest.raises(ValueError) as raised:
        BNPPreconditioner(TiedTransposed())
    assert str(raised.value) == (
        "layers 'lin' (Linear) and 'tr' (TransposedLinear) share one weight but are different kinds of layer (e.g. "
        "an embedding tied to the output layer): BNP would transform the shared gradient twice, with two "
        "different P. Manage one of them: exclude=['tr'] or exclude=['lin']."
    )


def test_a_linear_that_a_managed_parent_uses_through_f_linear_is_not_an_unmanaged_sharer() -> None:
    """``out_proj`` holds the weight of the layer ``attn.out_proj`` (its parent feeds it): it is claimed, not a
    module sharing a managed weight behind BNP's back."""
    model = nn.Sequential(nn.MultiheadAttention(D, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error", BNPWarning)
        pre = BNPPreconditioner(model)
    assert set(pre.layers) == {"0.q", "0.k", "0.v", "0.out_proj"}


def test_make_layers_defaults_to_per_channel_statistics_without_a_decay_offset_on_the_weights_device() -> None:
    """The defaults of :func:`make_layers` (BNPPreconditioner passes its own): one statistic per input channel,
    decay ρ^t (κ = 0); the statistics live on the weight's device (``meta`` here, which no default reaches)."""
    meta = torch.device("meta")
    model = nn.Sequential(nn.Conv2d(3, 2, 5), nn.Flatten(), nn.Linear(2, 1)).to(meta)
    kinds = layer_kinds()
    layers = make_layers(
        scan_model(model, DEFAULT_LAYER_TYPES),
        {"0": (model[0], kinds["Conv2d"]), "2": (model[2], kinds["Linear"])},
        rho=0.9,
        bias_correction=True,
    )
    assert [layer.features for layer in layers.values()] == [3, 2]
    for layer in layers.values():
        assert layer.running.decay_offset == 0.0
        assert layer.running.mean_acc.device == layer.running.var_acc.device == layer.running.decay.device == meta
    assert (
        float(
            make_layers(
                scan_model(nn.Linear(2, 1), DEFAULT_LAYER_TYPES),
                {"": (nn.Linear(2, 1), kinds["Linear"])},
                rho=0.9,
                bias_correction=False,
            )[""].running.decay.to("cpu")
        )
        == 1.0
    )  # ρ^0 + 0


class TiedAttention(nn.Module):
    """Two attention modules sharing their packed q, k, v weight and bias: one q, k and v layer, pooled."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.a, self.b = nn.MultiheadAttention(D, 2).double(), nn.MultiheadAttention(D, 2).double()
        if tied:
            self.b.in_proj_weight, self.b.in_proj_bias = self.a.in_proj_weight, self.a.in_proj_bias
        self.tied = tied

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        second = self.b if self.tied else self.a  # the reference: one module called twice
        return self.a(x, x, x)[0].sum() + second(y, y, y)[0].sum()


def test_tied_attention_modules_are_one_layer_pooled_like_one_module_called_twice() -> None:
    torch.manual_seed(0)
    tied, once = TiedAttention(tied=True), TiedAttention(tied=False)
    once.load_state_dict(tied.state_dict())
    pre, pre_once = BNPPreconditioner(tied), BNPPreconditioner(once)
    assert pre.layers["a.q"].modules == {"a.q": tied.a, "b.q": tied.b}
    x, y = torch.randn(3, 2, D, dtype=torch.float64), torch.randn(5, 2, D, dtype=torch.float64) * 3 + 1
    for model, p in ((tied, pre), (once, pre_once)):
        model(x, y).backward()
        p.step()
    for block in "qkv":
        running, reference = pre.layers[f"a.{block}"].running, pre_once.layers[f"a.{block}"].running
        assert running.steps == reference.steps == 1
        torch.testing.assert_close(running.mu, reference.mu, rtol=1e-12, atol=0)
        torch.testing.assert_close(running.var, reference.var, rtol=1e-12, atol=0)


def test_a_second_preconditioner_on_a_managed_model_is_refused_with_the_way_out() -> None:
    model = nn.Sequential(nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 1))
    first = BNPPreconditioner(model)
    with pytest.raises(RuntimeError) as raised:
        BNPPreconditioner(model)
    assert str(raised.value) == (
        "layers ['0', '2'] are already managed by another attached BNPPreconditioner (or "
        "BatchNormPreconditioning callback); two would transform the gradients twice. Call `.detach()` on the "
        "other one first."
    )
    first.detach()


@pytest.mark.parametrize("model", ["autoencoder", "embedding"])
def test_a_frozen_weight_shared_with_an_unmanaged_module_is_not_warned_about(model: str) -> None:
    """Issue 45 item 8: GPT-2 under peft LoRA ties a frozen lm_head to a frozen wte; no gradient is shared, so
    "shares its weight" warned at every construction for nothing. The same tie, trainable, still warns."""
    for frozen in (True, False):
        if model == "embedding":  # embeddings=False: the Embedding 'emb' is not managed, the Linear 'out' is
            net: nn.Module = TiedEmbedding()
            shared_weight, kwargs, expected = net.emb.weight, {}, "'out' shares its weight with 'emb' (Embedding)"
        else:
            net = TiedAutoencoder()
            shared_weight, kwargs, expected = net.enc.weight, {"exclude": "dec"}, "'enc' shares its weight with 'dec'"
        shared_weight.requires_grad_(not frozen)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            BNPPreconditioner(net, **kwargs).detach()
        shared = [str(w.message) for w in caught if "shares its weight" in str(w.message)]
        if frozen:
            assert shared == []
        else:
            assert len(shared) == 1 and expected in shared[0]
