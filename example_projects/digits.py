"""scikit-learn's bundled handwritten digits (1,797 real 8×8 images) as an offline dataset.

Nothing is downloaded: the data ships inside scikit-learn. Pixels are scaled to [0, 1] and the
set is split once, with a fixed seed, into train / validation / test.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

SPLIT_SEED = 0
VAL_SIZE = 300
TEST_SIZE = 300


def load_digits_splits() -> dict[str, tuple[Tensor, Tensor]]:
    """``{"train"|"val"|"test": (images (n, 1, 8, 8) float32 in [0, 1], labels (n,) int64)}``."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(SPLIT_SEED))
    x, y = x[order], y[order]
    test, val = slice(0, TEST_SIZE), slice(TEST_SIZE, TEST_SIZE + VAL_SIZE)
    train = slice(TEST_SIZE + VAL_SIZE, None)
    return {"train": (x[train], y[train]), "val": (x[val], y[val]), "test": (x[test], y[test])}


class DigitsDataModule(pl.LightningDataModule):
    """Lightning wrapper over :func:`load_digits_splits`.

    Args:
        batch_size: training mini-batch size (1 for online learning).
        eval_batch_size: batch size of the validation and test loaders.
        shuffle: reshuffle the training set every epoch.
    """

    def __init__(self, *, batch_size: int = 60, eval_batch_size: int = 300, shuffle: bool = True) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"`batch_size` must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.shuffle = shuffle
        self.splits: dict[str, tuple[Tensor, Tensor]] = {}

    def setup(self, stage: str) -> None:
        if not self.splits:
            self.splits = load_digits_splits()

    def _loader(self, split: str, batch_size: int, shuffle: bool) -> DataLoader:
        return DataLoader(TensorDataset(*self.splits[split]), batch_size=batch_size, shuffle=shuffle)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", self.batch_size, self.shuffle)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", self.eval_batch_size, False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", self.eval_batch_size, False)
