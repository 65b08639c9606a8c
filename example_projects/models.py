"""The BNP paper's networks (paper 000, §5 and Appendix B), with optional normalization layers.

* :func:`fc_network` — the fully connected network of Ioffe & Szegedy used in §5: hidden layers of
  100 with ReLU, post-activation BN/LN as the paper places them.
* :func:`cnn5` — the 5-layer CNN of §5 (TensorFlow's CNN tutorial): three 3×3 'valid' convolutions
  with 32-64-32 filters, max-pooling after the first two, and two dense layers, with optional BN/GN
  after each convolution's activation.
* :func:`cifar_resnet` — the CIFAR ResNet of He et al. (2016a) used in §5 "Residual Networks"
  (depth 6n+2: 20, 32, 44, 56, 110, …) with BN, GN or no normalization, or its pre-activation version
  (He et al. 2016b; the paper's CIFAR-100 network).
* :func:`resnet18` — torchvision's ImageNet ResNet-18 (He et al. 2016a) with BN or GN.

Batch Renormalization and "BN with 4 things", the paper's further BN baselines, are in
:mod:`example_projects.norms`.

The FC network and the CNN use Glorot-uniform weights and zero biases, as in Appendix B; the ResNet
uses He-normal weights, optionally scaled (Appendix B: ×0.1 for BNP+GN on CIFAR-10).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn
from typing_extensions import override

from example_projects.norms import BatchRenorm, four_things_norm

Norm = Literal["none", "bn", "ln", "gn", "renorm", "bn4"]
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
    """``depth`` hidden layers of ``hidden`` units, ReLU, optional post-activation BN, Batch Renorm or LN."""
    if norm not in ("none", "bn", "ln", "renorm"):
        raise ValueError(f"`norm` must be 'none', 'bn', 'ln' or 'renorm' for the FC network, got {norm!r}")
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        if norm == "bn":
            layers.append(nn.BatchNorm1d(hidden))
        elif norm == "ln":
            layers.append(nn.LayerNorm(hidden))
        elif norm == "renorm":
            layers.append(BatchRenorm(hidden))
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
    *,
    ghost_batch_size: int = 0,
    bn4_gn_groups: int = 0,
    example_weight: float = 0.0,
) -> nn.Sequential:
    """conv32-pool-conv64-pool-conv32-dense64-dense, 3×3 convolutions, ReLU.

    ``norm`` after each convolution's ReLU: ``"bn"``, ``"gn"`` (``groups`` groups), ``"renorm"`` (Batch
    Renormalization) or ``"bn4"`` ("BN with 4 things": :func:`~example_projects.norms.four_things_norm` with
    ``ghost_batch_size``, ``bn4_gn_groups`` and ``example_weight``).

    ``padding="valid"`` (default) is the network the paper cites (§5, Appendix B: TensorFlow's CNN
    tutorial, whose ``Conv2D`` layers use TensorFlow's default 'valid' padding): on 3×32×32 CIFAR-10
    the feature maps are 30 → 15 → 13 → 6 → 4, so the first dense layer sees 4·4·32 = 512 inputs; on
    28×28 MNIST 3·3·32 = 288. It needs images of at least 18×18. ``padding="same"`` keeps every
    convolution's size (32 → 16 → 8: 2,048 inputs on CIFAR-10) and works down to 4×4 (the 8×8 digits).

    Raises:
        ValueError: ``norm`` or ``padding`` is unknown, or the image is too small for 'valid' padding.
    """
    if norm not in ("none", "bn", "gn", "renorm", "bn4"):
        raise ValueError(f"`norm` must be 'none', 'bn', 'gn', 'renorm' or 'bn4' for the CNN, got {norm!r}")
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
        elif norm == "renorm":
            mods.append(BatchRenorm(c_out))
        elif norm == "bn4":
            mods.append(
                four_things_norm(
                    c_out, ghost_batch_size=ghost_batch_size, gn_groups=bn4_gn_groups, example_weight=example_weight
                )
            )
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


class PreActBlock(BasicBlock):
    """norm-ReLU-conv3×3-norm-ReLU-conv3×3, plus the shortcut, no ReLU after the sum (He et al. 2016b).

    The shortcut is the same parameter-free "option A" as :class:`BasicBlock`'s (He et al. 2016b's CIFAR
    networks project with 1×1 convolutions where the width changes: a stated deviation that keeps both
    ResNets' parameters alike). ``norm1`` normalizes the block's input (``c_in`` channels).
    """

    def __init__(self, c_in: int, c_out: int, stride: int, norm: Norm, groups: int) -> None:
        super().__init__(c_in, c_out, stride, norm, groups)
        self.norm1 = _norm2d(norm, c_in, groups)

    @override
    def forward(self, x: Tensor) -> Tensor:
        out = self.conv1(torch.relu(self.norm1(x)))
        out = self.conv2(torch.relu(self.norm2(out)))
        shortcut = x[:, :, :: self.stride, :: self.stride] if self.stride > 1 else x
        if self.pad:
            shortcut = nn.functional.pad(shortcut, (0, 0, 0, 0, 0, self.pad))
        return out + shortcut


def cifar_resnet(
    depth: int = 20,
    in_channels: int = 3,
    num_classes: int = 10,
    norm: Norm = "bn",
    groups: int = 4,
    init_scale: float = 1.0,
    preact: bool = False,
) -> nn.Sequential:
    """The CIFAR ResNet-``depth``: conv16, three stages of (depth−2)/6 basic blocks (16, 32, 64
    filters; strides 1, 2, 2), global average pooling and a dense layer. ResNet-110 has 54 blocks.
    With ``preact`` the blocks are :class:`PreActBlock` (He et al. 2016b): the stem is the bare conv16 and
    a final norm-ReLU precedes the pooling.

    Works for any image side ≥ 4 (32×32 CIFAR, 28×28 MNIST, 8×8 digits).

    Args:
        depth: 6n + 2 layers with weights (20 for quick runs, 110 as in the paper).
        in_channels: image channels.
        num_classes: outputs of the final dense layer.
        norm: ``"bn"``, ``"gn"`` (GroupNorm with ``groups`` groups) or ``"none"``.
        groups: GroupNorm's number of groups (Appendix B: 4).
        init_scale: factor on the He-normal weights (Appendix B: 0.1 for BNP+GN on CIFAR-10).
        preact: the pre-activation ResNet (Appendix B: CIFAR-100).
    """
    if depth < 8 or (depth - 2) % 6:
        raise ValueError(f"`depth` must be 6n + 2 with n >= 1 (8, 14, 20, …, 110), got {depth}")
    if norm not in ("none", "bn", "gn"):
        raise ValueError(f"`norm` must be 'none', 'bn' or 'gn' for the ResNet, got {norm!r}")
    if init_scale <= 0:
        raise ValueError(f"`init_scale` must be > 0, got {init_scale}")
    blocks_per_stage = (depth - 2) // 6
    stem = nn.Conv2d(in_channels, 16, 3, padding=1, bias=norm == "none")
    layers: list[nn.Module] = [stem] if preact else [stem, _norm2d(norm, 16, groups), nn.ReLU()]
    block_type = PreActBlock if preact else BasicBlock
    width = 16
    for stage, c_out in enumerate((16, 32, 64)):
        for block in range(blocks_per_stage):
            stride = 2 if stage > 0 and block == 0 else 1
            layers.append(block_type(width, c_out, stride, norm, groups))
            width = c_out
    if preact:
        layers += [_norm2d(norm, width, groups), nn.ReLU()]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes)]
    return he_normal_init_(nn.Sequential(*layers), init_scale)  # type: ignore[return-value]


def resnet18(
    in_channels: int = 3, num_classes: int = 1000, norm: Literal["bn", "gn"] = "bn", groups: int = 32
) -> nn.Module:
    """torchvision's ResNet-18 (He et al. 2016a; 8 basic blocks, 64-128-256-512 filters) with BN or GroupNorm
    (``groups`` groups: Appendix B's "group size 32", Wu & He's default) and torchvision's initialization.

    ``in_channels`` other than 3 (the offline 1-channel digits) replaces the 7×7 stem convolution. Any
    image side ≥ 32 keeps a 1×1 map before the pooling; smaller ones (28×28) still run (the pooling is adaptive).
    """
    from torchvision.models import resnet18 as torchvision_resnet18

    if norm not in ("bn", "gn"):
        raise ValueError(f"`norm` must be 'bn' or 'gn' for ResNet-18, got {norm!r}")
    if norm == "gn" and 64 % groups:
        raise ValueError(f"`groups` must divide every stage width (64, 128, 256, 512), got {groups}")
    norm_layer = nn.BatchNorm2d if norm == "bn" else (lambda channels: nn.GroupNorm(groups, channels))
    net = torchvision_resnet18(weights=None, num_classes=num_classes, norm_layer=norm_layer)
    if in_channels != 3:
        net.conv1 = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
        nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")
    return net
