"""ConditionNumberMonitor and TimingMonitor: tags in TensorBoard, exact κ, and no effect on training."""

from __future__ import annotations

import copy
import csv
import io
import math
import random
import re
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar
from unittest import mock

import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from torch import Tensor, nn
from torch.nn.utils import parametrize
from typing_extensions import override

from lightning_bnp.callbacks import _probes as probes
from lightning_bnp.callbacks import timing_monitor
from lightning_bnp.callbacks._logging import MAX_CHARTS, heatmap_image, layer_charts, log_metrics
from lightning_bnp.callbacks._pictures import heatmap_picture
from lightning_bnp.callbacks.bnp import BatchNormPreconditioning
from lightning_bnp.callbacks.condition_monitor import ConditionNumberMonitor
from lightning_bnp.callbacks.timing_monitor import TimingMonitor
from lightning_bnp.core.conditioning import Equilibration
from tests.helpers import BoringClassifier, _fit, make_cnn, make_data, make_mlp


class LoggingClassifier(BoringClassifier):
    """Logs inside ``training_step`` (the probes must not log again), draws from NumPy's and Python's
    global RNGs (the probes must restore them) and returns a dict."""

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Any:  # type: ignore[override]
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return {"loss": loss + 0.0 * (np.random.rand() + random.random())}


def bn_net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.BatchNorm1d(8), nn.Dropout(0.2), nn.Linear(8, 3))


