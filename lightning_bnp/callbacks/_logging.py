"""Rank-zero logging of the monitors' metrics to every logger, and what TensorBoard shows besides numbers.

Tags are ``<namespace>/<kind>/<layer>[/<variant>]`` (e.g. ``bnp/hessian_kappa/network.4/original``)
or ``timing/<kind>``. TensorBoard's *Scalars* tab groups tags by their first component only, so the
monitors also register a *Custom Scalars* layout: one category per kind (``bnp/hessian_kappa``,
``timing``, …) and, in it, one chart per layer that overlays its variants (original and
preconditioned; raw and conditioned) — or, beyond :data:`MAX_CHARTS` layers (a ResNet-110 has 110),
one chart per run of consecutive layers (:func:`layer_charts`). Each monitor declares its charts in
``on_fit_start`` (:func:`declare_layout`); the union is written once, with the first record, because
TensorBoard reads only the first layout of a run.

Histograms and images (:func:`log_tensorboard`) go to TensorBoard loggers only; :func:`heatmap_image`
renders a layer × step matrix with plain torch (a colour lookup table, no matplotlib).
"""

from __future__ import annotations

import math
import re
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from torch import Tensor

__all__ = [
    "MAX_CHARTS",
    "chart",
    "declare_layout",
    "finite_metrics",
    "has_tensorboard",
    "heatmap_image",
    "layer_charts",
    "log_metrics",
    "log_tensorboard",
]

HISTOGRAM_BINS = 32
MAX_CHARTS = 12
"""At most this many Custom Scalars charts per kind: deeper models get charts of consecutive layers."""

Layout = dict[str, dict[str, list[str]]]  # category → chart title → tag regexes

_declared: weakref.WeakKeyDictionary[Any, Layout] = weakref.WeakKeyDictionary()
_written: weakref.WeakSet[Any] = weakref.WeakSet()


def chart(*parts: str, variants: bool = True) -> str:
    """The regex of a chart: the tag ``parts`` joined by ``/`` and, with ``variants``, any sub-tags."""
    prefix = re.escape("/".join(parts))
    return f"^{prefix}(/.*)?$" if variants else f"^{prefix}$"


def layer_charts(namespace: str, kind: str, layers: Sequence[str], *, title: str | None = None) -> dict[str, list[str]]:
    """Custom Scalars charts of the tags ``<namespace>/<kind>/<layer>[/<variant>]``, at most :data:`MAX_CHARTS`.

    Up to :data:`MAX_CHARTS` layers: one chart per layer overlaying its variants or, with a ``title``, one
    chart of all layers. Beyond: the layers in model order, cut into at most :data:`MAX_CHARTS` runs of
    consecutive layers (a deep network's stages), one multi-line chart per run, titled by its first and
    last layer (after ``title``, when given).
    """
    layers = list(layers)
    if len(layers) <= MAX_CHARTS:
        if title is not None:
            return {title: [chart(namespace, kind)]} if layers else {}
        return {layer: [chart(namespace, kind, layer)] for layer in layers}
    size = math.ceil(len(layers) / MAX_CHARTS)
    charts = {}
    for start in range(0, len(layers), size):
        run = layers[start : start + size]
        names = "|".join(re.escape(name) for name in run)
        prefix = re.escape(f"{namespace}/{kind}/")
        span = f"{run[0]} … {run[-1]} ({len(run)} layers)"
        charts[f"{title}: {span}" if title is not None else span] = [f"^{prefix}({names})(/.*)?$"]
    return charts


def declare_layout(trainer: pl.Trainer, layout: Layout) -> None:
    """Add charts to the Custom Scalars layout of the Trainer's TensorBoard loggers."""
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            merged = _declared.setdefault(logger, {})
            for category, charts in layout.items():
                merged.setdefault(category, {}).update(charts)


def finite_metrics(metrics: dict[str, float], warn_once: Callable[[str, str], None]) -> dict[str, float]:
    """Drop values that could not be computed (inf, NaN: e.g. the κ of a zero Hessian block, κ(D) with no
    live unit, the κ of a singular weight), with a one-time warning per tag; loggers never see them."""
    for tag, value in metrics.items():
        if not math.isfinite(value):
            warn_once(f"finite:{tag}", f"{tag} = {value} cannot be computed at this step; not logged.")
    return {tag: value for tag, value in metrics.items() if math.isfinite(value)}


@rank_zero_only
def log_metrics(trainer: pl.Trainer, metrics: dict[str, float], step: int) -> None:
    """``logger.log_metrics(metrics, step=step)`` on every logger of the Trainer, from rank zero only."""
    if not metrics:
        return
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger) and logger in _declared and logger not in _written:
            _written.add(logger)
            layout = {
                category: {title: ["Multiline", regexes] for title, regexes in charts.items()}
                for category, charts in _declared[logger].items()
            }
            logger.experiment.add_custom_scalars(layout)
        logger.log_metrics(metrics, step=step)


def has_tensorboard(trainer: pl.Trainer) -> bool:
    """Whether any of the Trainer's loggers is a :class:`TensorBoardLogger`."""
    return any(isinstance(logger, TensorBoardLogger) for logger in trainer.loggers)


