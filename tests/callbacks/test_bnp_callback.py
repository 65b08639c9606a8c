"""BatchNormPreconditioning under Lightning: once per optimizer step, on the gradient the optimizer uses."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.strategies import FSDPStrategy
from torch import Tensor, nn
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_bnp import BatchNormPreconditioning, BNPPreconditioner
from tests.helpers import ACCELERATOR, EXACT, BoringClassifier, _fit, make_cnn, make_data, make_mlp, record_compiles


def plain_loop(
    network: nn.Module,
    data: Any,
    *,
    batch_size: int,
    steps: int,
    lr: float = 0.1,
    momentum: float = 0.0,
    clip_norm: float | None = None,
) -> BNPPreconditioner:
    """The reference: a hand-written loop over the same batches with the pure-torch core."""
    pre = BNPPreconditioner(network)
    opt = torch.optim.SGD(network.parameters(), lr=lr, momentum=momentum)
    batches = iter(DataLoader(data, batch_size=batch_size, shuffle=False))
    for _ in range(steps):
        x, y = next(batches)
        opt.zero_grad()
        nn.functional.cross_entropy(network(x), y).backward()
        pre.step()
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(network.parameters(), clip_norm)
        opt.step()
    return pre


def assert_same_parameters(a: nn.Module, b: nn.Module, **tol: float) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, msg=name, **tol)


@pytest.mark.parametrize("make_net", [make_mlp, make_cnn])
def test_callback_equals_plain_torch_loop(tmp_path: Path, make_net: Any) -> None:
    data = make_data(shape=(6,)) if make_net is make_mlp else make_data(shape=(2, 6, 6))
    bnp = BatchNormPreconditioning()
    model = BoringClassifier(make_net(), momentum=0.9)
    _fit(tmp_path, model, data, batch_size=16, callbacks=[bnp], max_steps=4)
    reference = make_net()
    pre = plain_loop(reference, data, batch_size=16, steps=4, momentum=0.9)
    assert_same_parameters(model.network, reference, **EXACT)
    assert bnp.preconditioner is not None
    for name, layer in pre.layers.items():
        torch.testing.assert_close(bnp.preconditioner.layers[f"network.{name}"].running.var.cpu(), layer.running.var)


def test_gradient_accumulation_equals_the_large_batch(tmp_path: Path) -> None:
    data = make_data(n=320)
    small, large = BatchNormPreconditioning(), BatchNormPreconditioning()
    model_small, model_large = BoringClassifier(make_mlp()), BoringClassifier(make_mlp())
    _fit(tmp_path, model_small, data, batch_size=8, callbacks=[small], max_steps=20, accumulate_grad_batches=2)
    _fit(tmp_path, model_large, data, batch_size=16, callbacks=[large], max_steps=20)
    assert model_small.trainer.global_step == model_large.trainer.global_step == 20
    assert_same_parameters(model_small, model_large, rtol=1e-5, atol=1e-6)
    for name, layer in large.preconditioner.layers.items():  # type: ignore[union-attr]
        other = small.preconditioner.layers[name]  # type: ignore[union-attr]
        assert other.running.steps == layer.running.steps == 20
        torch.testing.assert_close(other.running.mu, layer.running.mu, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(other.running.var, layer.running.var, rtol=1e-5, atol=1e-6)


def test_resume_is_bit_identical(tmp_path: Path) -> None:
    data = make_data(n=64)
    straight_cb = BatchNormPreconditioning()
    straight = BoringClassifier(make_mlp(), momentum=0.9)
    _fit(tmp_path / "a", straight, data, batch_size=16, callbacks=[straight_cb], max_epochs=4)

    first = BoringClassifier(make_mlp(), momentum=0.9)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    _fit(
        tmp_path / "b",
        first,
        data,
        batch_size=16,
        callbacks=[BatchNormPreconditioning(), ckpt],
        max_epochs=2,
        enable_checkpointing=True,
    )
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert "BatchNormPreconditioning" in saved["callbacks"]

    resumed_cb = BatchNormPreconditioning()
    resumed = BoringClassifier(make_mlp(seed=123), momentum=0.9)  # different init: everything must come back
    _fit(
        tmp_path / "c",
        resumed,
        data,
        batch_size=16,
        callbacks=[resumed_cb],
        max_epochs=4,
        ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"),
    )
    assert_same_parameters(straight, resumed, rtol=0, atol=0)
    for name, layer in straight_cb.preconditioner.layers.items():  # type: ignore[union-attr]
        other = resumed_cb.preconditioner.layers[name]  # type: ignore[union-attr]
        assert other.running.steps == layer.running.steps == 16
        assert torch.equal(other.running.mean_acc, layer.running.mean_acc)
        assert torch.equal(other.running.var_acc, layer.running.var_acc)


def test_bf16_mixed_keeps_float32_statistics(tmp_path: Path) -> None:
    bnp = BatchNormPreconditioning()
    model = BoringClassifier(make_mlp())
    _fit(tmp_path, model, make_data(), batch_size=16, callbacks=[bnp], max_steps=3, precision="bf16-mixed")
    reference = make_mlp()
    pre = plain_loop(reference, make_data(), batch_size=16, steps=3)
    for name, layer in bnp.preconditioner.layers.items():  # type: ignore[union-attr]
        assert layer.running.mean_acc.dtype == torch.float32
        ref = pre.layers[name.removeprefix("network.")].running
        torch.testing.assert_close(layer.running.var.cpu(), ref.var, rtol=2e-2, atol=1e-3)


class InfGradientAt(BoringClassifier):
    """Puts an inf into one gradient at a given step, so the GradScaler skips that optimizer step."""

    def __init__(self, network: nn.Module, bad_batch: int) -> None:
        super().__init__(network)
        self.bad_batch = bad_batch

    @override
    def on_after_backward(self) -> None:
        if self.trainer.fit_loop.batch_idx == self.bad_batch:
            self.network[0].weight.grad[0, 0] = float("inf")


def test_step_skipped_by_grad_scaler_leaves_statistics(tmp_path: Path) -> None:
    bnp = BatchNormPreconditioning()
    model = InfGradientAt(make_mlp(), bad_batch=2)
    # Lightning maps precision="16-mixed" to bf16 on CPU; the plugin keeps a real GradScaler
    fp16 = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1.0))
    _fit(tmp_path, model, make_data(), batch_size=16, callbacks=[bnp], max_epochs=1, plugins=[fp16])
    assert fp16.scaler.get_scale() == 0.5  # halved once from 1: exactly one step was skipped
    # 4 batches, one skipped: the optimizer stepped 3 times and so did the statistics
    assert all(layer.running.steps == 3 for layer in bnp.preconditioner.layers.values())  # type: ignore[union-attr]


class SkipsBatch(BoringClassifier):
    @override
    def training_step(self, batch: Any, batch_idx: int) -> Tensor | None:  # type: ignore[override]
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx == 1 else loss


def test_training_step_returning_none_does_not_update_statistics(tmp_path: Path) -> None:
    bnp = BatchNormPreconditioning()
    _fit(tmp_path, SkipsBatch(make_mlp()), make_data(), batch_size=16, callbacks=[bnp], max_epochs=1)
    assert all(layer.running.steps == 3 for layer in bnp.preconditioner.layers.values())  # type: ignore[union-attr]


def test_clipping_acts_on_the_preconditioned_gradient(tmp_path: Path) -> None:
    model = BoringClassifier(make_mlp())
    _fit(
        tmp_path,
        model,
        make_data(),
        batch_size=16,
        callbacks=[BatchNormPreconditioning()],
        max_steps=3,
        gradient_clip_val=0.05,
    )
    reference = make_mlp()
    plain_loop(reference, make_data(), batch_size=16, steps=3, clip_norm=0.05)
    assert_same_parameters(model.network, reference, rtol=1e-6, atol=1e-7)


class TwoOptimizers(pl.LightningModule):
    """Manual optimization; optimizer A owns layer 0 and steps every batch, B owns layer 2 and steps every other."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.network = make_mlp()

    @override
    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt_a, opt_b = self.optimizers()  # type: ignore[misc]
        x, y = batch
        self.manual_backward(nn.functional.cross_entropy(self.network(x), y))
        opt_a.step()
        opt_a.zero_grad()
        if batch_idx % 2 == 1:
            opt_b.step()
            opt_b.zero_grad()

    @override
    def configure_optimizers(self) -> Any:
        return (
            torch.optim.SGD(self.network[0].parameters(), lr=0.1),
            torch.optim.SGD(self.network[2].parameters(), lr=0.1),
        )


