"""The BNP paper's networks (paper 000, §5 and Appendix B), with optional normalization layers.

* :func:`fc_network` — the fully connected network of Ioffe & Szegedy used in §5: hidden layers of
  100 with ReLU, post-activation BN/LN as the paper places them.
* :func:`cnn5` — the 5-layer CNN of §5: three 3×3 convolutions with 32-64-32 filters and two dense
  layers, with optional BN/GN after each convolution's activation.

Weights use Glorot-uniform and biases zero, as in Appendix B.
"""

from __future__ import annotations

from typing import Literal

from torch import nn

Norm = Literal["none", "bn", "ln", "gn"]


def glorot_init_(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
    return model


def fc_network(
    in_features: int = 64, num_classes: int = 10, hidden: int = 100, depth: int = 3, norm: Norm = "none"
) -> nn.Sequential:
    """``depth`` hidden layers of ``hidden`` units, ReLU, optional post-activation BN or LN."""
    if norm not in ("none", "bn", "ln"):
        raise ValueError(f"`norm` must be 'none', 'bn' or 'ln' for the FC network, got {norm!r}")
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        if norm == "bn":
            layers.append(nn.BatchNorm1d(hidden))
        elif norm == "ln":
            layers.append(nn.LayerNorm(hidden))
        width = hidden
    layers.append(nn.Linear(width, num_classes))
    return glorot_init_(nn.Sequential(*layers))  # type: ignore[return-value]


def cnn5(
    in_channels: int = 1, image_size: int = 8, num_classes: int = 10, norm: Norm = "none", groups: int = 4
) -> nn.Sequential:
    """conv32-pool-conv64-pool-conv32-dense64-dense, 3×3 'same' convolutions, ReLU."""
    if norm not in ("none", "bn", "gn"):
        raise ValueError(f"`norm` must be 'none', 'bn' or 'gn' for the CNN, got {norm!r}")

    def block(c_in: int, c_out: int, pool: bool) -> list[nn.Module]:
        mods: list[nn.Module] = [nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU()]
        if norm == "bn":
            mods.append(nn.BatchNorm2d(c_out))
        elif norm == "gn":
            mods.append(nn.GroupNorm(groups, c_out))
        if pool:
            mods.append(nn.MaxPool2d(2))
        return mods

    side = image_size // 4
    return glorot_init_(  # type: ignore[return-value]
        nn.Sequential(
            *block(in_channels, 32, True),
            *block(32, 64, True),
            *block(64, 32, False),
            nn.Flatten(),
            nn.Linear(32 * side * side, 64),
            nn.ReLU(),
            nn.Linear(64, num_classes),
        )
    )
