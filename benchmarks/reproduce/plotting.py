"""Matplotlib helpers shared by the experiments' figures (Agg backend, small palette PNGs)."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import torch

from benchmarks.reproduce.runs import Run


def plt_module() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig: Any, path: Path) -> None:
    """Save as a 128-colour palette PNG (about a third of the RGBA size) and close the figure."""
    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=72)
    plt_module().close(fig)
    buf.seek(0)
    Image.open(buf).convert("RGB").quantize(colors=128).save(path, optimize=True)


def band(ax: Any, runs: list[Run], attr: str, label: str, color: Any, **style: Any) -> None:
    """Mean line and min–max band over the seeds of one recorded attribute of the runs."""
    curves(ax, runs[0].steps, [getattr(r, attr) for r in runs], label, color, **style)


def curves(ax: Any, steps: list[int], values: list[list[float]], label: str, color: Any, **style: Any) -> None:
    """Mean line and min–max band of several curves over the same steps (``nan`` entries ignored)."""
    t = torch.tensor(values, dtype=torch.float64)
    ax.plot(steps, t.nanmean(0).numpy(), label=label, color=color, **style)
    lo = torch.nan_to_num(t, nan=math.inf).amin(0)
    hi = torch.nan_to_num(t, nan=-math.inf).amax(0)
    ax.fill_between(steps, lo.numpy(), hi.numpy(), color=color, alpha=0.15, lw=0)