def tanh_net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def scalars(trainer: Any) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(trainer.logger.log_dir)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def events(trainer: Any) -> EventAccumulator:
    """Every histogram, image and tensor (text, layout) record of the run (the default keeps only a few)."""
    acc = EventAccumulator(trainer.logger.log_dir, size_guidance={"histograms": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc


def everything_on(**kwargs: Any) -> ConditionNumberMonitor:
    return ConditionNumberMonitor(lanczos=True, lanczos_iters=5, landscape=True, **kwargs)


def test_tags_are_logged_grouped_by_kind_and_layer_and_finite(tmp_path: Path) -> None:
    net = bn_net()
    # Weight Conditioning (BNP leaves any other parametrization alone: README "Reparametrized layers")
    parametrize.register_parametrization(net[0], "weight", Equilibration("row"))
    callbacks = [everything_on(every_n_steps=2), BatchNormPreconditioning(), TimingMonitor(every_n_steps=2)]
    trainer = _fit(tmp_path, LoggingClassifier(net), make_data(), batch_size=16, callbacks=callbacks, max_steps=4,
                   logger=TensorBoardLogger(tmp_path))  # fmt: skip
    logged = scalars(trainer)
    expected = {
        *(f"bnp/kappa_D/network.{i}" for i in (0, 4)),
        "bnp/weight_kappa/network.0/raw",
        "bnp/weight_kappa/network.0/conditioned",
        "bnp/weight_kappa/network.4/raw",
        "bnp/hessian_kappa/network.4/original",  # default: the last BNP layer (the paper's Fig. 8)
        "bnp/hessian_kappa/network.4/preconditioned",
        "bnp/hessian_min_ratio/network.4/original",
        "bnp/hessian_min_ratio/network.4/preconditioned",
        "bnp/hessian_rank/network.4",
        "bnp/lanczos/lambda_min",
        "bnp/lanczos/lambda_max",
        *(f"bnp/landscape/{k}" for k in ("loss_range", "grad_change", "beta_smoothness")),
        *(f"timing/{k}" for k in ("step_ms", "bnp_ms", "bnp_transform_ms", "bnp_statistics_ms", "samples_per_sec")),
        "timing/callbacks/ConditionNumberMonitor_ms",
        "timing/callbacks/BatchNormPreconditioning_ms",
    }
    assert expected <= set(logged), expected - set(logged)
    assert "bnp/effective_lr/network.4" not in logged and "bnp/weight_kappa/network.4/conditioned" not in logged
    # Linear → ReLU → BatchNorm1d, but E(c·W) = E(W) (equilibration) while b scales: (W, b) is not scale-invariant
    assert not [tag for tag in logged if tag.startswith(("bnp/effective_lr", "bnp/weight_norm_sq"))]
    for tag in expected:
        assert [step for step, _ in logged[tag]] == [0, 2], tag
        assert all(math.isfinite(v) for _, v in logged[tag]), tag
    assert all(v > 0 for tag in ("step_ms", "bnp_ms", "bnp_statistics_ms") for _, v in logged[f"timing/{tag}"])
    assert all(v >= 1 for _, v in logged["bnp/kappa_D/network.0"])


def var_tilde_ref(var: Tensor) -> Tensor:
    """σ̃² = σ² + ε1·max σ² + ε2 with BNP's defaults."""
    var = var.double().cpu()  # (the statistics live on the test accelerator; the references on the CPU)
    return var + 1e-2 * var.max() + 1e-4


def explicit_p(mu: Tensor, var_t: Tensor, kernel_volume: int = 1) -> Tensor:
    """P = [[1, −μᵀ⊗e], [0, I]]·diag(1, 1/σ̃⊗e) written out (paper 000, eq. 12; §4 for the kernel)."""
    inv = var_t.double().cpu().rsqrt().repeat_interleave(kernel_volume)
    u = torch.eye(inv.numel() + 1, dtype=torch.float64)
    u[0, 1:] = -mu.double().cpu().repeat_interleave(kernel_volume)
    return u @ torch.diag(torch.cat([torch.ones(1, dtype=torch.float64), inv]))


def kappa(matrix: Tensor) -> float:
    eig = torch.linalg.eig(matrix).eigenvalues.real.abs()
    return float(eig.max() / eig[eig > matrix.shape[0] * 2.3e-16 * eig.max()].min())


def test_logged_hessian_kappa_equals_proposition_2_on_the_last_layer(tmp_path: Path) -> None:
    data = make_data()
    bnp = BatchNormPreconditioning()
    model = BoringClassifier(tanh_net())
    monitor = ConditionNumberMonitor(every_n_steps=1, neuron=2)
    trainer = _fit(tmp_path, model, data, batch_size=16, callbacks=[monitor, bnp], max_steps=1,
                   logger=TensorBoardLogger(tmp_path))  # fmt: skip
    logged = scalars(trainer)
    # the dense Hessian from Prop. 2 at the parameters after step 0, on step 0's batch
    net = copy.deepcopy(model.network).double()
    x = data.tensors[0][:16].double()
    with torch.no_grad():
        hidden = net[1](net[0](x))
        p = net[2](hidden).softmax(-1)[:, 2]
    h_hat = torch.cat([torch.ones(16, 1, dtype=torch.float64), hidden], 1)
    hessian = h_hat.T @ torch.diag(p * (1 - p) / 16) @ h_hat
    running = bnp.preconditioner.layers["network.2"].running  # type: ignore[union-attr]
    pmat = explicit_p(running.mu, var_tilde_ref(running.var))
    assert logged["bnp/hessian_kappa/network.2/original"][0][1] == pytest.approx(kappa(hessian), rel=1e-5)
    expected = kappa(pmat.T @ hessian @ pmat)
    assert logged["bnp/hessian_kappa/network.2/preconditioned"][0][1] == pytest.approx(expected, rel=1e-5)
    sigma = var_tilde_ref(running.var).sqrt()
    assert logged["bnp/kappa_D_floored/network.2"][0][1] == pytest.approx(float(sigma.max() / sigma.min()), rel=1e-5)
    # issue 17 item 4: the histograms of σ̃ and μ and of the spectra (log10|λ| of the nonzero eigenvalues)
    acc = events(trainer)
    for tag, values in (("bnp/sigma_tilde/network.2", sigma), ("bnp/mu/network.2", running.mu.double())):
        (h,) = [e.histogram_value for e in acc.Histograms(tag)]
        assert (h.min, h.max, h.num) == pytest.approx((float(values.min()), float(values.max()), 8), rel=1e-6), tag
    for variant, matrix in (("original", hessian), ("preconditioned", pmat.T @ hessian @ pmat)):
        eig = torch.linalg.eigvalsh(matrix).abs()
        nonzero = eig[eig > matrix.shape[0] * 2.3e-16 * eig.max()]
        (h,) = [e.histogram_value for e in acc.Histograms(f"bnp/hessian_spectrum/network.2/{variant}")]
        expected = (float(nonzero.min().log10()), float(nonzero.max().log10()), nonzero.numel())
        assert (h.min, h.max, h.num) == pytest.approx(expected, rel=1e-5, abs=1e-5), variant
    # eq. 12 with the raw σ of the activations: the running average of the batch σ² without the paper's
    # initial σ² = 1 (after one step exactly the batch's σ²_H), even though P itself still carries it
    initial = tanh_net().double()  # step 0's batch statistics are of the input under the initial weights
    with torch.no_grad():
        var_h = initial[1](initial[0](x)).var(0, unbiased=False)
    d = torch.linalg.inv(torch.diag(torch.cat([torch.ones(1), var_h.sqrt()]).double()))
    assert logged["bnp/kappa_D/network.2"][0][1] == pytest.approx(float(torch.linalg.cond(d)), rel=1e-5)


@pytest.mark.parametrize("neuron", [1, 2, 3])
def test_grouped_conv_neuron_uses_its_group_statistics(tmp_path: Path, neuron: int) -> None:
    """Conv2d(4, 4, groups=2): output channels 0, 1 see input channels 0, 1 and outputs 2, 3 see 2, 3
    (contiguous groups, as torch's conv). Neurons 1 and 2 tell contiguous from interleaved grouping
    (i % groups), which a mutation of the group lookup showed neuron 3 alone does not."""
    data = make_data(shape=(2, 6, 6))
    bnp = BatchNormPreconditioning()
    model = BoringClassifier(make_cnn())
    monitor = ConditionNumberMonitor(every_n_steps=1, neuron=neuron, hessian_layers=["network.2"])
    trainer = _fit(tmp_path, model, data, batch_size=8, callbacks=[bnp, monitor], max_steps=1,
                   logger=TensorBoardLogger(tmp_path))  # fmt: skip
    logged = scalars(trainer)
    net = copy.deepcopy(model.network).double()
    x, y = data.tensors[0][:8].double(), data.tensors[1][:8]
    conv, i = net[2], neuron

    def loss_of(w_hat: Tensor) -> Tensor:
        w0, b0 = conv.weight.detach(), conv.bias.detach()
        w = torch.cat([w0[:i], w_hat[1:].view(1, 2, 3, 3), w0[i + 1 :]])
        b = torch.cat([b0[:i], w_hat[:1], b0[i + 1 :]])
        z = nn.functional.conv2d(net[1](net[0](x)), w, b, stride=2, groups=2)
        return nn.functional.cross_entropy(net[5](net[4](net[3](z))), y)

    w_hat0 = torch.cat([conv.bias[i : i + 1], conv.weight[i].reshape(-1)]).detach()
    hessian = torch.autograd.functional.hessian(loss_of, w_hat0)
    running = bnp.preconditioner.layers["network.2"].running  # type: ignore[union-attr]
    # output channel i is in group i // 2 and sees input channels 2·(i // 2), 2·(i // 2) + 1
    # (σ̃'s floor uses the max over all channels)
    seen = slice(2 * (i // 2), 2 * (i // 2) + 2)
    pmat = explicit_p(running.mu[seen], var_tilde_ref(running.var)[seen], kernel_volume=9)
    assert logged["bnp/hessian_kappa/network.2/original"][0][1] == pytest.approx(kappa(hessian), rel=1e-5)
    expected = kappa(pmat.T @ hessian @ pmat)
    assert logged["bnp/hessian_kappa/network.2/preconditioned"][0][1] == pytest.approx(expected, rel=1e-5)
    other = slice(2 - seen.start, 4 - seen.start)  # the other group's channels give another κ
    wrong = explicit_p(running.mu[other], var_tilde_ref(running.var)[other], kernel_volume=9)
    assert kappa(wrong.T @ hessian @ wrong) != pytest.approx(expected, rel=1e-3)


def run(tmp_path: Path, callbacks: list[Any]) -> tuple[Any, BatchNormPreconditioning, Any]:
    torch.manual_seed(123)
    np.random.seed(123)
    random.seed(123)
    model = LoggingClassifier(bn_net(), momentum=0.9)
    bnp = BatchNormPreconditioning()
    trainer = _fit(tmp_path, model, make_data(n=96), batch_size=16, callbacks=[*callbacks, bnp], max_steps=4,
                   accumulate_grad_batches=2, logger=TensorBoardLogger(tmp_path), log_every_n_steps=1)  # fmt: skip
    return trainer, bnp, (torch.get_rng_state(), np.random.get_state(), random.getstate())


def test_monitors_do_not_change_training(tmp_path: Path) -> None:
    monitors = [everything_on(every_n_steps=1, hessian_layers=["*"]), TimingMonitor(every_n_steps=1)]
    plain, bnp_a, rng_a = run(tmp_path / "a", [])
    watched, bnp_b, rng_b = run(tmp_path / "b", monitors)
    assert "bnp/lanczos/lambda_max" in scalars(watched)  # the probes did run
    assert scalars(watched)["train_loss"] == scalars(plain)["train_loss"]  # the probes' `self.log` is silenced
    assert torch.equal(rng_a[0], rng_b[0])  # torch
    assert all(np.array_equal(x, y) for x, y in zip(rng_a[1], rng_b[1]))  # NumPy (same draws consumed)
    assert rng_a[2] == rng_b[2]  # Python `random`
    a, b = plain.lightning_module, watched.lightning_module
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):  # parameters and BN buffers
        assert torch.equal(x, y), name
    for x, y in zip(plain.optimizers[0].state.values(), watched.optimizers[0].state.values()):
        assert torch.equal(x["momentum_buffer"], y["momentum_buffer"])
    for name, layer in bnp_a.preconditioner.layers.items():  # type: ignore[union-attr]
        other = bnp_b.preconditioner.layers[name].running  # type: ignore[union-attr]
        assert other.steps == layer.running.steps == 4
        assert torch.equal(other.mean_acc, layer.running.mean_acc) and torch.equal(other.var_acc, layer.running.var_acc)
    # the timing wrappers and hooks are gone after fit
    assert "on_before_optimizer_step" not in bnp_b.__dict__
    assert all(not layer.module._forward_hooks for layer in bnp_b.preconditioner.layers.values())  # type: ignore[union-attr]


def test_without_bnp_only_the_original_hessian_is_logged(tmp_path: Path) -> None:
    monitor = ConditionNumberMonitor(every_n_steps=1, hessian_layers=["*"], hessian_precision="model")
    trainer = _fit(tmp_path, LoggingClassifier(tanh_net()), make_data(), batch_size=16, callbacks=[monitor],
                   max_steps=1, logger=TensorBoardLogger(tmp_path))  # fmt: skip
    logged = scalars(trainer)
    assert {"bnp/hessian_kappa/network.0/original", "bnp/hessian_kappa/network.2/original"} <= set(logged)
    assert not [t for t in logged if "kappa_D" in t or "preconditioned" in t]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every_n_steps": 0}, "`every_n_steps` must be an integer >= 1, got 0"),
        ({"neuron": -1}, "`neuron` must be an integer >= 0, got -1"),
        ({"max_hessian_size": 0}, "`max_hessian_size` must be an integer >= 1"),
        ({"lanczos_iters": 0}, "`lanczos_iters` must be an integer >= 1"),
        ({"layers": []}, "`layers` must be None or a non-empty list"),
        ({"hessian_layers": []}, "`hessian_layers` must be None or a non-empty list"),
        ({"hessian_precision": "half"}, "`hessian_precision` must be 'float64' or 'model', got 'half'"),
        ({"hessian_rtol": 1.0}, r"`hessian_rtol` must be a finite number in \(0, 1\), got 1.0"),
        ({"landscape_steps": [1.0, -2.0]}, "`landscape_steps` must be a non-empty list of finite numbers > 0"),
        ({"landscape_direction": "up"}, "`landscape_direction` must be 'gradient' or 'preconditioned', got 'up'"),
        (
            dict(kappa_d=False, hessian_block=False, weight_kappa=False, effective_lr=False),
            "every metric is switched off",
        ),
    ],
)
def test_condition_monitor_validation(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ConditionNumberMonitor(**kwargs)


def test_patterns_must_match_a_layer(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"`hessian_layers` pattern 'decoder\.\*' matches no Linear/ConvNd layer"):
        _fit(tmp_path, BoringClassifier(tanh_net()), make_data(), batch_size=16, max_steps=1,
             callbacks=[ConditionNumberMonitor(hessian_layers=["decoder.*"])])  # fmt: skip


def test_timing_monitor_validation() -> None:
    with pytest.raises(ValueError, match="`every_n_steps` must be an integer >= 1, got 0"):
        TimingMonitor(every_n_steps=0)


def test_logging_happens_on_rank_zero_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch.utilities import rank_zero_only

    logger = mock.Mock()
    trainer = SimpleNamespace(loggers=[logger])
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    log_metrics(trainer, {"bnp/x": 1.0}, 0)  # type: ignore[arg-type]
    logger.log_metrics.assert_not_called()
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    log_metrics(trainer, {"bnp/x": 1.0}, 0)  # type: ignore[arg-type]
    logger.log_metrics.assert_called_once_with({"bnp/x": 1.0}, step=0)


def test_callbacks_are_read_from_yaml_like_lightning_cli() -> None:
    import lightning.pytorch as pl
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_argument("--callbacks", type=list[pl.Callback])
    config = parser.parse_string(
        """
        callbacks:
          - class_path: lightning_bnp.callbacks.condition_monitor.ConditionNumberMonitor
            init_args: {every_n_steps: 20, hessian_layers: ["network.*"], landscape: true, landscape_steps: [1, 2]}
          - class_path: lightning_bnp.callbacks.timing_monitor.TimingMonitor
            init_args: {every_n_steps: 10}
        """
    )
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # renamed in jsonargparse 4.49
    monitor, timing = instantiate(config).callbacks
    assert isinstance(monitor, ConditionNumberMonitor) and monitor.landscape_steps == [1.0, 2.0]
    assert monitor.hessian_layers == ["network.*"] and isinstance(timing, TimingMonitor) and timing.every_n_steps == 10


def test_tensorboard_custom_scalars_layout_groups_by_kind_and_layer(tmp_path: Path) -> None:
    callbacks = [ConditionNumberMonitor(every_n_steps=2, hessian_layers=["*"]), BatchNormPreconditioning(),
                 TimingMonitor(every_n_steps=2)]  # fmt: skip
    trainer = _fit(tmp_path, BoringClassifier(bn_net()), make_data(), batch_size=16, callbacks=callbacks,
                   max_steps=3, logger=TensorBoardLogger(tmp_path))  # fmt: skip
    acc = EventAccumulator(trainer.logger.log_dir)  # type: ignore[union-attr]
    acc.Reload()
    (event,) = acc.Tensors("custom_scalars__config__")  # written once, with both monitors' charts
    layout = layout_pb2.Layout.FromString(event.tensor_proto.string_val[0])
    charts = {c.title: {ch.title: list(ch.multiline.tag) for ch in c.chart} for c in layout.category}
    assert set(charts["bnp/hessian_kappa"]) == {"network.0", "network.4"}  # one chart per layer ...
    assert set(charts["bnp/weight_kappa"]) == {"network.0", "network.4"}
    assert {"bnp/kappa_D", "bnp/effective_lr", "timing", "timing/callbacks"} <= set(charts)
    tags = set(scalars(trainer))  # ... overlaying original and preconditioned
    (regex,) = charts["bnp/hessian_kappa"]["network.4"]
    assert {t for t in tags if re.match(regex, t)} == {f"bnp/hessian_kappa/network.4/{v}" for v in
                                                      ("original", "preconditioned")}  # fmt: skip
    every = [r for c in charts.values() for ch in c.values() for r in ch]
    assert all(any(re.match(r, t) for r in every) for t in tags if t.startswith(("bnp/", "timing/"))), tags


def test_works_with_csv_logger(tmp_path: Path) -> None:
    callbacks = [ConditionNumberMonitor(every_n_steps=2, landscape=True), BatchNormPreconditioning(),
                 TimingMonitor(every_n_steps=2)]  # fmt: skip
    trainer = _fit(tmp_path, BoringClassifier(bn_net()), make_data(), batch_size=16, callbacks=callbacks,
                   max_steps=4, logger=CSVLogger(tmp_path))  # fmt: skip
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:  # type: ignore[union-attr]
        rows = list(csv.DictReader(f))
    for tag in ("bnp/kappa_D/network.0", "bnp/hessian_kappa/network.4/preconditioned", "bnp/effective_lr/network.0",
                "bnp/landscape/beta_smoothness", "timing/step_ms", "timing/samples_per_sec"):  # fmt: skip
        values = [(int(r["step"]), float(r[tag])) for r in rows if r.get(tag)]
        assert [step for step, _ in values] == [0, 2], tag
        assert all(math.isfinite(v) for _, v in values), tag


def test_effective_lr_is_for_sgd_only() -> None:
    w = nn.Parameter(torch.ones(2, 2))
    trainer = SimpleNamespace(optimizers=[torch.optim.Adam([w], lr=0.1)])
    assert probes.learning_rates(trainer, sgd_only=True) == {}  # type: ignore[arg-type]
    assert probes.learning_rates(trainer) == {id(w): 0.1}  # type: ignore[arg-type]


class AdamClassifier(BoringClassifier):
    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def test_effective_lr_is_not_logged_for_adam_end_to_end(tmp_path: Path) -> None:
    """Issue 27: η/‖w‖² is (S)GD's effective rate (paper 002); a scale-invariant layer that Adam trains logs its
    ‖w‖² and cos∠(w, ∇w), never an effective_lr (whose η would not be the step it takes)."""
    model = AdamClassifier(bn_net(), lr=0.01)
    monitor = ConditionNumberMonitor(every_n_steps=1, kappa_d=False, hessian_block=False, weight_kappa=False)
    trainer = _fit(tmp_path, model, make_data(n=32), batch_size=16, callbacks=[monitor], max_steps=2,
                   logger=TensorBoardLogger(tmp_path))  # fmt: skip
    logged = scalars(trainer)
    assert monitor._scale_invariant == {"network.0": 8}  # found as with SGD
    assert [s for s, _ in logged["bnp/weight_norm_sq/network.0"]] == [0, 1]
    assert "bnp/weight_grad_cosine/network.0" in logged
    assert not [tag for tag in logged if tag.startswith("bnp/effective_lr")]


def test_kappa_d_of_a_bias_free_layer_has_no_bias_entry(tmp_path: Path) -> None:
    """Issue 27: without a bias, D = diag(σ)⁻¹ with no leading 1 (the layer has no centring block); σ² is the
    uncentred second moment that BNP equilibrates. With every σ > 1 the 1 would change κ(D): σ_max instead of
    σ_max/σ_min."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 5, generator=g) * torch.tensor([2.0, 3.0, 5.0, 8.0, 13.0]) + 1.0
    data = torch.utils.data.TensorDataset(x, torch.randint(0, 3, (16,), generator=g))
    model = BoringClassifier(nn.Sequential(nn.Linear(5, 3, bias=False)))
    callbacks = [BatchNormPreconditioning(), ConditionNumberMonitor(every_n_steps=1, hessian_block=False)]
    trainer = _fit(tmp_path, model, data, batch_size=16, callbacks=callbacks, max_steps=1,
                   logger=TensorBoardLogger(tmp_path))  # fmt: skip
    sigma = x.double().square().mean(0).sqrt()  # step 0's bias-corrected running average: the batch's E[h²]
    expected = float(torch.linalg.cond(torch.diag(1 / sigma)))
    assert expected < float(sigma.max()) / 1.5  # the bias entry would show
    assert scalars(trainer)["bnp/kappa_D/network.0"][0][1] == pytest.approx(expected, rel=1e-5)


def test_transposed_convolutions_are_not_neuron_layers() -> None:
    assert probes.is_neuron_layer(nn.Conv1d(2, 3, 1)) and probes.is_neuron_layer(nn.Linear(2, 3))
    assert not probes.is_neuron_layer(nn.ConvTranspose2d(2, 3, 1))  # weight[i] is an input channel's


class _FakeEvent:
    """Stands in for ``torch.cuda.Event``: a 'GPU' timestamp taken at ``record``."""

    recorded: ClassVar[list[_FakeEvent]] = []

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.t: float | None = None
        self.synced = False

    def record(self) -> None:
        self.t = time.perf_counter()
        _FakeEvent.recorded.append(self)

    def synchronize(self) -> None:
        self.synced = True

    def elapsed_time(self, end: _FakeEvent) -> float:
        assert end.synced and self.t is not None and end.t is not None, "read before synchronize"
        return (end.t - self.t) * 1e3  # ms, as CUDA reports


def test_cuda_clock_uses_events_and_synchronizes_only_when_collecting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timing_monitor.torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(timing_monitor.time, "perf_counter", mock.Mock(side_effect=time.perf_counter))
    clock = timing_monitor._Clock(torch.device("cuda", 0))
    token = clock.start()
    clock.stop(token, "step", "other")
    assert len(_FakeEvent.recorded) == 2 and not any(e.synced for e in _FakeEvent.recorded)  # no sync per step
    assert timing_monitor.time.perf_counter.call_count == 2  # type: ignore[attr-defined]  # only the fake events'
    totals = clock.collect()
    assert set(totals) == {"step", "other"} and totals["step"] == totals["other"] >= 0.0
    assert clock.collect() == {} and not clock.pending


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_timing_monitor_on_cuda(tmp_path: Path) -> None:
    trainer = _fit(tmp_path, BoringClassifier(bn_net()), make_data(), batch_size=16, max_steps=3, accelerator="cuda",
                   callbacks=[BatchNormPreconditioning(), TimingMonitor(every_n_steps=2),
                              ConditionNumberMonitor(every_n_steps=2)],
                   logger=TensorBoardLogger(tmp_path))  # fmt: skip
    logged = scalars(trainer)
    for tag in ("timing/step_ms", "timing/bnp_ms", "timing/samples_per_sec", "bnp/hessian_kappa/network.4/original"):
        assert [s for s, _ in logged[tag]] == [0, 2] and all(math.isfinite(v) and v > 0 for _, v in logged[tag]), tag


def test_bias_free_layer_uses_p_equal_to_diag_inverse_sigma(tmp_path: Path) -> None:
    """No bias: P = diag(1/σ̃) with σ̃² from the uncentred second moment (the transform's P for such a layer)."""
    torch.manual_seed(0)
    network = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3, bias=False))
    data, bnp = make_data(), BatchNormPreconditioning()
    model = BoringClassifier(network)
    trainer = _fit(tmp_path, model, data, batch_size=16, callbacks=[bnp, ConditionNumberMonitor(every_n_steps=1)],
                   max_steps=1, logger=TensorBoardLogger(tmp_path))  # fmt: skip
    logged = scalars(trainer)
    net = copy.deepcopy(model.network).double()
    x, y = data.tensors[0][:16].double(), data.tensors[1][:16]
    hidden = net[1](net[0](x)).detach()

    def loss_of(w_i: Tensor) -> Tensor:
        w = torch.cat([w_i.view(1, 8), net[2].weight[1:].detach()])
        return nn.functional.cross_entropy(hidden @ w.T, y)

    hessian = torch.autograd.functional.hessian(loss_of, net[2].weight[0].detach().clone())
    running = bnp.preconditioner.layers["network.2"].running  # type: ignore[union-attr]
    torch.testing.assert_close(running.mu.cpu(), torch.zeros(8))  # uncentred statistics
    pmat = torch.diag(var_tilde_ref(running.var).rsqrt())
    assert logged["bnp/hessian_kappa/network.2/original"][0][1] == pytest.approx(kappa(hessian), rel=1e-5)
    expected = kappa(pmat.T @ hessian @ pmat)
    assert logged["bnp/hessian_kappa/network.2/preconditioned"][0][1] == pytest.approx(expected, rel=1e-5)


def test_weight_conditioning_layers_log_the_conditioned_kappa(tmp_path: Path) -> None:
    """With the real WeightConditioning callback: raw = the free parameter, conditioned = E·W (paper 004)."""
    from lightning_bnp import WeightConditioning

    model = BoringClassifier(tanh_net())
    callbacks = [ConditionNumberMonitor(every_n_steps=1), WeightConditioning(mode="row"), BatchNormPreconditioning(),
                 TimingMonitor(every_n_steps=1)]  # fmt: skip
    trainer = _fit(tmp_path, model, make_data(), batch_size=16, callbacks=callbacks, max_steps=1,
                   logger=TensorBoardLogger(tmp_path))  # fmt: skip
    logged = scalars(trainer)
    for name, layer in (("network.0", model.network[0]), ("network.2", model.network[2])):
        raw = layer.parametrizations.weight.original.detach().double()
        s_raw, s_cond = torch.linalg.svdvals(raw), torch.linalg.svdvals(layer.weight.detach().double())
        assert logged[f"bnp/weight_kappa/{name}/raw"][0][1] == pytest.approx(float(s_raw[0] / s_raw[-1]), rel=1e-5)
        assert logged[f"bnp/weight_kappa/{name}/conditioned"][0][1] == pytest.approx(
            float(s_cond[0] / s_cond[-1]), rel=1e-5
        )
    assert math.isfinite(logged["bnp/hessian_kappa/network.2/preconditioned"][0][1])  # ŵ = the free parameter's row
    assert logged["timing/weight_conditioning_ms"][0][1] > 0  # E·W's forward, this package's transform


def test_default_monitor_skips_layers_over_the_size_limits_instead_of_crashing(tmp_path: Path) -> None:
    """Issue 15, item 5: a head with ≥ 1024 inputs (ResNet-50: 2048) crashed `fit` at step 1 with
    "inputs argument to grad() cannot be empty"; the docs promise a skip with a warning. Weight κ has a
    limit too (`max_weight_kappa_size`, min(out, in·k) singular values)."""
    torch.manual_seed(0)
    model = BoringClassifier(nn.Sequential(nn.Linear(1100, 520), nn.ReLU(), nn.Linear(520, 1100), nn.Linear(1100, 3)))
    monitor = ConditionNumberMonitor(every_n_steps=1)  # defaults: max_hessian_size=1024, max_weight_kappa_size=512
    with pytest.warns(UserWarning) as record:
        trainer = _fit(tmp_path, model, make_data(n=32, shape=(1100,)), batch_size=16,
                       callbacks=[BatchNormPreconditioning(), monitor], max_steps=2,
                       logger=TensorBoardLogger(tmp_path))  # fmt: skip
    messages = [str(w.message) for w in record]
    hessian_warning = [m for m in messages if "Hessian block skipped" in m]
    assert hessian_warning == [
        "ConditionNumberMonitor: layer 'network.3': Hessian block skipped, its neuron has 1101 parameters "
        "> `max_hessian_size`=1024"
    ]  # once, not per record
    size_warnings = [m for m in messages if "weight κ skipped" in m]
    assert len(size_warnings) == 2 and all("> `max_weight_kappa_size`=512" in m for m in size_warnings)
    assert "'network.0'" in size_warnings[0] and "'network.2'" in size_warnings[1]  # 520 singular values each
    logged = scalars(trainer)
    assert not [tag for tag in logged if "hessian" in tag]
    assert {"bnp/weight_kappa/network.3/raw"} == {tag for tag in logged if "weight_kappa" in tag}
    assert [s for s, _ in logged["bnp/weight_kappa/network.3/raw"]] == [0, 1]


def test_neuron_hessians_of_no_block_is_empty() -> None:
    from lightning_bnp.core import metrics as M

    assert M.neuron_hessians(lambda replaced: torch.zeros(()), []) == []


class SideBranch(nn.Module):
    """A Linear whose forward never runs and whose weight never reaches F.linear (a matmul uses it): BNP sees
    no input of it and never transforms it (an F.linear call with it would be captured: test_attention.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(5, 3)
        self.out_proj = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x) @ self.out_proj.weight.t() + self.out_proj.bias


@pytest.mark.parametrize("bias_correction", [False, True])
def test_kappa_d_is_the_papers_d_of_the_raw_statistics(tmp_path: Path, bias_correction: bool) -> None:
    """Issue 14, item 2: κ(D) was built from σ̃, so it was pinned at ≤ √((1 + ε1)/ε1) ≈ 10.05. With inputs
    scaled 1e-2…1e2 the paper's D = diag(1, σ)⁻¹ (eq. 12) has κ ≈ 1e4; the floored value keeps its own tag.
    κ(D) describes the activations (the bias-corrected running σ², whichever start P uses); the floored
    value is what P divides by. A layer BNP never transformed logs no κ(D)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 5, generator=g) * torch.tensor([1e-2, 1e-1, 1.0, 1e1, 1e2]) + 0.3
    data = torch.utils.data.TensorDataset(x, torch.randint(0, 3, (32,), generator=g))
    model = BoringClassifier(SideBranch())
    with pytest.warns(UserWarning, match="out_proj"):  # BNP's own warning: its forward never ran
        callbacks = [BatchNormPreconditioning(bias_correction=bias_correction), ConditionNumberMonitor(every_n_steps=1)]
        trainer = _fit(tmp_path, model, data, batch_size=16, callbacks=callbacks, max_steps=2,
                       logger=TensorBoardLogger(tmp_path))  # fmt: skip
    logged = scalars(trainer)
    assert not [tag for tag in logged if "out_proj" in tag and "kappa_D" in tag]  # was 1.0 ("perfectly conditioned")
    # step 1's running σ² (bias-corrected, ρ = 0.99) from the two batches, independently of the package
    var = [x[i : i + 16].double().var(0, unbiased=False) for i in (0, 16)]
    v1 = (0.99 * 0.01 * var[0] + 0.01 * var[1]) / (1 - 0.99**2)  # σ² ← ρσ² + (1 − ρ)σ²_H, / (1 − ρ²)
    # what P uses: the same, or the paper's view, which keeps the initial σ² = 1 with weight ρ^t
    applied = (
        (var[0], v1) if bias_correction else (0.01 * var[0] + 0.99, 0.99 * 0.01 * var[0] + 0.01 * var[1] + 0.99**2)
    )
    for step, v, p_var in ((0, var[0], applied[0]), (1, v1, applied[1])):
        d = torch.diag(torch.cat([torch.ones(1, dtype=torch.float64), v.rsqrt()]))
        kappa_d = logged["bnp/kappa_D/network.body"][step][1]
        assert kappa_d == pytest.approx(float(torch.linalg.cond(d)), rel=1e-4) and kappa_d > 100
        floored = p_var + 1e-2 * p_var.max() + 1e-4
        assert logged["bnp/kappa_D_floored/network.body"][step][1] == pytest.approx(
            float((floored.max() / floored.min()).sqrt()), rel=1e-4
        )
        assert logged["bnp/kappa_D_floored/network.body"][step][1] <= (1.01 / 0.01) ** 0.5