def test_several_optimizers_precondition_only_their_layers(tmp_path: Path) -> None:
    model = TwoOptimizers()
    bnp = BatchNormPreconditioning()
    _fit(tmp_path, model, make_data(), batch_size=16, callbacks=[bnp], max_epochs=1)

    net = make_mlp()
    pre = BNPPreconditioner(net)
    opt_a = torch.optim.SGD(net[0].parameters(), lr=0.1)
    opt_b = torch.optim.SGD(net[2].parameters(), lr=0.1)
    for i, (x, y) in enumerate(DataLoader(make_data(), batch_size=16)):
        nn.functional.cross_entropy(net(x), y).backward()
        pre.step(net[0].parameters())
        opt_a.step()
        opt_a.zero_grad()
        if i % 2 == 1:  # layer 2 pools the statistics of both batches behind its accumulated gradient
            pre.step(net[2].parameters())
            opt_b.step()
            opt_b.zero_grad()
    assert_same_parameters(model.network, net, rtol=1e-6, atol=1e-7)
    assert bnp.preconditioner.layers["network.0"].running.steps == 4  # type: ignore[union-attr]
    assert bnp.preconditioner.layers["network.2"].running.steps == 2  # type: ignore[union-attr]


def test_hooks_removed_on_teardown_and_second_fit_continues(tmp_path: Path) -> None:
    bnp = BatchNormPreconditioning()
    model = BoringClassifier(make_mlp())
    trainer = _fit(tmp_path, model, make_data(), batch_size=16, callbacks=[bnp], max_epochs=1)
    assert all(not m._forward_hooks for m in model.modules())
    trainer.fit_loop.max_epochs = 2  # second fit on the same Trainer and model
    trainer.fit(model, DataLoader(make_data(), batch_size=16))
    assert all(not m._forward_hooks for m in model.modules())
    assert bnp.preconditioner.layers["network.0"].running.steps == 8  # type: ignore[union-attr]


