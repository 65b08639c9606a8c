"""The monitor's TensorBoard pictures: histograms of BNP's σ̃ and μ, and the κ heatmaps.

:func:`bnp_histograms` gives σ̃ (what BNP divides by) and μ of each BNP layer's latest step, per input
feature or channel (``bnp/sigma_tilde/<layer>``, ``bnp/mu/<layer>``). The heatmaps are layer × record-step
histories of log10 κ(D) and log10 weight κ (``bnp/heatmap/kappa_D``, ``bnp/heatmap/weight_kappa``).

κ(D) of a badly scaled network spans decades across layers and training (paper 000, §5.1, Fig. 8: 1e2–1e5,
and §5.1 reads κ(D)² as BNP's gain), which one image shows at a glance: one row per layer (model order, top
to bottom), one column per record step, the colour log10 κ.

:class:`HeatmapHistory` keeps the columns (at most :data:`KEEP`, older ones halved; saved in the monitor's
checkpoint state, so a resumed run continues the same image); :func:`heatmap_picture` draws them for
TensorBoard's *Images* tab with plain torch (:func:`._logging.heatmap_image`), a text legend names the rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_bnp.callbacks._logging import heatmap_image
from lightning_bnp.core.preconditioner import BNPPreconditioner

__all__ = [
    "EVERY",
    "KEEP",
    "KINDS",
    "HeatmapHistory",
    "bnp_histograms",
    "finite_histograms",
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


def legend(kind: str, rows: list[str]) -> str:
    """The text next to a heatmap in TensorBoard: what its rows, columns and colours are."""
    names = ", ".join(f"`{name}`" for name in rows)
    return (
        f"**{KINDS[kind][2]}**: one row per layer, top to bottom: {names}. One column per record step, left to "
        "right (at most 256, evenly spaced). Colour: viridis over whole decades, the exponent on the bar at the "
        "right; grey: no value."
    )


def heatmap_picture(kind: str, values: Tensor, rows: Sequence[str], steps: Sequence[int]) -> Tensor:
    """The (3, H, W) image in [0, 1] of a heatmap: :func:`._logging.heatmap_image` of ``values``."""
    return heatmap_image(values)
