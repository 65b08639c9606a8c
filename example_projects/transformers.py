"""Two small Transformers built on ``nn.MultiheadAttention`` (issue 24's evidence and the ``transformer`` example),
and the offline text corpus the language model reads.

* :class:`ViT` — a Vision Transformer for 28×28 digits: 7×7 patches embedded by one ``nn.Linear`` (16 tokens),
  a learned positional embedding, pre-norm blocks, mean-pooled tokens and a linear head.
* :class:`CharLM` — a causal character-level (byte-level) language model: ``nn.Embedding`` of the 256 byte
  values, a learned positional embedding, pre-norm blocks with a causal mask, a linear head to the 256 bytes.

Each block is ``x + attn(n1(x))``, ``x + mlp(n2(x))`` with ``nn.MultiheadAttention`` (``batch_first``, no dropout)
and a 4d GELU MLP; ``norm="ln"`` makes ``n1``, ``n2`` and the final norm ``nn.LayerNorm``, ``norm="none"`` makes
them identities (the network BNP is meant to train without normalization). With defaults BNP transforms every
weight matrix: the patch embedding, q, k, v, ``out_proj``, both MLP layers and the head (the positional
parameters and the token embedding aside).

:func:`torch_corpus` is the text every machine has without a download: the ``.py`` sources of the installed
``torch`` package, files in sorted order of their path inside the package, concatenated, the first
``max_bytes`` bytes. It differs between torch versions: the benchmark can cache it (``--data-cache``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from torch import Tensor, nn

TransformerNorm = Literal["ln", "none"]
VOCAB = 256  # bytes: the torch sources are ASCII but for a few hundred bytes in 2 MB
CORPUS_BYTES = 2_000_000
CORPUS_SPLITS = {"train": 0.9, "val": 0.05, "test": 0.05}  # in this order along the text


def _norm(norm: TransformerNorm, d: int) -> nn.Module:
    if norm not in ("ln", "none"):
        raise ValueError(f"`norm` must be 'ln' or 'none', got {norm!r}")
    return nn.LayerNorm(d) if norm == "ln" else nn.Identity()


class Block(nn.Module):
    """Pre-norm Transformer block: ``x + attn(n1(x))`` then ``x + W2·GELU(W1·n2(x))``."""

    def __init__(self, d: int, heads: int, norm: TransformerNorm) -> None:
        super().__init__()
        self.n1, self.n2 = _norm(norm, d), _norm(norm, d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        h = self.n1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.n2(x))


class ViT(nn.Module):
    """A small Vision Transformer: ``patch``×``patch`` patches → ``nn.Linear`` → ``depth`` blocks → mean → head.

    Args:
        input_shape: image shape (c, h, w); h and w must be multiples of ``patch``.
        num_classes: outputs of the head.
        patch: patch side (7 on 28×28: 16 tokens of 49 pixels).
        d: token width.
        depth: number of blocks.
        heads: attention heads (must divide ``d``).
        norm: ``"ln"`` (LayerNorm in every block and before the head) or ``"none"``.
    """

    def __init__(
        self,
        input_shape: tuple[int, int, int] = (1, 28, 28),
        num_classes: int = 10,
        *,
        patch: int = 7,
        d: int = 64,
        depth: int = 2,
        heads: int = 4,
        norm: TransformerNorm = "ln",
    ) -> None:
        super().__init__()
        c, h, w = input_shape
        if h % patch or w % patch:
            raise ValueError(f"`patch` must divide the image's height and width {h}×{w}, got {patch}")
        self.patch = patch
        self.embed = nn.Linear(c * patch * patch, d)
        self.pos = nn.Parameter(0.02 * torch.randn(h // patch * (w // patch), d))
        self.blocks = nn.ModuleList(Block(d, heads, norm) for _ in range(depth))
        self.norm = _norm(norm, d)
        self.head = nn.Linear(d, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        p = self.patch
        b, c, h, w = x.shape
        tokens = x.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(b, -1, c * p * p)
        z = self.embed(tokens) + self.pos
        for block in self.blocks:
            z = block(z)
        return self.head(self.norm(z).mean(1))


class CharLM(nn.Module):
    """A causal byte-level language model: logits (B, T, ``vocab``) for the next byte at every position.

    Args:
        vocab: number of token values (256 bytes).
        d: token width.
        depth: number of blocks.
        heads: attention heads (must divide ``d``).
        context: the longest sequence (the positional embedding's length).
        norm: ``"ln"`` or ``"none"``.
    """

    def __init__(
        self,
        vocab: int = VOCAB,
        *,
        d: int = 128,
        depth: int = 2,
        heads: int = 4,
        context: int = 64,
        norm: TransformerNorm = "ln",
    ) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d)
        nn.init.normal_(self.tokens.weight, std=0.02)
        self.pos = nn.Parameter(0.02 * torch.randn(context, d))
        self.blocks = nn.ModuleList(Block(d, heads, norm) for _ in range(depth))
        self.norm = _norm(norm, d)
        self.head = nn.Linear(d, vocab)
        # True above the diagonal: position t attends to positions ≤ t only
        self.register_buffer("causal", torch.ones(context, context, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        if t > self.pos.shape[0]:
            raise ValueError(f"sequence length must be <= context {self.pos.shape[0]}, got {t}")
        z = self.tokens(idx) + self.pos[:t]
        causal: Tensor = self.causal  # type: ignore[assignment]
        mask = causal[:t, :t]
        for block in self.blocks:
            z = block(z, mask)
        return self.head(self.norm(z))


def torch_corpus(max_bytes: int = CORPUS_BYTES) -> bytes:
    """The first ``max_bytes`` bytes of the installed torch package's ``.py`` files, concatenated in the sorted
    order of their POSIX paths relative to the package (deterministic for one torch version)."""
    if max_bytes < 1:
        raise ValueError(f"`max_bytes` must be >= 1, got {max_bytes}")
    root = Path(torch.__file__).parent
    buf = bytearray()
    for rel in sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py")):
        buf += (root / rel).read_bytes()
        if len(buf) >= max_bytes:
            break
    return bytes(buf[:max_bytes])


def corpus_splits(text: bytes) -> dict[str, Tensor]:
    """``{"train"|"val"|"test": token ids (n,) int64}``: the text's first 90%, next 5% and last 5%."""
    ids = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    n_train = int(len(ids) * CORPUS_SPLITS["train"])
    n_val = int(len(ids) * CORPUS_SPLITS["val"])
    return {"train": ids[:n_train], "val": ids[n_train : n_train + n_val], "test": ids[n_train + n_val :]}
