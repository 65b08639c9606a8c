"""Issue 29 through Lightning: a user-registered layer kind (a linear layer stored (in, out), tests/transposed.py)
under BatchNormPreconditioning equals BNP on the ``nn.Linear`` twin, resumes from a checkpoint, is named in
``layer_types`` from a LightningCLI YAML file, and the setup line names what BNP leaves alone."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_bnp import BatchNormPreconditioning, ZSpaceRegularization
from tests.helpers import BoringClassifier, _fit, make_data, make_mlp
from tests.transposed import TransposedClassifier, TransposedLinear, as_linear_parameters, make_transposed_mlp


def parameters(model: nn.Module) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_callback_on_a_registered_kind_equals_the_nn_linear_twin(tmp_path: Path) -> None:
    data = make_data(n=64)
    runs = []
    for make in (make_mlp, make_transposed_mlp):
        bnp = BatchNormPreconditioning()
        model = BoringClassifier(make(), momentum=0.9)
        _fit(tmp_path, model, data, batch_size=16, callbacks=[bnp], max_steps=6)
        assert bnp.preconditioner is not None and list(bnp.preconditioner.layers) == ["network.0", "network.2"]
        runs.append((as_linear_parameters(parameters(model), model), bnp.preconditioner.state_dict()))
    (linear, linear_state), (got, state) = runs
    assert isinstance(model.network[0], TransposedLinear)
    for name, value in linear.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
    for name, layer in linear_state["layers"].items():
        assert state["layers"][name]["steps"] == layer["steps"] == 6
        torch.testing.assert_close(state["layers"][name]["var_acc"], layer["var_acc"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "regularization", [{"weight_decay": 0.05}, {"weight_decay": 0.05, "decay_space": "p"}, {"gradient_penalty": 0.1}]
)
def test_z_space_regularization_maps_a_registered_kinds_vectors_through_its_rows(
    tmp_path: Path, regularization: dict[str, float]
) -> None:
    """z-space weight decay and gradient penalty apply BNP's M to weight-shaped vectors (and the bias part of
    ∇_z λ‖z_w‖² from the weight's rows): a weight stored transposed must give the nn.Linear twin's result."""
    data = make_data(n=48)
    runs = []
    for make in (make_mlp, make_transposed_mlp):
        model = BoringClassifier(make(), momentum=0.9)
        callbacks = [BatchNormPreconditioning(), ZSpaceRegularization(**regularization)]  # type: ignore[arg-type]
        _fit(tmp_path, model, data, batch_size=16, callbacks=callbacks, max_steps=3)
        runs.append(as_linear_parameters(parameters(model), model))
    for name, value in runs[0].items():
        torch.testing.assert_close(runs[1][name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_a_registered_kind_resumes_from_a_checkpoint_bit_identically(tmp_path: Path) -> None:
    data = make_data(n=64)
    straight_cb = BatchNormPreconditioning()
    straight = BoringClassifier(make_transposed_mlp(), momentum=0.9)
    _fit(tmp_path / "a", straight, data, batch_size=16, callbacks=[straight_cb], max_epochs=4)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    first = BoringClassifier(make_transposed_mlp(), momentum=0.9)
    _fit(tmp_path / "b", first, data, batch_size=16, callbacks=[BatchNormPreconditioning(), ckpt], max_epochs=2,
         enable_checkpointing=True)  # fmt: skip
    resumed_cb = BatchNormPreconditioning()
    resumed = BoringClassifier(make_transposed_mlp(seed=123), momentum=0.9)
    _fit(tmp_path / "c", resumed, data, batch_size=16, callbacks=[resumed_cb], max_epochs=4,
         ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))  # fmt: skip
    for (name, p), q in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name
    for name, layer in straight_cb.preconditioner.layers.items():  # type: ignore[union-attr]
        other = resumed_cb.preconditioner.layers[name]  # type: ignore[union-attr]
        assert other.running.steps == layer.running.steps == 16
        assert torch.equal(other.running.var_acc, layer.running.var_acc)


def test_layer_types_names_a_registered_kind_in_a_lightning_cli_yaml(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n"
        "  callbacks:\n"
        "    - class_path: lightning_bnp.BatchNormPreconditioning\n"
        "      init_args:\n"
        "        layer_types: [TransposedLinear]\n"
        "        exclude: network.2\n"
    )
    cli = LightningCLI(TransposedClassifier, run=False, save_config_callback=None,
                       args=["--config", str(config), "--trainer.max_steps=2", "--trainer.logger=false",
                             f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_checkpointing=false",
                             "--trainer.enable_progress_bar=false", "--trainer.accelerator=cpu"])  # fmt: skip
    (bnp,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, BatchNormPreconditioning)]  # type: ignore[attr-defined]
    assert bnp.layer_types == ["TransposedLinear"]
    x, y = make_data(n=32).tensors
    cli.trainer.fit(cli.model, DataLoader(list(zip(x, y)), batch_size=16))
    assert bnp.preconditioner is not None and list(bnp.preconditioner.layers) == ["network.0"]
    assert bnp.preconditioner.layers["network.0"].running.steps == 2
    assert bnp.preconditioner.skipped == {"network.2.weight": "excluded by `exclude` pattern 'network.2'"}


class Affine(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.matrix = nn.Parameter(torch.randn(8, 3))

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.matrix


def test_the_setup_line_names_the_weight_matrices_bnp_leaves_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    network = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), Affine())
    with caplog.at_level(logging.INFO):
        _fit(tmp_path, BoringClassifier(network), make_data(), batch_size=16, max_steps=1,
             callbacks=[BatchNormPreconditioning()])  # fmt: skip
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("BatchNormPreconditioning: BNP")]
    assert lines == [
        "BatchNormPreconditioning: BNP manages 1 layers: ['network.0']; BNP transforms 1 of the model's 2 trainable "
        "weight matrices; it leaves alone network.2.matrix (unknown layer type "
        "tests.callbacks.test_layer_kinds_callback.Affine (teach BNP with register_layer_kind))"
    ]


# ----------------------------------------------------------------------------- issue 24: attention
class AttentionNet(nn.Module):
    """Self-attention over 4 tokens of 8 features, mean-pooled, and a Linear head."""

    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.attention, self.head = attention, nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = x.view(x.shape[0], 4, 8)
        return self.head(self.attention(h, h, h, None, None).mean(1))


def attention_pair() -> tuple[nn.Module, nn.Module]:
    from tests.core.test_attention import Twin, Wrapped

    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    with torch.no_grad():
        mha.in_proj_bias.normal_()
    mha_net, twin_net = AttentionNet(Wrapped(mha, need_weights=False)), AttentionNet(Twin(mha))
    twin_net.head.load_state_dict(mha_net.head.state_dict())
    return mha_net, twin_net


def as_twin_parameters(model: BoringClassifier) -> dict[str, Tensor]:
    """The MultiheadAttention's parameters under the twin's names."""
    mha = model.network.attention.attn
    q, k, v = mha.in_proj_weight.detach().split(8)
    qb, kb, vb = mha.in_proj_bias.detach().split(8)
    out = {"network.head.weight": model.network.head.weight, "network.head.bias": model.network.head.bias}
    out |= {"network.attention.q.weight": q, "network.attention.k.weight": k, "network.attention.v.weight": v}
    out |= {"network.attention.q.bias": qb, "network.attention.k.bias": kb, "network.attention.v.bias": vb}
    out |= {"network.attention.o.weight": mha.out_proj.weight, "network.attention.o.bias": mha.out_proj.bias}
    return {name: t.detach().clone() for name, t in out.items()}


@pytest.mark.parametrize(
    ("regularization", "accumulate"),
    [(None, 1), (None, 2), ({"weight_decay": 0.05}, 1), ({"weight_decay": 0.05, "decay_space": "p"}, 1)],
)
def test_callback_on_multihead_attention_equals_the_four_linear_twin(
    tmp_path: Path, regularization: dict[str, float] | None, accumulate: int
) -> None:
    """Issue 24 item 1 through Lightning, with gradient accumulation and z- and p-space weight decay: the q, k, v
    blocks of one packed weight each map their own rows (and their own slice of the packed bias)."""
    data = make_data(n=48, shape=(32,))
    runs = []
    for network in attention_pair():
        model = BoringClassifier(network, momentum=0.9)
        callbacks: list = [BatchNormPreconditioning()]
        if regularization is not None:
            callbacks.append(ZSpaceRegularization(**regularization))  # type: ignore[arg-type]
        _fit(tmp_path, model, data, batch_size=16, callbacks=callbacks, max_steps=4, accumulate_grad_batches=accumulate)
        assert len(callbacks[0].preconditioner.layers) == 5
        runs.append(model)
    mha_model, twin_model = runs
    twin = parameters(twin_model)
    for name, value in as_twin_parameters(mha_model).items():
        torch.testing.assert_close(value, twin[name], rtol=1e-5, atol=1e-6, msg=name)


# ----------------------------------------------------------------------------- issue 24: nn.Embedding
class BagOfTokens(nn.Module):
    """Token embeddings (``nn.Embedding``, or its bias-free one-hot Linear twin), mean over positions, a head."""

    def __init__(self, one_hot: bool = False, seed: int = 0, padding_idx: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb: nn.Module = nn.Embedding(13, 6, padding_idx=padding_idx)
        self.head = nn.Linear(6, 3)
        if one_hot:
            weight = self.emb.weight.detach().t().clone()  # type: ignore[union-attr]
            self.emb = nn.Linear(13, 6, bias=False)
            with torch.no_grad():
                self.emb.weight.copy_(weight)
        self.one_hot = one_hot

    def forward(self, x: Tensor) -> Tensor:
        h = self.emb(nn.functional.one_hot(x, 13).float() if self.one_hot else x)
        return self.head(torch.tanh(h).mean(1))


def token_data(n: int = 64) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.multinomial(torch.linspace(3.0, 0.2, 13), n * 5, replacement=True, generator=g).view(n, 5)
    return torch.utils.data.TensorDataset(x, torch.randint(0, 3, (n,), generator=g))


def test_callback_with_embeddings_equals_the_one_hot_linear_twin(tmp_path: Path) -> None:
    runs = []
    for one_hot in (False, True):
        bnp = BatchNormPreconditioning(embeddings=not one_hot)
        model = BoringClassifier(BagOfTokens(one_hot), momentum=0.9)
        _fit(tmp_path, model, token_data(), batch_size=16, callbacks=[bnp], max_steps=6, accumulate_grad_batches=1)
        assert bnp.preconditioner is not None and list(bnp.preconditioner.layers) == ["network.emb", "network.head"]
        runs.append((model.network, bnp.preconditioner.state_dict()))
    (net, state), (twin, twin_state) = runs
    torch.testing.assert_close(net.emb.weight, twin.emb.weight.t(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(net.head.weight, twin.head.weight, rtol=1e-6, atol=1e-7)
    for name, layer in twin_state["layers"].items():
        assert state["layers"][name]["steps"] == layer["steps"] == 6
        torch.testing.assert_close(state["layers"][name]["var_acc"], layer["var_acc"], rtol=1e-6, atol=1e-7)


def test_callback_with_embeddings_resumes_from_a_checkpoint_bit_identically(tmp_path: Path) -> None:
    data = token_data()
    straight_cb = BatchNormPreconditioning(embeddings=True)
    straight = BoringClassifier(BagOfTokens(), momentum=0.9)
    _fit(tmp_path / "a", straight, data, batch_size=16, callbacks=[straight_cb], max_epochs=4)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    first = BoringClassifier(BagOfTokens(), momentum=0.9)
    _fit(tmp_path / "b", first, data, batch_size=16, callbacks=[BatchNormPreconditioning(embeddings=True), ckpt],
         max_epochs=2, enable_checkpointing=True)  # fmt: skip
    resumed_cb = BatchNormPreconditioning(embeddings=True)
    resumed = BoringClassifier(BagOfTokens(seed=123), momentum=0.9)
    _fit(tmp_path / "c", resumed, data, batch_size=16, callbacks=[resumed_cb], max_epochs=4,
         ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))  # fmt: skip
    for (name, p), q in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name
    layer, other = straight_cb.preconditioner.layers["network.emb"], resumed_cb.preconditioner.layers["network.emb"]  # type: ignore[union-attr]
    assert other.running.steps == layer.running.steps == 16
    assert torch.equal(other.running.var_acc, layer.running.var_acc)
    # the embedding's statistics do not load into a run that leaves embeddings alone
    with pytest.raises(ValueError, match=r"unexpected \['network.emb'\]"):
        _fit(tmp_path / "d", BoringClassifier(BagOfTokens()), data, batch_size=16, max_epochs=4,
             callbacks=[BatchNormPreconditioning()], ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))  # fmt: skip


class TokenClassifier(BoringClassifier):
    def __init__(self) -> None:
        super().__init__(BagOfTokens())


def test_embeddings_are_switched_on_from_a_lightning_cli_yaml(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        "trainer:\n"
        "  callbacks:\n"
        "    - class_path: lightning_bnp.BatchNormPreconditioning\n"
        "      init_args:\n"
        "        embeddings: true\n"
    )
    cli = LightningCLI(TokenClassifier, run=False, save_config_callback=None,
                       args=["--config", str(config), "--trainer.max_steps=2", "--trainer.logger=false",
                             f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_checkpointing=false",
                             "--trainer.enable_progress_bar=false", "--trainer.accelerator=cpu"])  # fmt: skip
    (bnp,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, BatchNormPreconditioning)]  # type: ignore[attr-defined]
    assert bnp.embeddings is True and "embeddings=True" in repr(bnp)
    cli.trainer.fit(cli.model, DataLoader(token_data(32), batch_size=16))
    assert bnp.preconditioner is not None and list(bnp.preconditioner.layers) == ["network.emb", "network.head"]
    assert bnp.preconditioner.layers["network.emb"].running.steps == 2
    caplog.clear()
    with caplog.at_level(logging.INFO):  # off by default: the setup line names the embedding and why
        _fit(tmp_path, TokenClassifier(), token_data(16), batch_size=16, max_steps=1,
             callbacks=[BatchNormPreconditioning()])  # fmt: skip
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("BatchNormPreconditioning: BNP")]
    assert lines == [
        "BatchNormPreconditioning: BNP manages 1 layers: ['network.head']; BNP transforms 1 of the model's 2 trainable "
        "weight matrices; it leaves alone network.emb.weight (embedding (embeddings=False))"
    ]
