"""Rank-zero logging of the monitors' metrics to every logger, and their TensorBoard layout.

Tags are ``<namespace>/<kind>/<layer>[/<variant>]`` (e.g. ``bnp/hessian_kappa/network.4/original``)
or ``timing/<kind>``. TensorBoard's *Scalars* tab groups tags by their first component only, so the
monitors also register a *Custom Scalars* layout: one category per kind (``bnp/hessian_kappa``,
``timing``, …) and, in it, one chart per layer that overlays its variants (original and
preconditioned; raw and conditioned). Each monitor declares its charts in ``on_fit_start``
(:func:`declare_layout`); the union is written once, with the first record, because TensorBoard
reads only the first layout of a run.
"""

from __future__ import annotations

import re
import weakref
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only

__all__ = ["chart", "declare_layout", "log_metrics"]

Layout = dict[str, dict[str, list[str]]]  # category → chart title → tag regexes

_declared: weakref.WeakKeyDictionary[Any, Layout] = weakref.WeakKeyDictionary()
_written: weakref.WeakSet[Any] = weakref.WeakSet()


def chart(*parts: str, variants: bool = True) -> str:
    """The regex of a chart: the tag ``parts`` joined by ``/`` and, with ``variants``, any sub-tags."""
    prefix = re.escape("/".join(parts))
    return f"^{prefix}(/.*)?$" if variants else f"^{prefix}$"


def declare_layout(trainer: pl.Trainer, layout: Layout) -> None:
    """Add charts to the Custom Scalars layout of the Trainer's TensorBoard loggers."""
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            merged = _declared.setdefault(logger, {})
            for category, charts in layout.items():
                merged.setdefault(category, {}).update(charts)


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
