"""A text that ships with Python and a character-level recurrent model (the ``char_rnn`` example and
``benchmarks/recurrent.py``, §8 of ``benchmarks/RESULTS.md``).

:func:`corpus` is the docstrings of a fixed list of standard-library modules and of their public classes and
functions: English prose with code, the same on every machine with the same Python, nothing downloaded.
:func:`text_splits` encodes it as character indices and splits it in order into train / validation / test
(80 / 10 / 10 %). :class:`CharRNN` is an embedding, one one-layer ``nn.LSTM`` or ``nn.GRU`` and a linear read-out of
the next character; BNP transforms the recurrent layer's ``weight_ih`` and ``weight_hh`` and the read-out (the
embedding is a lookup, left to the optimizer).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Literal

import torch
from torch import Tensor, nn

Cell = Literal["LSTM", "GRU"]
MODULES = (
    *("argparse", "collections", "difflib", "functools", "json", "logging", "pathlib", "shutil", "string"),
    *("textwrap", "statistics", "fractions", "calendar", "heapq", "bisect", "pprint", "random", "itertools"),
)
SPLITS = {"train": 0.8, "val": 0.1, "test": 0.1}  # in this order along the text
EMBED, HIDDEN = 32, 128


def corpus() -> str:
    """The docstrings of :data:`MODULES` and of their public classes and functions, in a fixed order."""
    parts = []
    for name in MODULES:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for attribute in sorted(vars(module)):
            value = getattr(module, attribute)
            if not attribute.startswith("_") and (inspect.isclass(value) or inspect.isfunction(value)):
                if getattr(value, "__module__", None) == name:
                    parts.append(inspect.getdoc(value) or "")
    return "\n\n".join(p for p in parts if p)


def text_splits() -> tuple[dict[str, Tensor], int]:
    """``({"train"|"val"|"test": character indices (n,) int64}, vocabulary size)``: :func:`corpus` encoded by the
    sorted set of its characters, split in order by :data:`SPLITS`."""
    text = corpus()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in text], dtype=torch.int64)
    a, b = int(SPLITS["train"] * len(data)), int((1 - SPLITS["test"]) * len(data))
    return {"train": data[:a], "val": data[a:b], "test": data[b:]}, len(chars)


class CharRNN(nn.Module):
    """Embedding → one-layer ``cell`` (``"LSTM"`` or ``"GRU"``, ``batch_first``) → linear read-out of the next
    character: tokens ``(n, t)`` → logits ``(n, t, vocabulary)``, the state starting at zero.

    Args:
        cell: ``"LSTM"`` or ``"GRU"``.
        vocabulary: number of distinct characters.
        embed: width of the character embedding.
        hidden: units of the recurrent layer.

    Raises:
        ValueError: an unknown ``cell``.
    """

    def __init__(self, cell: str, vocabulary: int, *, embed: int = EMBED, hidden: int = HIDDEN) -> None:
        super().__init__()
        if cell not in ("LSTM", "GRU"):
            raise ValueError(f"`cell` must be 'LSTM' or 'GRU', got {cell!r}")
        self.embed = nn.Embedding(vocabulary, embed)
        self.rnn = (nn.LSTM if cell == "LSTM" else nn.GRU)(embed, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocabulary)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.rnn(self.embed(tokens))[0])