def test_validation_and_test_passes_do_not_touch_statistics(tmp_path: Path) -> None:
    bnp = BatchNormPreconditioning()
    model = BoringClassifier(make_mlp())
    trainer = _fit(
        tmp_path,
        model,
        make_data(),
        batch_size=16,
        callbacks=[bnp],
        max_steps=6,
        limit_val_batches=2,
        val_check_interval=2,
        num_sanity_val_steps=1,
    )
    layer = bnp.preconditioner.layers["network.0"]  # type: ignore[union-attr]
    assert layer.running.steps == 6
    before = layer.running.mean_acc.clone()
    trainer.validate(model, DataLoader(make_data(), batch_size=16), verbose=False)
    assert torch.equal(before, layer.running.mean_acc) and layer.moments is None


def test_refuses_sharded_strategies() -> None:
    trainer = SimpleNamespace(strategy=FSDPStrategy())
    with pytest.raises(
        RuntimeError,
        match=r"does not support the FSDPStrategy strategy.*Supported: a single device, DDP.*ModelParallelStrategy",
    ):
        BatchNormPreconditioning._check_strategy(trainer)  # type: ignore[arg-type]


def test_spawn_launchers_warn_that_the_main_process_gets_no_statistics() -> None:
    """Issue 15, "also measured": a checkpoint saved in the main process after a ``ddp_spawn`` fit has no
    BNP state; BNP said nothing (Weight Conditioning refuses spawn for the same reason)."""
    trainer = pl.Trainer(strategy="ddp_spawn", accelerator="cpu", devices=2, logger=False)
    with pytest.warns(UserWarning, match=r"running statistics live in the worker processes"):
        BatchNormPreconditioning._check_strategy(trainer)


