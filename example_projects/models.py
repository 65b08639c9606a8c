"""The BNP paper's networks (paper 000, §5 and Appendix B), with optional normalization layers.

* :func:`fc_network` — the fully connected network of Ioffe & Szegedy used in §5: hidden layers of
  100 with ReLU, post-activation BN/LN as the paper places them.
* :func:`cnn5` — the 5-layer CNN of §5 (TensorFlow's CNN tutorial): three 3×3 'valid' convolutions
  with 32-64-32 filters, max-pooling after the first two, and two dense layers, with optional BN/GN
  after each convolution's activation.
* :func:`cifar_resnet` — the CIFAR ResNet of He et al. (2016a) used in §5 "Residual Networks"
  (depth 6n+2: 20, 32, 44, 56, 110, …) with BN, GN or no normalization.

The FC network and the CNN use Glorot-uniform weights and zero biases, as in Appendix B; the ResNet
uses He-normal weights, optionally scaled (Appendix B: ×0.1 for BNP+GN on CIFAR-10).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn
from typing_extensions import override

Norm = Literal["none", "bn", "ln", "gn"]
Padding = Literal["valid", "same"]


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
    in_channels: int = 1,
    image_size: int = 28,
    num_classes: int = 10,
    norm: Norm = "none",
    groups: int = 4,
    padding: Padding = "valid",
) -> nn.Sequential:
    """conv32-pool-conv64-pool-conv32-dense64-dense, 3×3 convolutions, ReLU.

    ``padding="valid"`` (default) is the network the paper cites (§5, Appendix B: TensorFlow's CNN
    tutorial, whose ``Conv2D`` layers use TensorFlow's default 'valid' padding): on 3×32×32 CIFAR-10
    the feature maps are 30 → 15 → 13 → 6 → 4, so the first dense layer sees 4·4·32 = 512 inputs; on
    28×28 MNIST 3·3·32 = 288. It needs images of at least 18×18. ``padding="same"`` keeps every
    convolution's size (32 → 16 → 8: 2,048 inputs on CIFAR-10) and works down to 4×4 (the 8×8 digits).

    Raises:
        ValueError: ``norm`` or ``padding`` is unknown, or the image is too small for 'valid' padding.
    """
    if norm not in ("none", "bn", "gn"):
        raise ValueError(f"`norm` must be 'none', 'bn' or 'gn' for the CNN, got {norm!r}")
    if padding not in ("valid", "same"):
        raise ValueError(f"`padding` must be 'valid' or 'same', got {padding!r}")
    trim = 2 if padding == "valid" else 0  # a 3×3 'valid' convolution loses one pixel on each side
    side = ((image_size - trim) // 2 - trim) // 2 - trim
    if side < 1:
        raise ValueError(
            f"`image_size` {image_size} is too small for the {padding!r}-padding CNN (needs >= 18; "
            "use padding='same' for smaller images)"
        )

    def block(c_in: int, c_out: int, pool: bool) -> list[nn.Module]:
        mods: list[nn.Module] = [nn.Conv2d(c_in, c_out, 3, padding=1 if padding == "same" else 0), nn.ReLU()]
        if norm == "bn":
            mods.append(nn.BatchNorm2d(c_out))
        elif norm == "gn":
            mods.append(nn.GroupNorm(groups, c_out))
        if pool:
            mods.append(nn.MaxPool2d(2))
        return mods

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


def he_normal_init_(model: nn.Module, scale: float = 1.0) -> nn.Module:
    """He-normal (fan-in, ReLU gain) weights times ``scale`` for Linear/Conv; zero biases; norms γ=1, β=0."""
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")
            with torch.no_grad():
                m.weight.mul_(scale)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
    return model


def _norm2d(norm: Norm, channels: int, groups: int) -> nn.Module:
    if norm == "bn":
        return nn.BatchNorm2d(channels)
    if norm == "gn":
        if channels % groups:
            raise ValueError(f"`groups` must divide every stage width (16, 32, 64), got {groups}")
        return nn.GroupNorm(groups, channels)
    return nn.Identity()


class BasicBlock(nn.Module):
    """conv3×3-norm-ReLU-conv3×3-norm, plus the shortcut, then ReLU (He et al. 2016a).

    The shortcut is the parameter-free "option A" of the CIFAR ResNets: identity, or for a stride-2
    block the input subsampled by 2 and zero-padded to the new width. Convolutions followed by a
    normalization layer have no bias (the norm's β plays its role).
    """

    def __init__(self, c_in: int, c_out: int, stride: int, norm: Norm, groups: int) -> None:
        super().__init__()
        bias = norm == "none"
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=bias)
        self.norm1 = _norm2d(norm, c_out, groups)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=bias)
        self.norm2 = _norm2d(norm, c_out, groups)
        self.stride = stride
        self.pad = c_out - c_in

    @override
    def forward(self, x: Tensor) -> Tensor:
        out = torch.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        shortcut = x[:, :, :: self.stride, :: self.stride] if self.stride > 1 else x
        if self.pad:
            shortcut = nn.functional.pad(shortcut, (0, 0, 0, 0, 0, self.pad))
        return torch.relu(out + shortcut)


def cifar_resnet(
    depth: int = 20,
    in_channels: int = 3,
    num_classes: int = 10,
    norm: Norm = "bn",
    groups: int = 4,
    init_scale: float = 1.0,
) -> nn.Sequential:
    """The CIFAR ResNet-``depth``: conv16, three stages of (depth−2)/6 basic blocks (16, 32, 64
    filters; strides 1, 2, 2), global average pooling and a dense layer. ResNet-110 has 54 blocks.

    Works for any image side ≥ 4 (32×32 CIFAR, 28×28 MNIST, 8×8 digits).

    Args:
        depth: 6n + 2 layers with weights (20 for quick runs, 110 as in the paper).
        in_channels: image channels.
        num_classes: outputs of the final dense layer.
        norm: ``"bn"``, ``"gn"`` (GroupNorm with ``groups`` groups) or ``"none"``.
        groups: GroupNorm's number of groups (Appendix B: 4).
        init_scale: factor on the He-normal weights (Appendix B: 0.1 for BNP+GN on CIFAR-10).
    """
    if depth < 8 or (depth - 2) % 6:
        raise ValueError(f"`depth` must be 6n + 2 with n >= 1 (8, 14, 20, …, 110), got {depth}")
    if norm not in ("none", "bn", "gn"):
        raise ValueError(f"`norm` must be 'none', 'bn' or 'gn' for the ResNet, got {norm!r}")
    if init_scale <= 0:
        raise ValueError(f"`init_scale` must be > 0, got {init_scale}")
    blocks_per_stage = (depth - 2) // 6
    layers: list[nn.Module] = [
        nn.Conv2d(in_channels, 16, 3, padding=1, bias=norm == "none"),
        _norm2d(norm, 16, groups),
        nn.ReLU(),
    ]
    width = 16
    for stage, c_out in enumerate((16, 32, 64)):
        for block in range(blocks_per_stage):
            stride = 2 if stage > 0 and block == 0 else 1
            layers.append(BasicBlock(width, c_out, stride, norm, groups))
            width = c_out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes)]
    return he_normal_init_(nn.Sequential(*layers), init_scale)  # type: ignore[return-value]
