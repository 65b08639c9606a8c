"""WeightConditioning under Lightning: set up before the optimizer, idempotent across stages,
checkpoints, BNP on top, AMP, strategies."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.data import DataLoader

from example_projects.models import cnn5
from lightning_bnp.callbacks.bnp import BatchNormPreconditioning
from lightning_bnp.callbacks.weight_conditioning import WeightConditioning
from lightning_bnp.core.conditioning import apply_weight_conditioning, conditioned_layers
from lightning_bnp.core.preconditioner import BNPPreconditioner
from tests.helpers import ACCELERATOR, EXACT, BoringClassifier, _fit, make_cnn, make_data, make_mlp


def plain_loop(network: nn.Module, data: Any, *, steps: int, bnp: bool = False, **wc: Any) -> nn.Module:
    """The reference: the same batches through plain torch with the core functions."""
    apply_weight_conditioning(network, **wc)
    pre = BNPPreconditioner(network) if bnp else None
    opt = torch.optim.SGD(network.parameters(), lr=0.1, momentum=0.9)
    batches = iter(DataLoader(data, batch_size=16, shuffle=False))
    for _ in range(steps):
        x, y = next(batches)
        opt.zero_grad()
        nn.functional.cross_entropy(network(x), y).backward()
        if pre is not None:
            pre.step()
        opt.step()
    return network


def assert_same_parameters(a: nn.Module, b: nn.Module) -> None:
    named_a, named_b = dict(a.named_parameters()), dict(b.named_parameters())
    assert list(named_a) == list(named_b)
    for name, p in named_a.items():
        torch.testing.assert_close(p, named_b[name], **EXACT, msg=name)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "rows"}, r"`mode` must be one of \['row', 'column', 'row_column'\], got 'rows'"),
        ({"layers": "last"}, r"`layers` must be 'all' or 'first_and_last', got 'last'"),
        ({"eps": -1.0}, r"`eps` must be a finite number > 0, got -1.0"),
        ({"eps": float("nan")}, r"`eps` must be a finite number > 0, got nan"),
        ({"layer_types": []}, r"`layer_types` must name at least one layer type, got \[\]"),
        ({"layer_types": ["Conv4d"]}, r"`layer_types` must be a subset of .* got unknown \['Conv4d'\]"),
        ({"include": []}, r"`include` must be None or a non-empty list of patterns, got \[\]"),
        ({"exclude": []}, r"`exclude` must be None or a non-empty list of patterns, got \[\]"),
    ],
)
def test_invalid_arguments_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        WeightConditioning(**kwargs)


def test_a_pattern_matching_nothing_is_refused_at_setup(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"`include` pattern 'decoder\.\*' matches no"):
        _fit(tmp_path, BoringClassifier(make_mlp()), make_data(), batch_size=16,
             callbacks=[WeightConditioning(include=["decoder.*"])], max_steps=1)  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "make_net", "shape"),
    [({"mode": "row"}, make_mlp, (6,)), ({"mode": "row_column", "layers": "first_and_last"}, make_cnn, (2, 6, 6))],
)
def test_callback_equals_plain_torch_loop(tmp_path: Path, kwargs: dict, make_net: Any, shape: tuple) -> None:
    data = make_data(shape=shape)
    model = BoringClassifier(make_net(), momentum=0.9)
    _fit(tmp_path, model, data, batch_size=16, callbacks=[WeightConditioning(**kwargs)], max_steps=4)
    assert_same_parameters(model.network, plain_loop(make_net(), data, steps=4, **kwargs))


def test_first_and_last_is_the_papers_cnn_recipe(tmp_path: Path) -> None:
    wc = WeightConditioning(layers="first_and_last")
    model = BoringClassifier(cnn5(image_size=8, padding="same"))
    _fit(tmp_path, model, make_data(shape=(1, 8, 8), classes=10), batch_size=16, callbacks=[wc], max_steps=1)
    assert wc.conditioned == ["network.0", "network.11"]  # first Conv2d, last Linear
    assert set(conditioned_layers(model)) == set(wc.conditioned)


def test_fit_twice_then_validate_and_test_reuse_the_parametrization(tmp_path: Path) -> None:
    class WithTestStep(BoringClassifier):
        def test_step(self, batch: Any, batch_idx: int) -> None:
            self.validation_step(batch, batch_idx)

    wc = WeightConditioning(mode="column")
    model, data = WithTestStep(make_mlp()), make_data()
    trainer = _fit(tmp_path, model, data, batch_size=16, callbacks=[wc], max_epochs=1, limit_val_batches=1.0)
    keys = list(model.state_dict())
    trainer.fit_loop.max_epochs = 2
    trainer.fit(model, DataLoader(data, batch_size=16))
    assert trainer.global_step == 8
    (val,) = trainer.validate(model, DataLoader(data, batch_size=64), verbose=False)
    (test,) = trainer.test(model, DataLoader(data, batch_size=64), verbose=False)
    assert val["val_loss"] == test["val_loss"] and math.isfinite(val["val_loss"])
    assert list(model.state_dict()) == keys
    assert all(len(m.parametrizations.weight) == 1 for m in model.modules() if parametrize.is_parametrized(m))


def test_resume_is_bit_identical(tmp_path: Path) -> None:
    data = make_data(n=64)
    straight = BoringClassifier(make_mlp(), momentum=0.9)
    _fit(tmp_path / "a", straight, data, batch_size=16, callbacks=[WeightConditioning()], max_epochs=4)

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    _fit(tmp_path / "b", BoringClassifier(make_mlp(), momentum=0.9), data, batch_size=16,
         callbacks=[WeightConditioning(), ckpt], max_epochs=2, enable_checkpointing=True)  # fmt: skip
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert "network.0.parametrizations.weight.original" in saved["state_dict"]
    (state,) = [v for k, v in saved["callbacks"].items() if k.startswith("WeightConditioning")]
    assert state == {"mode": "row", "eps": 1e-12, "layers": ["network.0", "network.2"]}

    resumed = BoringClassifier(make_mlp(seed=123), momentum=0.9)  # different init: everything must come back
    _fit(tmp_path / "c", resumed, data, batch_size=16, callbacks=[WeightConditioning()], max_epochs=4,
         ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))  # fmt: skip
    assert_same_parameters(straight, resumed)


def test_checkpoint_loads_for_validation_and_refuses_another_mode(tmp_path: Path) -> None:
    data = make_data(n=64)
    trained = BoringClassifier(make_mlp(), momentum=0.9)
    trainer = _fit(tmp_path, trained, data, batch_size=16, callbacks=[WeightConditioning()], max_epochs=1)
    path = tmp_path / "wc.ckpt"
    trainer.save_checkpoint(path)
    loader = DataLoader(data, batch_size=64)

    def validator(**wc: Any) -> pl.Trainer:
        return pl.Trainer(
            accelerator=ACCELERATOR, logger=False, enable_progress_bar=False, callbacks=[WeightConditioning(**wc)]
        )

    expected = validator().validate(trained, loader, verbose=False)[0]["val_loss"]
    got = validator().validate(BoringClassifier(make_mlp(seed=5)), loader, ckpt_path=path, verbose=False)
    assert got[0]["val_loss"] == expected
    with pytest.raises(ValueError, match=r"written with WeightConditioning\(mode='row'\).*uses mode='column'"):
        validator(mode="column").validate(BoringClassifier(make_mlp()), loader, ckpt_path=path, verbose=False)


def test_checkpoint_to_a_plain_model_for_inference(tmp_path: Path) -> None:
    """The documented recipe: rebuild the setup from the callback state, load, bake."""
    data = make_data(n=64)
    trained = BoringClassifier(make_mlp())
    trainer = _fit(tmp_path, trained, data, batch_size=16, callbacks=[WeightConditioning(layers="first_and_last",
                   mode="row_column")], max_epochs=1)  # fmt: skip
    trainer.save_checkpoint(tmp_path / "wc.ckpt")

    ckpt = torch.load(tmp_path / "wc.ckpt", weights_only=True)
    state = next(v for k, v in ckpt["callbacks"].items() if k.startswith("WeightConditioning"))
    model = BoringClassifier(make_mlp(seed=3))
    apply_weight_conditioning(model, mode=state["mode"], eps=state["eps"], include=state["layers"])
    model.load_state_dict(ckpt["state_dict"])
    assert WeightConditioning.bake(model) == ["network.0", "network.2"]
    x = data.tensors[0]
    assert torch.equal(model(x), trained(x)) and not any(parametrize.is_parametrized(m) for m in model.modules())


@pytest.mark.parametrize("wc_first", [True, False])
def test_bnp_preconditions_the_free_parameter(tmp_path: Path, wc_first: bool) -> None:
    """With both callbacks, BNP's M = (1/q²)·P·Pᵀ (from the layer's inputs) acts on the gradient of
    ``parametrizations.weight.original``; the callback order does not matter."""
    data = make_data(shape=(2, 6, 6), n=96)
    callbacks: list[pl.Callback] = [WeightConditioning(mode="row"), BatchNormPreconditioning()]
    model = BoringClassifier(make_cnn(), momentum=0.9)
    trainer = _fit(tmp_path, model, data, batch_size=16, callbacks=callbacks if wc_first else callbacks[::-1],
                   max_steps=6)  # fmt: skip
    reference = plain_loop(make_cnn(), data, steps=6, bnp=True, mode="row")
    assert_same_parameters(model.network, reference)
    bnp = trainer.callbacks[1 if wc_first else 0]
    assert isinstance(bnp, BatchNormPreconditioning) and bnp.preconditioner is not None
    assert all(layer.running.steps == 6 for layer in bnp.preconditioner.layers.values())
    x, y = data.tensors
    start = make_cnn()
    apply_weight_conditioning(start, mode="row")
    with torch.no_grad():  # it trains
        assert nn.functional.cross_entropy(model.network(x), y) < nn.functional.cross_entropy(start(x), y)


def test_bf16_mixed_trains_with_finite_loss(tmp_path: Path) -> None:
    class LoggingClassifier(BoringClassifier):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            self.log("loss", loss)
            return loss

    model = LoggingClassifier(make_cnn())
    trainer = _fit(tmp_path, model, make_data(shape=(2, 6, 6)), batch_size=16, precision="bf16-mixed",
                   callbacks=[WeightConditioning(mode="row_column")], max_epochs=3)  # fmt: skip
    assert torch.isfinite(trainer.callback_metrics["loss"])
    assert trainer.callback_metrics["loss"] < 1.2  # log(3) = 1.10 at chance; it learns something
    assert model.network[0].parametrizations.weight.original.dtype == torch.float32


def test_two_instances_condition_disjoint_layers(tmp_path: Path) -> None:
    convs = WeightConditioning(layer_types=["Conv2d"])
    dense = WeightConditioning(mode="column", layer_types=["Linear"])
    model = BoringClassifier(make_cnn())
    _fit(tmp_path, model, make_data(shape=(2, 6, 6)), batch_size=16, callbacks=[convs, dense], max_steps=1)
    layers = conditioned_layers(model)
    assert {name: eq.mode for name, eq in layers.items()} == {
        "network.0": "row",
        "network.2": "row",
        "network.5": "column",
    }
    assert convs.state_key != dense.state_key


def test_warnings_for_zero_init_and_unoptimized_weights(tmp_path: Path) -> None:
    class FrozenHead(BoringClassifier):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.network[0].parameters(), lr=0.1)

    net = make_mlp()
    nn.init.zeros_(net[2].weight)
    with pytest.warns(UserWarning, match=r"'network\.2' has 3 all-zero weight vectors"):
        with pytest.warns(UserWarning, match=r"network\.2\.parametrizations\.weight\.original is trainable"):
            _fit(tmp_path, FrozenHead(net), make_data(), batch_size=16, callbacks=[WeightConditioning(mode="column")],
                 max_steps=1)  # fmt: skip


def test_unsupported_strategies_are_refused() -> None:
    with pytest.raises(RuntimeError, match=r"does not support the FSDPStrategy strategy"):
        WeightConditioning._check_strategy(SimpleNamespace(strategy=FSDPStrategy()))  # type: ignore[arg-type]
    # spawn/fork: the main process reloads the worker's weights with strict=False and would silently
    # keep its untrained weights under the plain `weight` keys
    spawn = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", logger=False)
    with pytest.raises(RuntimeError, match=r"does not support spawn/fork launchers"):
        WeightConditioning().setup(spawn, BoringClassifier(make_mlp()), "fit")


@pytest.mark.slow
def test_fit_of_a_compiled_module_equals_eager(tmp_path: Path) -> None:
    """``trainer.fit(torch.compile(model))``: Lightning unwraps the module, the callback parametrizes it
    at setup and the strategy compiles it again; the result matches the eager run."""
    try:
        torch.compile(lambda t: t * 2 + 1)(torch.ones(2))
    except Exception as err:  # no C++ toolchain for inductor on this machine
        pytest.skip(f"torch.compile does not work here: {type(err).__name__}: {err}"[:300])
    data = make_data(shape=(2, 6, 6))
    eager, compiled = BoringClassifier(make_cnn()), BoringClassifier(make_cnn())
    _fit(tmp_path / "e", eager, data, batch_size=16, callbacks=[WeightConditioning(mode="row_column")], max_steps=2)
    _fit(tmp_path / "c", torch.compile(compiled), data, batch_size=16,  # type: ignore[arg-type]
         callbacks=[WeightConditioning(mode="row_column")], max_steps=2)  # fmt: skip
    assert set(conditioned_layers(compiled)) == {"network.0", "network.2", "network.5"}
    for name, p in eager.named_parameters():
        torch.testing.assert_close(dict(compiled.named_parameters())[name], p, msg=name)