def test_kappa_d_with_batch_statistics(tmp_path: Path) -> None:
    """statistics='batch': D from this step's σ²_H, recovered from the float32 σ̃² by undoing the floor, which
    resolves σ_j ≳ 3.5e-4·σ_max (here σ spans 1e-1…1e1)."""
    x = torch.randn(16, 5, generator=torch.Generator().manual_seed(1)) * torch.tensor([1e-1, 1.0, 3.0, 5.0, 1e1])
    data = torch.utils.data.TensorDataset(x, torch.zeros(16, dtype=torch.long))
    model = BoringClassifier(nn.Sequential(nn.Linear(5, 3)))
    callbacks = [BatchNormPreconditioning(statistics="batch"), ConditionNumberMonitor(every_n_steps=1)]
    trainer = _fit(tmp_path, model, data, batch_size=16, callbacks=callbacks, max_steps=1,
                   logger=TensorBoardLogger(tmp_path))  # fmt: skip
    sigma = x.double().std(0, unbiased=False)
    d = torch.diag(torch.cat([torch.ones(1, dtype=torch.float64), 1 / sigma]))
    assert scalars(trainer)["bnp/kappa_D/network.0"][0][1] == pytest.approx(float(torch.linalg.cond(d)), rel=1e-3)


class LinearLoss(BoringClassifier):
    """A loss linear in the last layer's parameters: its Hessian block is zero, so κ = inf, λ_min/max|λ| = NaN."""

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        return self(batch[0]).mean()


