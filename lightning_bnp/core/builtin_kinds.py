"""Registers the layer kinds BNP knows out of the box, in the order they are matched (imported by
:mod:`lightning_bnp.core`, so the registry is complete once any part of the core is imported).

``nn.Linear``, ``nn.Conv{1,2,3}d``, GPT-2's ``transformers.Conv1D`` and ``nn.Embedding`` (:mod:`~lightning_bnp.core.
kinds`); the q, k, v projections and ``out_proj`` of ``nn.MultiheadAttention`` and torchvision's Swin attention's
``qkv`` and ``proj``, used through ``F.linear`` (:mod:`~lightning_bnp.core.attention`); ``nn.ConvTranspose{1,2,3}d``,
each in the family of the convolution of its dimension (:mod:`~lightning_bnp.core.transposed_conv`); the blocks of
one-layer ``nn.RNN``/``nn.LSTM``/``nn.GRU`` and of their cells (:mod:`~lightning_bnp.core.recurrent`). Registered
here, above those modules, so that none imports another's kinds.
"""

from __future__ import annotations

from torch import nn

from lightning_bnp.core.attention import FunctionalLinearKind, MHAOutProjKind, MHAProjectionKind
from lightning_bnp.core.kinds import (
    ConvNdKind,
    EmbeddingKind,
    LinearKind,
    TransformersConv1DKind,
    register_built_in_kinds,
)
from lightning_bnp.core.recurrent import recurrent_kinds
from lightning_bnp.core.transposed_conv import ConvTransposeNdKind

__all__: list[str] = []

# torchvision's Swin (V1 and V2 share the class hierarchy): qkv and proj go through F.linear
_SWIN = "torchvision.models.swin_transformer.ShiftedWindowAttention"

register_built_in_kinds(
    LinearKind(),
    ConvNdKind("Conv1d", nn.Conv1d),
    ConvNdKind("Conv2d", nn.Conv2d),
    ConvNdKind("Conv3d", nn.Conv3d),
    TransformersConv1DKind(),
    EmbeddingKind(),
    *(MHAProjectionKind(block) for block in range(3)),
    MHAOutProjKind(nn.MultiheadAttention, "out_proj", name="MultiheadAttention.out_proj"),
    FunctionalLinearKind(_SWIN, "qkv", name="torchvision.ShiftedWindowAttention.qkv"),
    FunctionalLinearKind(_SWIN, "proj", name="torchvision.ShiftedWindowAttention.proj"),
    *recurrent_kinds(),
    *(ConvTransposeNdKind(f"ConvTranspose{d}d", getattr(nn, f"ConvTranspose{d}d"), f"Conv{d}d") for d in (1, 2, 3)),
)
