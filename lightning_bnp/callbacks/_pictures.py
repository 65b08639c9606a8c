"""The monitor's TensorBoard pictures: histograms of BNP's σ̃ and μ, and the κ heatmaps.

:func:`bnp_histograms` gives σ̃ (what BNP divides by) and μ of each BNP layer's latest step, per input
feature or channel (``bnp/sigma_tilde/<layer>``, ``bnp/mu/<layer>``). The heatmaps are layer × record-step
histories of log10 κ(D) and log10 weight κ (``bnp/heatmap/kappa_D``, ``bnp/heatmap/weight_kappa``).

κ(D) of a badly scaled network spans decades across layers and training (paper 000, §5.1, Fig. 8: 1e2–1e5,
and §5.1 reads κ(D)² as BNP's gain), which one image shows at a glance: one row per layer (model order, top
to bottom), one column per record step, the colour log10 κ.

:class:`HeatmapHistory` keeps the columns (at most :data:`KEEP`, older ones halved; saved in the monitor's
checkpoint state, so a resumed run continues the same image). :func:`heatmap_picture` draws them for
TensorBoard's *Images* tab: with matplotlib (installed with the ``examples`` extra; imported on the first
picture) a titled figure whose y axis names the layers, whose x axis gives the optimizer step of each record
and whose colour bar is labelled in decades (10^k); without it the plain-torch image of
:func:`._logging.heatmap_image` (cells and a colour bar with the exponents). A text legend under the same tag
names the rows either way.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from lightning_bnp.callbacks._logging import heatmap_image
from lightning_bnp.core.preconditioner import BNPPreconditioner

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "EVERY",
    "KEEP",
    "KINDS",
    "HeatmapHistory",
    "bnp_histograms",
    "finite_histograms",
    "heatmap_figure",
    "heatmap_picture",
    "legend",
]

EVERY = 10
"""Heatmap images are written on records 1, 11, 21, … of a fit (each holds the whole history)."""
KEEP = 512
"""Columns kept; the plain-torch image shows at most 256 of them, evenly spaced."""

KINDS = {  # kind → (the scalar tag it plots, the quantity, the title)
    "kappa_D": ("bnp/kappa_D/{}", "κ(D)", "log10 κ(D) (raw input statistics, paper 000 §5.1)"),
    "weight_kappa": ("bnp/weight_kappa/{}/raw", "weight κ", "log10 weight κ (raw)"),
}

MAX_LABELS = 40
"""At most this many layer names on the y axis (a ResNet-110 has 110 rows: every k-th is named)."""


def bnp_histograms(pre: BNPPreconditioner, layers: Collection[str]) -> dict[str, Tensor]:
    """σ̃ and μ (centred layers only) of the BNP layers among ``layers`` that BNP transformed in its latest step
    (as for κ(D))."""
    histograms: dict[str, Tensor] = {}
    for name, layer in pre.layers.items():
        if name in layers and layer.transform is not None:
            histograms[f"bnp/sigma_tilde/{name}"] = layer.transform.var_t.sqrt()
            if layer.transform.mu is not None:
                histograms[f"bnp/mu/{name}"] = layer.transform.mu
    return histograms


def finite_histograms(histograms: dict[str, Tensor], warn_once: Callable[[str, str], None]) -> dict[str, Tensor]:
    """The ``histograms`` whose values are all finite; one warning per tag that has others."""
    for tag in [t for t, values in histograms.items() if not bool(values.isfinite().all())]:
        warn_once(f"finite:{tag}", f"{tag} has non-finite values at this step; histogram not logged.")
    return {tag: values for tag, values in histograms.items() if bool(values.isfinite().all())}


class HeatmapHistory:
    """The heatmaps' columns: ``steps`` (record steps) and ``values`` (kind → layer → log10 κ per column, NaN:
    none at that record)."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.values: dict[str, dict[str, list[float]]] = {}
        self.records = 0  # records seen by this fit's monitor (the images are written on every EVERY-th)
        self.legend_written = False

    def add(self, metrics: dict[str, float], layers: Sequence[str], step: int) -> None:
        """Add this record's column (log10 of the logged κ(D) and raw weight κ of each layer)."""
        column = {
            kind: {name: math.log10(metrics[tag]) for name in layers if (tag := pattern.format(name)) in metrics}
            for kind, (pattern, _, _) in KINDS.items()
        }
        self.steps.append(step)
        self.records += 1
        for kind, values in column.items():
            rows = self.values.setdefault(kind, {}) if values else self.values.get(kind, {})
            for name in values.keys() - rows.keys():
                rows[name] = [math.nan] * (len(self.steps) - 1)
            for name, row in rows.items():
                row.append(values.get(name, math.nan))
        if len(self.steps) > KEEP:  # keep every other column (and the newest): bounded memory
            keep = [*range(0, len(self.steps) - 1, 2), len(self.steps) - 1]
            self.steps = [self.steps[i] for i in keep]
            for rows in self.values.values():
                for name, row in rows.items():
                    rows[name] = [row[i] for i in keep]

    def pictures(self, layers: Sequence[str]) -> tuple[dict[str, Tensor], dict[str, str]]:
        """The images (``bnp/heatmap/<kind>``) due at the latest record — the first and every :data:`EVERY`-th
        (rendering and encoding both on every record cost ~5 ms on the digits network) — and, once per fit,
        their legends."""
        images: dict[str, Tensor] = {}
        texts: dict[str, str] = {}
        if (self.records - 1) % EVERY != 0:
            return images, texts
        for kind, rows in self.values.items():
            names = [name for name in layers if name in rows]
            if not names:
                continue
            matrix = torch.tensor([rows[n] for n in names])
            images[f"bnp/heatmap/{kind}"] = heatmap_picture(kind, matrix, names, self.steps)
            if not self.legend_written:
                texts[f"bnp/heatmap/{kind}"] = legend(kind, names)
        self.legend_written = self.legend_written or bool(texts)
        return images, texts

    def state_dict(self) -> dict[str, Any]:
        return {"heat_steps": list(self.steps), "heat": {k: dict(v) for k, v in self.values.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps = list(state_dict.get("heat_steps", []))
        self.values = {k: dict(v) for k, v in state_dict.get("heat", {}).items()}


def has_matplotlib() -> bool:
    """Whether matplotlib is installed (the ``examples`` extra; not a dependency of this package)."""
    return importlib.util.find_spec("matplotlib") is not None


def legend(kind: str, rows: list[str]) -> str:
    """The text next to a heatmap in TensorBoard: what its rows, columns and colours are."""
    names = ", ".join(f"`{name}`" for name in rows)
    columns = "One column per record step, left to right"
    if has_matplotlib():
        scale = f"{columns} (the x axis gives the optimizer step). Colour: viridis over whole decades of the bar"
    else:
        scale = f"{columns} (at most 256, evenly spaced). Colour: viridis over whole decades, the exponent on the bar"
    return f"**{KINDS[kind][2]}**: one row per layer, top to bottom: {names}. {scale} at the right; grey: no value."


def heatmap_picture(kind: str, values: Tensor, rows: Sequence[str], steps: Sequence[int]) -> Tensor:
    """The (3, H, W) image in [0, 1] of a heatmap: :func:`heatmap_figure` rendered when matplotlib is installed,
    else :func:`._logging.heatmap_image` of ``values``."""
    if not has_matplotlib():
        return heatmap_image(values)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    figure = heatmap_figure(kind, values, rows, steps)
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    rgb = np.asarray(canvas.buffer_rgba())[..., :3]
    return torch.from_numpy(rgb.copy()).permute(2, 0, 1).float() / 255.0


def heatmap_figure(kind: str, values: Tensor, rows: Sequence[str], steps: Sequence[int]) -> Figure:
    """A matplotlib figure (not drawn yet) of ``values`` (layers × records, log10 κ; NaN: none, grey).

    Title: what is plotted; y axis: ``"layer (model order)"`` with the layer names (every k-th beyond
    :data:`MAX_LABELS`); x axis: ``"optimizer step"`` with the record steps at up to 8 ticks; colour bar:
    viridis from ⌊min⌋ to ⌈max⌉ decades, ticks labelled 10^k (every k-th decade beyond 10) and the
    quantity's name. Built on ``matplotlib.figure.Figure`` with no pyplot state, so it needs no display; the
    margins are computed from the label lengths (a layout engine would triple the drawing time).
    """
    import matplotlib
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    _, quantity, title = KINDS[kind]
    data = values.double().cpu().numpy()
    n_rows = data.shape[0]
    finite = data[np.isfinite(data)]
    lo = math.floor(float(finite.min())) if finite.size else 0
    hi = max(math.ceil(float(finite.max())) if finite.size else 1, lo + 1)
    shown = range(0, n_rows, max(1, math.ceil(n_rows / MAX_LABELS)))
    font = 8 if len(shown) > 12 else 10
    width, height = 800, round(min(160 + 18 * len(shown), 1000))  # pixels at dpi 100
    left = 60 + 0.62 * font * max(len(rows[i]) for i in shown)  # y-axis label + the longest layer name
    figure = Figure(figsize=(width / 100, height / 100), dpi=100)
    axes = figure.add_axes((left / width, 50 / height, 1 - (left + 110) / width, 1 - 85 / height))
    cax = figure.add_axes((1 - 95 / width, 50 / height, 15 / width, 1 - 85 / height))
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad=(0.5, 0.5, 0.5))
    masked = np.ma.masked_invalid(data)
    image = axes.imshow(masked, aspect="auto", cmap=cmap, vmin=lo, vmax=hi, interpolation="nearest")
    axes.set_yticks(list(shown), labels=[rows[i] for i in shown], fontsize=font)
    axes.set_ylabel("layer (model order)")
    axes.xaxis.set_major_locator(MaxNLocator(nbins=8, integer=True, min_n_ticks=1))
    axes.xaxis.set_major_formatter(FuncFormatter(lambda x, _: _step_label(steps, x)))
    axes.set_xlabel("optimizer step (one column per record)")
    axes.set_title(title)
    bar = figure.colorbar(image, cax=cax)
    decades = range(lo, hi + 1, max(1, math.ceil((hi - lo) / 10)))
    bar.set_ticks(list(decades), labels=[f"10{str(k).translate(_SUPERSCRIPT)}" for k in decades])
    bar.set_label(f"{quantity} (log scale)")
    return figure


_SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")  # 10⁻³: plain text, ~10× faster to lay out than mathtext


def _step_label(steps: Sequence[int], x: float) -> str:
    """The optimizer step of heatmap column ``x`` (an integer tick inside the image), else no label."""
    index = round(x)
    return str(steps[index]) if abs(x - index) < 1e-9 and 0 <= index < len(steps) else ""