def test_values_that_cannot_be_computed_are_not_logged(tmp_path: Path) -> None:
    """Issue 14, item 2: cnn_cifar logged hessian_kappa = inf and hessian_min_ratio = NaN."""
    monitor = ConditionNumberMonitor(every_n_steps=1)
    with pytest.warns(UserWarning) as record:
        trainer = _fit(tmp_path, LinearLoss(tanh_net()), make_data(), batch_size=16, max_steps=2,
                       callbacks=[BatchNormPreconditioning(), monitor], logger=TensorBoardLogger(tmp_path))  # fmt: skip
    logged = scalars(trainer)
    assert all(math.isfinite(v) for values in logged.values() for _, v in values)
    assert "bnp/hessian_rank/network.2" in logged and logged["bnp/hessian_rank/network.2"][0][1] == 0.0
    assert not [tag for tag in logged if "hessian_kappa" in tag or "hessian_min_ratio" in tag]
    skipped = [str(w.message) for w in record if "cannot be computed" in str(w.message)]
    assert len(skipped) == 4 and len(set(skipped)) == 4  # once per tag, not per record


def test_step_time_excludes_the_condition_monitors_probes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 17 item 5: a record step's ConditionNumberMonitor work (here a stand-in: 0.3 s on a fake clock
    in its on_train_batch_end, which runs inside TimingMonitor's window) is its own tag, not training step
    time. The monitor's clock is replaced by one that only that stand-in advances, so the figures are exact
    whatever the machine's load."""
    from lightning_bnp.callbacks import timing_monitor

    now = [0.0]
    monkeypatch.setattr(timing_monitor.time, "perf_counter", lambda: now[0])
    original = ConditionNumberMonitor.on_train_batch_end

    def slow(self: ConditionNumberMonitor, *args: Any, **kwargs: Any) -> None:
        now[0] += 0.3
        original(self, *args, **kwargs)

    monkeypatch.setattr(ConditionNumberMonitor, "on_train_batch_end", slow)
    callbacks = [BatchNormPreconditioning(), ConditionNumberMonitor(every_n_steps=1), TimingMonitor(every_n_steps=1)]
    # on the CPU whatever the test accelerator: the host clock (a GPU run is timed by CUDA events, which no
    # fake clock drives; the CUDA-only test above covers that path)
    trainer = _fit(tmp_path, BoringClassifier(make_mlp()), make_data(), batch_size=16, max_steps=2,
                   callbacks=callbacks, logger=TensorBoardLogger(tmp_path), accelerator="cpu")  # fmt: skip
    logged = scalars(trainer)
    assert [v for _, v in logged["timing/callbacks/ConditionNumberMonitor_ms"]] == pytest.approx([300.0, 300.0])
    assert [v for _, v in logged["timing/step_ms"]] == pytest.approx([0.0, 0.0], abs=1e-9)