@pytest.mark.parametrize(
    ("samples", "accumulate", "drop_last", "refused"),
    [(17, 1, False, True), (17, 1, True, False), (16, 1, False, False), (17, 2, False, True), (25, 2, False, False)],
)
def test_batch_statistics_refuse_a_one_sample_last_step_at_the_start(
    tmp_path: Path, samples: int, accumulate: int, drop_last: bool, refused: bool
) -> None:
    """Issue 15, "also measured": with ``statistics="batch"``, a last batch of one sample used to fail only
    at the end of epoch 0; it is refused before the first step (the last *step* counts, so with
    accumulation a one-sample batch that joins others is fine)."""
    model = BoringClassifier(make_mlp())
    loader = DataLoader(make_data(n=samples), batch_size=8, drop_last=drop_last)
    trainer = pl.Trainer(
        accelerator=ACCELERATOR, logger=False, enable_progress_bar=False, enable_checkpointing=False, max_epochs=1,
        enable_model_summary=False, accumulate_grad_batches=accumulate,
        callbacks=[BatchNormPreconditioning(statistics="batch")],
    )  # fmt: skip
    if refused:
        with pytest.raises(ValueError, match=r"statistics='batch' needs more than one row per step.*drop_last=True"):
            trainer.fit(model, loader)
        assert trainer.global_step == 0
    else:
        trainer.fit(model, loader)
        assert trainer.global_step > 0


def test_refuses_two_bnp_callbacks(tmp_path: Path) -> None:
    # the gradients would be transformed twice; Lightning refuses two callbacks with one state_key
    with pytest.raises(RuntimeError, match="more than one stateful callback of type `BatchNormPreconditioning`"):
        _fit(
            tmp_path,
            BoringClassifier(make_mlp()),
            make_data(),
            batch_size=16,
            callbacks=[BatchNormPreconditioning(), BatchNormPreconditioning()],
            max_steps=1,
        )


class WithLBFGS(BoringClassifier):
    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.LBFGS(self.parameters())


def test_refuses_lbfgs(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="cannot be used with LBFGS"):
        _fit(
            tmp_path,
            WithLBFGS(make_mlp()),
            make_data(),
            batch_size=16,
            callbacks=[BatchNormPreconditioning()],
            max_steps=1,
        )


class SplitWeightAndBias(BoringClassifier):
    @override
    def configure_optimizers(self) -> Any:
        self.automatic_optimization = False
        first = self.network[0]
        rest = [p for n, p in self.named_parameters() if n != "network.0.bias"]
        return torch.optim.SGD(rest, lr=0.1), torch.optim.SGD([first.bias], lr=0.1)


def test_refuses_weight_and_bias_in_different_optimizers(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"layer .network\.0. has its weight and bias in different optimizers"):
        _fit(
            tmp_path,
            SplitWeightAndBias(make_mlp()),
            make_data(),
            batch_size=16,
            callbacks=[BatchNormPreconditioning()],
            max_steps=1,
        )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rho": 1.5}, r"`rho` must be a finite number in \[0, 1\), got 1.5"),
        ({"eps1": -1.0}, r"`eps1` must be a finite number > 0, got -1.0"),
        ({"eps2": 0.0}, r"`eps2` must be a finite number > 0, got 0.0"),
        ({"statistics": "online"}, r"`statistics` must be 'running' or 'batch', got 'online'"),
        ({"layer_types": ["Dense"]}, r"unknown \['Dense'\]"),
        ({"include": []}, r"`include` must be None or a non-empty list of patterns, got \[\]"),
        ({"exclude": []}, r"`exclude` must be None or a non-empty list of patterns, got \[\]"),
    ],
)
def test_invalid_constructor_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BatchNormPreconditioning(**kwargs)


def test_pattern_matching_nothing_fails_at_setup(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"`include` pattern 'encoder\.\*' matches no"):
        _fit(
            tmp_path,
            BoringClassifier(make_mlp()),
            make_data(),
            batch_size=16,
            callbacks=[BatchNormPreconditioning(include=["encoder.*"])],
            max_steps=1,
        )


def test_the_callbacks_preconditioner_is_built_with_every_setting_of_the_callback(tmp_path: Path) -> None:
    """Each of the preconditioner's settings given to the callback, each other than its default
    (``sync_statistics`` defaults to True), reaches the preconditioner the callback builds: its values, and the
    layers it manages (``layer_types`` keeps the Linear head out, ``exclude`` the second convolution)."""
    settings: dict[str, Any] = dict(
        rho=0.5, eps1=0.05, eps2=1e-3, statistics="batch", bias_correction=True, layer_types=["Conv2d"],
        include=["network.*"], exclude=["network.2"], sync_statistics=False, conv_statistics="column", embeddings=True,
    )  # fmt: skip
    bnp = BatchNormPreconditioning(verbose=False, **settings)
    _fit(tmp_path, BoringClassifier(make_cnn()), make_data(shape=(2, 6, 6)), batch_size=16, callbacks=[bnp],
         max_steps=1)  # fmt: skip
    pre = bnp.preconditioner
    assert pre is not None
    assert {key: getattr(pre, key) for key in settings} == settings
    assert list(pre.layers) == ["network.0"]