@rank_zero_only
def log_tensorboard(
    trainer: pl.Trainer, histograms: dict[str, Tensor], images: dict[str, Tensor], texts: dict[str, str], step: int
) -> None:
    """``add_histogram``/``add_image`` (CHW, values in [0, 1])/``add_text`` on the Trainer's TensorBoard loggers,
    from rank zero only (other loggers have no such records)."""
    for logger in trainer.loggers:
        if not isinstance(logger, TensorBoardLogger):
            continue
        writer = logger.experiment
        for tag, values in histograms.items():
            # 32 equal bins: a layer has tens to thousands of values; TensorBoard's default ("tensorflow", ~1500
            # log-spaced edges through numpy.histogram) cost ~2 ms per histogram, ~15× more
            writer.add_histogram(tag, values.detach().double().cpu(), global_step=step, bins=HISTOGRAM_BINS)
        for tag, image in images.items():
            writer.add_image(tag, image, global_step=step, dataformats="CHW")
        for tag, text in texts.items():
            writer.add_text(tag, text, global_step=step)


# viridis at 10 evenly spaced points (matplotlib's table, sRGB): perceptually uniform and colour-blind safe
_VIRIDIS = (
    torch.tensor(
        [
            [68, 1, 84],
            [72, 40, 120],
            [62, 74, 137],
            [49, 104, 142],
            [38, 130, 142],
            [31, 158, 137],
            [53, 183, 121],
            [109, 205, 89],
            [180, 222, 44],
            [253, 231, 37],
        ]
    )
    / 255.0
)
_MISSING = 0.5  # grey: no value at that step (not logged, or not a record of that layer)
# 3×5 bitmap digits for the colour bar's decade labels (the exponent of 10)
_GLYPHS = {
    "0": "111101101101111",
    "1": "010110010010111",
    "2": "111001111100111",
    "3": "111001111001111",
    "4": "101101111001001",
    "5": "111100111001111",
    "6": "111100111101111",
    "7": "111001001001001",
    "8": "111101111101111",
    "9": "111101111001111",
    "-": "000000111000000",
}


def _colour(t: Tensor) -> Tensor:
    """Viridis colours (…, 3) of ``t`` in [0, 1], linearly interpolated between the table's points."""
    x = t.nan_to_num(0.0).clamp(0.0, 1.0) * (len(_VIRIDIS) - 1)  # NaN cells are painted over by the caller
    low = x.floor().long().clamp(max=len(_VIRIDIS) - 2)
    frac = (x - low).unsqueeze(-1)
    return _VIRIDIS[low] * (1 - frac) + _VIRIDIS[low + 1] * frac


def _text(label: str, scale: int = 2) -> Tensor:
    """A (5·scale, 4·scale·len − scale) mask of ``label`` in the 3×5 digit font."""
    columns = []
    for i, ch in enumerate(label):
        glyph = torch.tensor([int(b) for b in _GLYPHS[ch]], dtype=torch.float32).view(5, 3)
        columns.append(glyph if i == 0 else torch.cat([torch.zeros(5, 1), glyph], 1))
    mask = torch.cat(columns, 1)
    return mask.repeat_interleave(scale, 0).repeat_interleave(scale, 1)


def heatmap_image(values: Tensor, *, max_columns: int = 256) -> Tensor:
    """A (3, H, W) image in [0, 1] of a (rows, columns) matrix of log10 values (NaN: missing, grey).

    Rows top to bottom, columns left to right; beyond ``max_columns`` columns an evenly spaced subset is
    shown. Colours: viridis from ⌊min⌋ to ⌈max⌉ (whole decades); on the right a colour bar with a tick and
    its exponent per decade (every k-th decade when they would crowd).
    """
    rows, cols = values.shape
    if cols > max_columns:
        values = values[:, torch.linspace(0, cols - 1, max_columns).round().long()]
        cols = max_columns
    finite = values[values.isfinite()]
    lo = math.floor(float(finite.min())) if finite.numel() else 0
    hi = max(math.ceil(float(finite.max())) if finite.numel() else 1, lo + 1)
    cell_h, cell_w = max(2, min(16, 256 // rows)), max(1, min(16, 512 // cols))
    body = _colour((values.float() - lo) / (hi - lo))
    body[~values.isfinite()] = _MISSING
    body = body.repeat_interleave(cell_h, 0).repeat_interleave(cell_w, 1)  # (H, W, 3)
    height = max(body.shape[0], 60)
    image = torch.ones(height, body.shape[1] + 40, 3)  # white margin for the colour bar and its labels
    image[: body.shape[0], : body.shape[1]] = body
    x0 = body.shape[1] + 4
    ramp = torch.linspace(1.0, 0.0, height).unsqueeze(1).expand(height, 8)  # top: hi, bottom: lo
    image[:, x0 : x0 + 8] = _colour(ramp)
    decades = hi - lo
    stride = max(1, math.ceil(decades * 12 / height))  # a label is 10 px high: keep ≥ 12 px between them
    for exponent in range(lo, hi + 1, stride):
        y = round((hi - exponent) / decades * (height - 1))
        image[y, x0 : x0 + 11] = 0.0  # tick
        label = _text(str(exponent))
        top = min(max(y - label.shape[0] // 2, 0), height - label.shape[0])
        region = image[top : top + label.shape[0], x0 + 12 : x0 + 12 + label.shape[1]]
        region[label[:, : region.shape[1]] > 0] = 0.0
    return image.permute(2, 0, 1).contiguous()