def test_timing_follows_the_trainers_log_every_n_steps_by_default(tmp_path: Path) -> None:
    """Issue 17 item 5: like Lightning's LearningRateMonitor, the default cadence is `log_every_n_steps`."""
    trainer = _fit(tmp_path, BoringClassifier(make_mlp()), make_data(), batch_size=8, max_steps=7,
                   callbacks=[BatchNormPreconditioning(), TimingMonitor()], logger=TensorBoardLogger(tmp_path),
                   log_every_n_steps=3)  # fmt: skip
    assert [step for step, _ in scalars(trainer)["timing/step_ms"]] == [0, 3, 6]
    assert "timing/samples_per_sec" in scalars(trainer)


def test_timing_reads_callback_hooks_through_the_trainers_profiler(tmp_path: Path) -> None:
    """Other callbacks are timed through Lightning's `[Callback]<state_key>.<hook>` profiler actions, not by
    replacing their methods; the user's profiler still records those actions and is back in place after fit."""
    from lightning.pytorch.profilers import SimpleProfiler

    bnp, profiler = BatchNormPreconditioning(), SimpleProfiler()
    trainer = _fit(tmp_path, BoringClassifier(make_mlp()), make_data(), batch_size=8, max_steps=3,
                   callbacks=[bnp, TimingMonitor(every_n_steps=1)], logger=TensorBoardLogger(tmp_path),
                   profiler=profiler)  # fmt: skip
    assert trainer.profiler is profiler and not vars(bnp).keys() & {"on_before_optimizer_step", "on_train_batch_start"}
    action = f"[Callback]{bnp.state_key}.on_before_optimizer_step"
    assert len(profiler.recorded_durations[action]) == 3
    logged = scalars(trainer)
    assert [step for step, _ in logged["timing/bnp_transform_ms"]] == [0, 1, 2]
    assert all(v > 0 for _, v in logged["timing/callbacks/BatchNormPreconditioning_ms"])


