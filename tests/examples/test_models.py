"""The example projects' networks and LightningModules: ResNet depth and init, the Appendix B learning-rate schedule
wired through Lightning, argument validation, and the unchanged ``make demo`` script."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from typing_extensions import override

from example_projects import fc_digits
from example_projects.classifier import Classifier
from example_projects.data import ImageDataModule
from example_projects.models import BasicBlock, PreActBlock, cifar_resnet, cnn5, resnet18
from example_projects.online import OnlineClassifier
from example_projects.resnet_gn import ResNetClassifier
from example_projects.resnet_imagenet import ResNet18Classifier
from example_projects.weight_conditioning import WCClassifier


@pytest.mark.parametrize(("depth", "blocks"), [(8, 3), (20, 9), (110, 54)])
def test_resnet_depth_counts_weight_layers(depth: int, blocks: int) -> None:
    net = cifar_resnet(depth, in_channels=1, norm="gn")
    assert sum(isinstance(m, (nn.Conv2d, nn.Linear)) for m in net.modules()) == depth
    assert sum(isinstance(m, BasicBlock) for m in net.modules()) == blocks
    assert net(torch.randn(2, 1, 8, 8)).shape == (2, 10)


@pytest.mark.parametrize(("side", "channels", "fan_in"), [(32, 3, 512), (28, 1, 288), (18, 1, 32)])
def test_cnn5_is_the_papers_valid_padding_network(side: int, channels: int, fan_in: int) -> None:
    """TensorFlow's CNN tutorial (paper §5): 'valid' 3×3 convolutions, pooling after the first two; on CIFAR-10
    the maps are 30 → 15 → 13 → 6 → 4, so the first dense layer sees 4·4·32 = 512 inputs."""
    net = cnn5(channels, side)
    convs = [m for m in net.modules() if isinstance(m, nn.Conv2d)]
    assert [(c.in_channels, c.out_channels, c.kernel_size, c.padding) for c in convs] == [
        (channels, 32, (3, 3), (0, 0)),
        (32, 64, (3, 3), (0, 0)),
        (64, 32, (3, 3), (0, 0)),
    ]
    dense = [m for m in net.modules() if isinstance(m, nn.Linear)]
    assert [(d.in_features, d.out_features) for d in dense] == [(fan_in, 64), (64, 10)]
    assert net(torch.randn(2, channels, side, side)).shape == (2, 10)


def test_cnn5_same_padding_option_and_size_check() -> None:
    assert cnn5(3, 32, padding="same")[-3].in_features == 2048  # 32 → 16 → 8: 8·8·32
    assert cnn5(1, 8, padding="same")(torch.randn(2, 1, 8, 8)).shape == (2, 10)
    with pytest.raises(ValueError, match="`image_size` 8 is too small for the 'valid'-padding CNN"):
        cnn5(1, 8)
    with pytest.raises(ValueError, match="`padding` must be 'valid' or 'same', got 'full'"):
        cnn5(padding="full")  # type: ignore[arg-type]


def test_resnet_norms_and_biases() -> None:
    gn = cifar_resnet(8, norm="gn", groups=4)
    assert {m.num_groups for m in gn.modules() if isinstance(m, nn.GroupNorm)} == {4}
    assert all(m.bias is None for m in gn.modules() if isinstance(m, nn.Conv2d))  # a norm follows every conv
    plain = cifar_resnet(8, norm="none")
    assert all(m.bias is not None for m in plain.modules() if isinstance(m, nn.Conv2d))
    assert any(isinstance(m, nn.BatchNorm2d) for m in cifar_resnet(8, norm="bn").modules())


def test_preact_resnet_is_he_2016b() -> None:
    """Pre-activation blocks norm-ReLU-conv ×2 plus the shortcut (no ReLU after the sum), a bare conv stem and a
    final norm-ReLU: ResNet-110 keeps 110 weight layers and 54 blocks."""
    net = cifar_resnet(110, in_channels=3, num_classes=100, norm="bn", preact=True)
    assert sum(isinstance(m, (nn.Conv2d, nn.Linear)) for m in net.modules()) == 110
    assert sum(isinstance(m, PreActBlock) for m in net.modules()) == 54
    assert isinstance(net[0], nn.Conv2d) and isinstance(net[1], PreActBlock)
    assert [type(m) for m in net[-5:-3]] == [nn.BatchNorm2d, nn.ReLU]
    assert net(torch.randn(2, 3, 32, 32)).shape == (2, 100)
    block = cifar_resnet(8, norm="none", preact=True)[2]  # 16 → 32 channels, stride 2
    torch.manual_seed(0)
    x = torch.randn(2, 16, 8, 8)
    shortcut = nn.functional.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, 0, 16))
    expected = block.conv2(torch.relu(block.conv1(torch.relu(x)))) + shortcut
    torch.testing.assert_close(block(x), expected)
    assert (block(x) < 0).any()  # no ReLU after the sum


def test_resnet18_is_torchvisions_with_bn_or_gn() -> None:
    gn = resnet18(1, 10, norm="gn", groups=32)
    assert {m.num_groups for m in gn.modules() if isinstance(m, nn.GroupNorm)} == {32}
    assert not any(isinstance(m, nn.BatchNorm2d) for m in gn.modules())
    assert sum(isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3) for m in gn.modules()) == 16  # 8 blocks
    assert gn(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    assert ResNet18Classifier(norm="bn", input_shape=(3, 32, 32), num_classes=5)(torch.randn(2, 3, 32, 32)).shape == (
        2,
        5,
    )
    with pytest.raises(ValueError, match="`norm` must be 'bn' or 'gn' for ResNet-18, got 'none'"):
        resnet18(norm="none")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`groups` must divide every stage width"):
        resnet18(norm="gn", groups=48)


def test_resnet_he_normal_init_is_scaled() -> None:
    torch.manual_seed(0)
    net = cifar_resnet(110, norm="gn", init_scale=0.1)
    conv = [m for m in net.modules() if isinstance(m, nn.Conv2d)][-1]  # 64 → 64 channels, 3×3
    expected = 0.1 * math.sqrt(2 / (64 * 9))
    assert conv.weight.std().item() == pytest.approx(expected, rel=0.05)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"depth": 21}, r"`depth` must be 6n \+ 2"),
        ({"depth": 2}, r"`depth` must be 6n \+ 2"),
        ({"norm": "ln"}, "`norm` must be 'none', 'bn' or 'gn' for the ResNet"),
        ({"norm": "gn", "groups": 3}, "`groups` must divide every stage width"),
        ({"init_scale": 0.0}, "`init_scale` must be > 0"),
    ],
)
def test_resnet_invalid_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cifar_resnet(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"warmup_start_lr": 0.5}, r"`warmup_start_lr` must be in \(0, lr=0.1\], got 0.5"),
        ({"warmup_steps": -1}, "`warmup_steps` must be >= 0, got -1"),
        ({"lr_decay": 0.0}, r"`lr_decay` must be in \(0, 1\], got 0.0"),
        ({"warmup": "cosine"}, "`warmup` must be 'constant' or 'linear', got 'cosine'"),
    ],
)
def test_resnet_module_invalid_arguments(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ResNetClassifier(depth=8, **kwargs)


class _RecordLR(pl.Callback):
    def __init__(self) -> None:
        self.lrs: list[float] = []

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


@pytest.mark.parametrize("warmup", ["linear", "constant"])
def test_resnet_warmup_then_step_decay_under_lightning(tmp_path: Path, warmup: str) -> None:
    """Warm-up per step — linear 0.01 → 0.1 (Appendix B, GN/BNP+GN) or constant 0.01 (He et al.'s BN) — then
    ÷10 at the epoch milestones, in a real fit."""
    model = ResNetClassifier(depth=8, input_shape=(1, 8, 8), warmup=warmup, warmup_steps=4, milestones=(2,))  # type: ignore[arg-type]
    record = _RecordLR()
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        max_epochs=3,
        limit_train_batches=3,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[record],
    )
    trainer.fit(model, datamodule=ImageDataModule(dataset="digits", batch_size=16))
    warm = [0.01 + 0.09 * step / 4 if warmup == "linear" else 0.01 for step in range(4)]
    expected = [*warm, 0.1, 0.1, 0.01, 0.01, 0.01]
    assert record.lrs == pytest.approx(expected)


def test_resnet_without_warmup_starts_at_lr() -> None:
    optimizers, schedulers = ResNetClassifier(depth=8, warmup_steps=0).configure_optimizers()  # type: ignore[misc]
    assert optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1)
    assert [s["interval"] for s in schedulers] == ["epoch"]


def test_classifier_optimizers() -> None:
    net = nn.Linear(4, 2)
    sgd = Classifier(net, lr=0.5, momentum=0.9, weight_decay=1e-4).configure_optimizers()
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["weight_decay"] == 1e-4
    adam = Classifier(net, lr=1e-3, optimizer="adam").configure_optimizers()
    assert isinstance(adam, torch.optim.Adam)
    with pytest.raises(ValueError, match="`optimizer` must be 'sgd' or 'adam', got 'rmsprop'"):
        Classifier(net, optimizer="rmsprop")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`lr` must be > 0, got 0"):
        Classifier(net, lr=0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"network": "fc", "norm": "gn"}, "`norm` 'gn' needs `network` 'cnn5'"),
        ({"network": "cnn5", "norm": "ln"}, "`norm` 'ln' needs `network` 'fc'"),
        ({"network": "rnn"}, "`network` must be 'fc' or 'cnn5', got 'rnn'"),
    ],
)
def test_online_invalid_combinations(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        OnlineClassifier(**kwargs)


def test_weight_conditioning_module_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="`network` must be 'cnn5' or 'mlp', got 'vit'"):
        WCClassifier(network="vit")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`norm` must be 'none' or 'bn', got 'gn'"):
        WCClassifier(norm="gn")  # type: ignore[arg-type]


def test_fc_digits_demo_still_runs(tmp_path: Path) -> None:
    """``make demo``'s script, one epoch."""
    accuracy = fc_digits.main(["--epochs", "1", "--log-dir", str(tmp_path)])
    assert 0.5 < accuracy <= 1.0
