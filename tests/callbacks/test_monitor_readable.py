"""Issue 38 item 5: what a reader can read of κ that spans decades — log10 κ and the gain of the Hessian block in
TensorBoard's charts, and κ heatmaps with a title, labelled axes and a colour bar in decades."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from matplotlib.backends.backend_agg import FigureCanvasAgg
from tensorboard.plugins.custom_scalar import layout_pb2

from lightning_bnp.callbacks import _pictures as pictures
from lightning_bnp.callbacks._logging import heatmap_image
from lightning_bnp.callbacks._pictures import heatmap_figure, heatmap_picture, legend
from lightning_bnp.callbacks.bnp import BatchNormPreconditioning
from lightning_bnp.callbacks.condition_monitor import ConditionNumberMonitor
from tests.callbacks.test_monitors import bn_net, events, scalars, tanh_net
from tests.helpers import BoringClassifier, _fit, make_data


def test_hessian_kappa_is_also_logged_in_decades_with_the_gain(tmp_path: Path) -> None:
    """log10 κ of each block, the gain κ original / κ preconditioned and its log10 (the gap between the two
    curves), at the same steps as the raw κ; the Custom Scalars layout charts the readable tags first."""
    callbacks = [ConditionNumberMonitor(every_n_steps=1, hessian_layers=["*"]), BatchNormPreconditioning()]
    trainer = _fit(tmp_path, BoringClassifier(bn_net()), make_data(), batch_size=16, callbacks=callbacks,
                   max_steps=3, logger=TensorBoardLogger(tmp_path))  # fmt: skip
    logged = scalars(trainer)
    for layer in ("network.0", "network.4"):
        raw = {v: dict(logged[f"bnp/hessian_kappa/{layer}/{v}"]) for v in ("original", "preconditioned")}
        assert list(raw["original"]) == [0, 1, 2]
        for variant, values in raw.items():
            readable = dict(logged[f"bnp/hessian_log10_kappa/{layer}/{variant}"])
            assert readable == pytest.approx({s: math.log10(k) for s, k in values.items()}, rel=1e-6)
        gain = dict(logged[f"bnp/hessian_kappa_gain/{layer}"])
        assert gain == pytest.approx({s: k / raw["preconditioned"][s] for s, k in raw["original"].items()}, rel=1e-6)
        log_gain = dict(logged[f"bnp/hessian_log10_kappa/{layer}/gain"])
        assert log_gain == pytest.approx({s: math.log10(g) for s, g in gain.items()}, rel=1e-5, abs=1e-6)
    (event,) = events(trainer).Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(event.tensor_proto.string_val[0])
    titles = [category.title for category in layout.category]
    assert titles.index("bnp/hessian_log10_kappa") < titles.index("bnp/hessian_kappa")  # readable first
    charts = {c.title: {ch.title: list(ch.multiline.tag) for ch in c.chart} for c in layout.category}
    (regex,) = charts["bnp/hessian_log10_kappa"]["network.4"]  # one chart per layer: original, preconditioned, gain
    assert {t for t in logged if re.match(regex, t)} == {
        f"bnp/hessian_log10_kappa/network.4/{v}" for v in ("original", "preconditioned", "gain")
    }
    (regex,) = charts["bnp/hessian_kappa_gain"]["κ original / κ preconditioned"]  # one chart of every layer
    assert {t for t in logged if re.match(regex, t)} == {f"bnp/hessian_kappa_gain/network.{i}" for i in (0, 4)}


def test_without_bnp_only_the_original_log10_kappa_and_no_gain(tmp_path: Path) -> None:
    monitor = ConditionNumberMonitor(every_n_steps=1)
    trainer = _fit(tmp_path, BoringClassifier(tanh_net()), make_data(), batch_size=16, callbacks=[monitor],
                   max_steps=1, logger=TensorBoardLogger(tmp_path))  # fmt: skip
    logged = scalars(trainer)
    assert [t for t in logged if "log10" in t or "gain" in t] == ["bnp/hessian_log10_kappa/network.2/original"]
    assert logged["bnp/hessian_log10_kappa/network.2/original"][0][1] == pytest.approx(
        math.log10(logged["bnp/hessian_kappa/network.2/original"][0][1]), rel=1e-6
    )
    (event,) = events(trainer).Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(event.tensor_proto.string_val[0])
    assert "bnp/hessian_kappa_gain" not in {category.title for category in layout.category}


def test_heatmap_figure_has_a_title_labelled_axes_and_a_colour_bar_in_decades() -> None:
    """The figure is inspected before it is drawn: rows are the layers, columns the record steps, the colour
    bar runs over whole decades of κ with ticks 10^k, a missing value is grey."""
    values = torch.tensor([[0.3, 1.2, 2.9], [math.nan, 0.0, 1.5]])  # log10 κ(D) of two layers at three records
    figure = heatmap_figure("kappa_D", values, ["network.0", "network.4"], [0, 50, 100])
    axes, bar = figure.axes
    assert "κ(D)" in axes.get_title() and "paper 000 §5.1" in axes.get_title()
    assert axes.get_ylabel() == "layer (model order)" and axes.get_xlabel().startswith("optimizer step")
    assert [t.get_text() for t in axes.get_yticklabels()] == ["network.0", "network.4"]
    assert list(axes.get_yticks()) == [0, 1]
    FigureCanvasAgg(figure).draw()  # tick labels of the steps are formatted at draw time
    steps = {round(t.get_position()[0]): t.get_text() for t in axes.get_xticklabels() if t.get_text()}
    assert steps and all(text == str([0, 50, 100][column]) for column, text in steps.items()), steps
    assert bar.get_ylabel() == "κ(D) (log scale)"
    assert list(bar.get_yticks()) == [0, 1, 2, 3]
    assert [t.get_text() for t in bar.get_yticklabels()] == ["10⁰", "10¹", "10²", "10³"]
    (image,) = axes.get_images()
    assert image.get_clim() == (0, 3) and image.get_cmap().name.startswith("viridis")
    assert image.get_cmap().get_bad()[:3] == pytest.approx((0.5, 0.5, 0.5))
    assert bool(np.ma.getmaskarray(image.get_array())[1, 0])  # the missing value is the grey "bad" colour


def test_heatmap_picture_is_the_figure_or_without_matplotlib_the_plain_image(monkeypatch: pytest.MonkeyPatch) -> None:
    values = torch.tensor([[0.0, 1.0], [math.nan, 2.0]])
    picture = heatmap_picture("weight_kappa", values, ["a", "b"], [0, 1])
    assert (
        picture.shape[0] == 3 and picture.shape[2] == 800 and 0.0 <= float(picture.min()) <= float(picture.max()) <= 1
    )
    assert "x axis gives the optimizer step" in legend("weight_kappa", ["a", "b"])
    monkeypatch.setattr(pictures, "has_matplotlib", lambda: False)
    assert torch.equal(heatmap_picture("weight_kappa", values, ["a", "b"], [0, 1]), heatmap_image(values))
    assert "the exponent on the bar" in legend("weight_kappa", ["a", "b"])


def test_the_monitor_compares_both_hessian_blocks_over_one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 45 item 9: late in training the block's near-null eigenvalues (samples fitted with p ≈ 1 add
    curvature p(1 − p) ≈ 1e-15) sit at the threshold n·eps·max|λ|; one counted in Pᵀ∇²L P but not in ∇²L made
    `make demo`'s gain 0.008–0.1 for single records. Both κ, their gain and the rank count the same eigenvalues."""
    from types import SimpleNamespace

    from torch import nn

    from lightning_bnp.callbacks import _hessian_block, _probes

    h = torch.diag(torch.tensor([1.0, 1e-3, 5e-16], dtype=torch.float64))
    p = torch.diag(torch.tensor([1.0, 1.0, 10.0], dtype=torch.float64))  # PᵀHP: 1, 1e-3, 5e-14
    layer = nn.Linear(2, 4)
    monkeypatch.setattr(_hessian_block.M, "neuron_hessians", lambda loss, blocks: [h])
    monkeypatch.setattr(_probes, "neuron_p", lambda pre, layer, index, centred: p)
    step = SimpleNamespace(
        pl_module=nn.ModuleDict({"out": layer}),
        loss=lambda dtype: SimpleNamespace(params=dict(nn.ModuleDict({"out": layer}).named_parameters())),
        in_dtype=lambda dtype, fn: fn(dtype),
    )
    pre = SimpleNamespace(layers={"out": object()})
    metrics, spectra = _hessian_block.hessian_metrics(
        step, pre, {"out": layer}, neuron=0, max_size=10, precision="float64", rtol=None,  # type: ignore[arg-type]
        warn_once=lambda key, message: None,
    )  # fmt: skip
    assert metrics["bnp/hessian_kappa/out/original"] == pytest.approx(1e3)
    assert metrics["bnp/hessian_kappa/out/preconditioned"] == pytest.approx(1e3)  # not 2e13
    assert metrics["bnp/hessian_kappa_gain/out"] == pytest.approx(1.0) and metrics["bnp/hessian_rank/out"] == 2.0
    assert spectra["bnp/hessian_spectrum/out/preconditioned"].tolist() == pytest.approx([-3.0, 0.0])