@pytest.mark.parametrize(
    ("log_every_n_steps", "every_n_steps", "expected"), [(3, None, [0, 3, 6]), (3, 2, [0, 2, 4, 6]), (0, 4, [0, 4])]
)
def test_default_cadence_is_the_trainers_log_every_n_steps(
    tmp_path: Path, log_every_n_steps: int, every_n_steps: int | None, expected: list[int]
) -> None:
    """Issue 17 item 5: like Lightning's LearningRateMonitor, `every_n_steps=None` follows the Trainer."""
    monitor = ConditionNumberMonitor(every_n_steps=every_n_steps)
    trainer = _fit(tmp_path, BoringClassifier(bn_net()), make_data(n=112), batch_size=16, max_steps=7,
                   callbacks=[BatchNormPreconditioning(), monitor], logger=TensorBoardLogger(tmp_path),
                   log_every_n_steps=log_every_n_steps)  # fmt: skip
    assert [step for step, _ in scalars(trainer)["bnp/weight_kappa/network.0/raw"]] == expected


def test_log_every_n_steps_zero_records_nothing_by_default(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match=r"`Trainer\(log_every_n_steps=0\)` turns logging off"):
        trainer = _fit(tmp_path, BoringClassifier(bn_net()), make_data(), batch_size=16, max_steps=2,
                       callbacks=[BatchNormPreconditioning(), ConditionNumberMonitor()],
                       logger=TensorBoardLogger(tmp_path), log_every_n_steps=0)  # fmt: skip
    assert not [tag for tag in scalars(trainer) if tag.startswith("bnp/")]