def test_a_callback_reused_for_another_model_preconditions_that_one_from_fresh_statistics(tmp_path: Path) -> None:
    """A second fit of the same callback on a new model builds a preconditioner for that model: it steps as the
    plain loop does from the start (statistics μ = 0, σ² = 1, step 0), not as the first model's preconditioner."""
    data = make_data()
    bnp = BatchNormPreconditioning(verbose=False)
    first = BoringClassifier(make_mlp(seed=1))
    _fit(tmp_path, first, data, batch_size=16, callbacks=[bnp], max_steps=3)
    model = BoringClassifier(make_mlp())
    _fit(tmp_path, model, data, batch_size=16, callbacks=[bnp], max_steps=4)
    reference = make_mlp()
    pre = plain_loop(reference, data, batch_size=16, steps=4)
    assert_same_parameters(model.network, reference, **EXACT)
    assert bnp.preconditioner is not None
    for name, layer in pre.layers.items():
        ours = bnp.preconditioner.layers[f"network.{name}"]
        assert ours.module is model.network[int(name)] and ours.running.steps == 4
        torch.testing.assert_close(ours.running.var.cpu(), layer.running.var)


def test_the_callbacks_option_for_one_graph_per_step_builds_it_once_and_steps_through_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``compile_step=True`` hands the step function to ``torch.compile`` (here a recorder that runs it as given:
    mutation testing's selection compiles nothing) once, at the first step, with ``fullgraph=True``; every step runs
    through what it returned, and the fit equals the plain eager loop."""
    given, runs = record_compiles(monkeypatch)
    data = make_data()
    bnp = BatchNormPreconditioning(verbose=False, compile_step=True)
    model = BoringClassifier(make_mlp())
    _fit(tmp_path, model, data, batch_size=16, callbacks=[bnp], max_steps=3)
    assert given == [{"fullgraph": True}] and len(runs) == 3
    assert bnp.preconditioner is not None and bnp.preconditioner.step_compiled
    reference = make_mlp()
    plain_loop(reference, data, batch_size=16, steps=3)
    assert_same_parameters(model.network, reference, **EXACT)


class LoadsBNPStateAtTrainStart(pl.Callback):
    """Loads a BNP state into the callback after its ``on_fit_start`` (as Lightning restores the callbacks' state
    under ``ModelParallelStrategy``) and records the first layer's running statistics right after."""

    def __init__(self, bnp: BatchNormPreconditioning, state: dict[str, Any]) -> None:
        self.bnp, self.state = bnp, state
        self.seen: tuple[int, Tensor] | None = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.bnp.load_state_dict(self.state)
        assert self.bnp.preconditioner is not None
        running = self.bnp.preconditioner.layers["network.0"].running
        self.seen = (running.steps, running.mu.detach().cpu().clone())


def test_a_state_loaded_after_the_preconditioner_is_attached_is_applied_at_once(tmp_path: Path) -> None:
    """A BNP state loaded once the callback has attached its preconditioner for the fit goes into it at once (and is
    what the fit's steps continue from), not kept for an attach that will not come again in this fit."""
    data = make_data()
    first = BatchNormPreconditioning(verbose=False)
    _fit(tmp_path, BoringClassifier(make_mlp()), data, batch_size=16, callbacks=[first], max_steps=3)
    assert first.preconditioner is not None
    saved = first.state_dict()
    mu = first.preconditioner.layers["network.0"].running.mu.detach().cpu().clone()
    bnp = BatchNormPreconditioning(verbose=False)
    loader = LoadsBNPStateAtTrainStart(bnp, saved)
    _fit(tmp_path, BoringClassifier(make_mlp(seed=1)), data, batch_size=16, callbacks=[bnp, loader], max_steps=2)
    assert loader.seen is not None and loader.seen[0] == 3
    torch.testing.assert_close(loader.seen[1], mu, rtol=0, atol=0)
    assert bnp.preconditioner is not None and bnp.preconditioner.layers["network.0"].running.steps == 5
