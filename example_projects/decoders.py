"""An autoencoder whose decoder upsamples with transposed convolutions (the ``autoencoder`` example and §9 of
``benchmarks/RESULTS.md``).

:func:`conv_autoencoder` on 1×28×28 digits: ``784 → 64 → 32·7·7``, then two stride-2 ``nn.ConvTranspose2d``
(kernel 4, padding 1) back to ``16·14·14 → 1·28·28``, ReLU between the layers and no activation on the output (a
squared reconstruction error on pixels in [0, 1]). With ``norm="bn"`` a ``BatchNorm2d`` sits after the decoder's
reshape and after its first transposed convolution: the DCGAN-style decoder whose batch coupling BNP replaces. Every
weight matrix is a layer BNP transforms: both Linears and both transposed convolutions.
"""

from __future__ import annotations

from typing import Literal

from torch import nn

DecoderNorm = Literal["none", "bn"]


def conv_autoencoder(
    input_shape: tuple[int, int, int] = (1, 28, 28), *, code: int = 64, width: int = 32, norm: DecoderNorm = "none"
) -> nn.Sequential:
    """Encoder ``Linear(c·h·w, code)``, ReLU; decoder ``Linear(code, width·h/4·w/4)``, reshape, two stride-2
    ``ConvTranspose2d`` (``width → width/2 → c`` channels), each doubling the side.

    Args:
        input_shape: image shape (c, h, w); h and w must be multiples of 4 (28×28 digits: a 7×7 map after the
            reshape; 32×32 CIFAR: 8×8).
        code: width of the bottleneck.
        width: channels of the decoder's first map (even).
        norm: ``"none"`` or ``"bn"`` (``BatchNorm2d`` after the reshape and after the first transposed convolution).

    Raises:
        ValueError: a side not a multiple of 4, an odd or non-positive ``width``, or an unknown ``norm``.
    """
    c, h, w = input_shape
    if h % 4 or w % 4 or h < 4 or w < 4:
        raise ValueError(f"`input_shape` must have a height and width that are multiples of 4, got {h}×{w}")
    if width < 2 or width % 2:
        raise ValueError(f"`width` must be an even integer >= 2, got {width}")
    if norm not in ("none", "bn"):
        raise ValueError(f"`norm` must be 'none' or 'bn', got {norm!r}")
    bn = norm == "bn"
    return nn.Sequential(
        nn.Flatten(), nn.Linear(c * h * w, code), nn.ReLU(), nn.Linear(code, width * (h // 4) * (w // 4)),
        nn.Unflatten(1, (width, h // 4, w // 4)), nn.BatchNorm2d(width) if bn else nn.Identity(), nn.ReLU(),
        nn.ConvTranspose2d(width, width // 2, 4, stride=2, padding=1),
        nn.BatchNorm2d(width // 2) if bn else nn.Identity(), nn.ReLU(),
        nn.ConvTranspose2d(width // 2, c, 4, stride=2, padding=1),
    )  # fmt: skip