def test_effective_lr_is_logged_for_every_conv_of_a_resnet20_with_bn(tmp_path: Path) -> None:
    """Issue 18 §2: the Sequential-only rule found 1 of the 19 convs of this ResNet-20 (its stem; the other 18 sit
    in BasicBlock.forward), all followed by BatchNorm2d. The numerical check finds all 19, per output channel,
    and not the head. Values against independent formulas at the parameters after step 0."""
    from example_projects.models import cifar_resnet

    torch.manual_seed(0)
    model = BoringClassifier(cifar_resnet(depth=20, in_channels=3, num_classes=3, norm="bn"), lr=0.05)
    convs = {n: m for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    assert len(convs) == 19 and all(m.bias is None for m in convs.values())
    monitor = ConditionNumberMonitor(every_n_steps=1, kappa_d=False, hessian_block=False, weight_kappa=False)
    trainer = _fit(tmp_path, model, make_data(n=16, shape=(3, 8, 8)), batch_size=8, callbacks=[monitor], max_steps=2,
                   logger=TensorBoardLogger(tmp_path))  # fmt: skip
    logged = scalars(trainer)
    for kind in ("effective_lr", "weight_norm_sq", "weight_grad_cosine"):
        assert {t for t in logged if t.startswith(f"bnp/{kind}/")} == {f"bnp/{kind}/{n}" for n in convs}, kind
    assert monitor._scale_invariant == {n: m.out_channels for n, m in convs.items()}
    for name, conv in convs.items():
        w = conv.weight.detach().double()
        rows = w.reshape(w.shape[0], -1).square().sum(1)
        assert logged[f"bnp/effective_lr/{name}"][-1][1] == pytest.approx(0.05 / float(rows.mean()), rel=1e-5)
        assert logged[f"bnp/weight_norm_sq/{name}"][-1][1] == pytest.approx(float(rows.sum()), rel=1e-5)
        assert all(abs(v) < 1e-3 for _, v in logged[f"bnp/weight_grad_cosine/{name}"]), name  # ⟨w, ∇w⟩ ≈ 0
    # SGD without weight decay: ‖w‖² grows (paper 002, Lemma 2.4: ‖w_{t+1}‖² = ‖w_t‖² + η²‖∇w‖²)
    assert all(logged[f"bnp/weight_norm_sq/{n}"][1][1] > logged[f"bnp/weight_norm_sq/{n}"][0][1] for n in convs)


def test_heatmap_image_uses_the_viridis_table_over_whole_decades() -> None:
    """log10 values 0, 1, 2 (and a missing one): the scale runs over decades 0…2, so 0 is viridis' first colour
    (68, 1, 84), 2 its last (253, 231, 37) and 1 halfway between its 5th and 6th table entries (38, 130, 142)
    and (31, 158, 137); a missing value is grey. Cells are 16 px at this size."""
    image = heatmap_image(torch.tensor([[0.0, 1.0], [math.nan, 2.0]]))
    assert image.shape[0] == 3 and 0.0 <= float(image.min()) and float(image.max()) <= 1.0
    rgb = (image.permute(1, 2, 0) * 255).double()
    for (row, col), colour in {
        (0, 0): (68, 1, 84),
        (0, 1): (34.5, 144, 139.5),
        (1, 0): (127.5, 127.5, 127.5),
        (1, 1): (253, 231, 37),
    }.items():
        cell = rgb[16 * row : 16 * row + 16, 16 * col : 16 * col + 16].reshape(-1, 3)
        torch.testing.assert_close(cell, torch.tensor(colour, dtype=torch.float64).expand_as(cell), atol=1e-3, rtol=0)


def test_heatmaps_show_the_logged_kappas_layer_by_step_and_survive_resume(tmp_path: Path) -> None:
    """The image is the layer × record-step matrix of log10 of the logged κ(D) (rows: network.0, network.4);
    resuming from a checkpoint keeps the earlier columns."""
    from PIL import Image

    data = make_data()
    first = ConditionNumberMonitor(every_n_steps=1)
    trainer = _fit(tmp_path / "a", BoringClassifier(bn_net()), data, batch_size=16, max_steps=2,
                   callbacks=[BatchNormPreconditioning(), first], logger=TensorBoardLogger(tmp_path / "a"))  # fmt: skip
    checkpoint = tmp_path / "two.ckpt"
    trainer.save_checkpoint(checkpoint)
    resumed = ConditionNumberMonitor(every_n_steps=1)
    trainer = _fit(tmp_path / "b", BoringClassifier(bn_net()), data, batch_size=16, max_steps=4,
                   callbacks=[BatchNormPreconditioning(), resumed], logger=TensorBoardLogger(tmp_path / "b"),
                   ckpt_path=str(checkpoint))  # fmt: skip
    assert resumed._heat_steps == [0, 1, 2, 3]
    old = scalars(SimpleNamespace(logger=TensorBoardLogger(tmp_path / "a", version=0)))
    new = scalars(trainer)
    matrix = torch.tensor(
        [
            [math.log10(v) for _, v in old[f"bnp/kappa_D/{n}"] + new[f"bnp/kappa_D/{n}"]]
            for n in ("network.0", "network.4")
        ]
    )
    assert matrix.shape == (2, 4)
    records = events(trainer).Images("bnp/heatmap/kappa_D")
    assert [r.step for r in records] == [2]  # images on records 1, 11, 21, … of a fit: the resumed fit's first
    decoded = torch.tensor(np.array(Image.open(io.BytesIO(records[-1].encoded_image_string)).convert("RGB")))
    picture = heatmap_picture("kappa_D", matrix[:, :3], ["network.0", "network.4"], [0, 1, 2])  # the axes' labels
    expected = (picture.permute(1, 2, 0) * 255).round()  # steps 0, 1 (first fit) and 2
    torch.testing.assert_close(decoded.double(), expected.double(), atol=1.0, rtol=0)
    legend = events(trainer).Tensors("bnp/heatmap/weight_kappa/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "`network.0`, `network.4`" in legend and "log10 weight κ" in legend


def test_pictures_go_to_tensorboard_only_and_can_be_switched_off(tmp_path: Path) -> None:
    callbacks = [BatchNormPreconditioning(), ConditionNumberMonitor(every_n_steps=1)]
    loggers = [TensorBoardLogger(tmp_path), CSVLogger(tmp_path)]
    _fit(tmp_path, BoringClassifier(bn_net()), make_data(), batch_size=16, max_steps=2, callbacks=callbacks,
         logger=loggers)  # fmt: skip
    acc = EventAccumulator(loggers[0].log_dir)
    acc.Reload()
    assert {"bnp/sigma_tilde/network.0", "bnp/mu/network.4", "bnp/hessian_spectrum/network.4/original",
            "bnp/hessian_spectrum/network.4/preconditioned"} <= set(acc.Tags()["histograms"])  # fmt: skip
    assert set(acc.Tags()["images"]) == {"bnp/heatmap/kappa_D", "bnp/heatmap/weight_kappa"}
    with open(Path(loggers[1].log_dir) / "metrics.csv") as f:
        columns = next(csv.reader(f))
    assert "bnp/kappa_D/network.0" in columns and not [c for c in columns if "sigma_tilde" in c or "heatmap" in c]
    off = ConditionNumberMonitor(every_n_steps=1, histograms=False, spectra=False, heatmaps=False)
    trainer = _fit(tmp_path / "off", BoringClassifier(bn_net()), make_data(), batch_size=16, max_steps=2,
                   callbacks=[BatchNormPreconditioning(), off], logger=TensorBoardLogger(tmp_path / "off"))  # fmt: skip
    acc = events(trainer)
    assert not acc.Tags()["histograms"] and not acc.Tags()["images"] and "bnp/kappa_D/network.0" in scalars(trainer)


def test_non_finite_histograms_are_skipped_with_one_warning() -> None:
    monitor = ConditionNumberMonitor()
    logger = mock.Mock(spec=TensorBoardLogger)
    trainer = SimpleNamespace(loggers=[logger])
    monitor._spectra = {"bnp/hessian_spectrum/x/original": torch.tensor([0.0, math.inf]),
                        "bnp/hessian_spectrum/x/preconditioned": torch.tensor([0.0, 1.0])}  # fmt: skip
    with pytest.warns(UserWarning, match=r"bnp/hessian_spectrum/x/original has non-finite values"):
        monitor._log_pictures(trainer, {}, 0)  # type: ignore[arg-type]
    monitor._log_pictures(trainer, {}, 1)  # type: ignore[arg-type]
    tags = [c.args[0] for c in logger.experiment.add_histogram.call_args_list]
    assert tags == ["bnp/hessian_spectrum/x/preconditioned"] * 2
    assert len([t for t in monitor._warned if "finite" in t]) == 1


def test_layer_charts_of_a_deep_model_are_bounded_and_cover_every_layer() -> None:
    names = [f"{i}.conv{j}" for i in range(54) for j in (1, 2)] + ["0", "59"]
    for title in (None, "κ"):
        charts = layer_charts("bnp", "weight_kappa", names, title=title)
        assert len(charts) <= MAX_CHARTS
        for name in names:
            tags = (f"bnp/weight_kappa/{name}/raw", f"bnp/weight_kappa/{name}/conditioned")
            assert all(sum(bool(re.match(r, tag)) for rs in charts.values() for r in rs) == 1 for tag in tags), name
        assert not any(re.match(r, "bnp/weight_kappa/10.conv10/raw") for rs in charts.values() for r in rs)
    assert set(layer_charts("bnp", "weight_kappa", ["a", "b"])) == {"a", "b"}  # shallow: one chart per layer


def test_resnet110_gets_a_bounded_number_of_custom_scalars_charts(tmp_path: Path) -> None:
    """Issue 17 item 4: ~220 single-line charts for ResNet-110 before; now at most MAX_CHARTS per kind, and every
    logged tag is still in a chart."""
    from example_projects.models import cifar_resnet

    torch.manual_seed(0)
    model = BoringClassifier(cifar_resnet(depth=110, num_classes=3, norm="bn"))
    monitor = ConditionNumberMonitor(every_n_steps=1, hessian_block=False, effective_lr=False)
    trainer = _fit(tmp_path, model, make_data(n=4, shape=(3, 8, 8)), batch_size=4, max_steps=1,
                   callbacks=[BatchNormPreconditioning(), monitor], logger=TensorBoardLogger(tmp_path))  # fmt: skip
    acc = events(trainer)
    (event,) = acc.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(event.tensor_proto.string_val[0])
    tags = [t for t in scalars(trainer) if t.startswith("bnp/")]
    assert len(tags) == 3 * 110  # κ(D), κ(D̃), weight κ (raw) of 110 layers
    assert all(len(category.chart) <= MAX_CHARTS for category in layout.category)
    assert sum(len(category.chart) for category in layout.category) <= 3 * MAX_CHARTS
    regexes = [r for category in layout.category for c in category.chart for r in c.multiline.tag]
    assert all(any(re.match(r, tag) for r in regexes) for tag in tags)


class Checkpointed(nn.Module):
    """A Linear, then a Tanh and a Linear under activation checkpointing."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.use_reentrant = use_reentrant
        self.first, self.rest = nn.Linear(6, 8), nn.Sequential(nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x: Tensor) -> Tensor:
        return torch.utils.checkpoint.checkpoint(self.rest, self.first(x), use_reentrant=self.use_reentrant)


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_activation_checkpointing_measures_or_names_reentrant_checkpointing_once(
    tmp_path: Path, use_reentrant: bool
) -> None:
    """Reentrant checkpointing cannot be differentiated by ``torch.autograd.grad``: the probes that need it are
    skipped with one warning naming the cause and the way out, and the fit goes on (it crashed with "element 0 of
    tensors does not require grad"); non-reentrant checkpointing is measured."""
    callbacks = [ConditionNumberMonitor(every_n_steps=1, landscape=True), BatchNormPreconditioning()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = _fit(tmp_path, BoringClassifier(Checkpointed(use_reentrant)), make_data(), batch_size=16,
                       callbacks=callbacks, max_steps=3, logger=CSVLogger(tmp_path))  # fmt: skip
    named = [str(w.message) for w in caught if "reentrant activation checkpointing" in str(w.message)]
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:  # type: ignore[union-attr]
        rows = list(csv.DictReader(f))
    measured = [r for r in rows if r.get("bnp/hessian_kappa/network.rest.1/original")]
    assert [r for r in rows if r.get("bnp/kappa_D/network.first")]  # what needs no gradient is still measured
    if use_reentrant:
        assert len(named) == 1 and "use_reentrant=False" in named[0], named
        assert not measured
    else:
        assert not named and len(measured) == 3
