"""Shared test helpers: a tiny BoringModel-style classifier, data, and a `_fit` helper."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_bnp.core import BNPPreconditioner
from lightning_bnp.core.statistics import Moments


def _test_accelerator() -> str:
    """``LIGHTNING_BNP_TEST_ACCELERATOR``: where the Lightning integration tests fit (``cpu``, the default and
    CI's, or ``cuda``, to test the CUDA path whenever a GPU is at hand)."""
    value = os.environ.get("LIGHTNING_BNP_TEST_ACCELERATOR", "cpu")
    if value not in ("cpu", "cuda"):
        raise ValueError(f"LIGHTNING_BNP_TEST_ACCELERATOR must be 'cpu' or 'cuda', got {value!r}")
    if value == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("LIGHTNING_BNP_TEST_ACCELERATOR=cuda, but torch.cuda.is_available() is False")
    return value


ACCELERATOR = _test_accelerator()

# "bit for bit" where a Lightning run on ACCELERATOR is compared with a reference loop on the CPU: on CUDA the
# same float32 arithmetic rounds differently (other reduction orders and kernels), so there it is 1e-5
EXACT: dict[str, float] = {"rtol": 0.0, "atol": 0.0} if ACCELERATOR == "cpu" else {"rtol": 1e-5, "atol": 1e-6}

# F.batch_norm's eps meaning "none": torch 2.11 refuses eps = 0 (2.14 takes it); 1e-300 added to a variance of
# order 1 changes nothing in float64 and is 0 once the kernel casts it to float32
TINY_EPS = 1e-300


def make_mlp(seed: int = 0, in_features: int = 6, hidden: int = 8, out: int = 3) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, out))


def make_cnn(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, stride=2, groups=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 2 * 2, 3),
    )


def seeded_batch(seed: int, n: int = 8) -> tuple[Tensor, Tensor]:
    """``n`` rows of 6 features with uneven scales and offsets, and 3-class targets, from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g) * torch.logspace(-1, 1, 6) + 0.5, torch.randint(0, 3, (n,), generator=g)


def bnp_train(model: nn.Module, pre: BNPPreconditioner, opt: torch.optim.Optimizer, seeds: range) -> None:
    """Cross-entropy steps with ``pre.step(opt)`` before each update, on ``seeded_batch(seed)`` for each seed."""
    for seed in seeds:
        x, y = seeded_batch(seed)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        pre.step(opt)
        opt.step()


def make_data(n: int = 64, shape: tuple[int, ...] = (6,), classes: int = 3, seed: int = 1) -> TensorDataset:
    """Inputs with uneven feature scales and offsets, so BNP's transform is far from the identity."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *shape, generator=g)
    scale = torch.logspace(-1, 1, shape[0]).view(-1, *([1] * (len(shape) - 1)))
    x = x * scale + 0.5
    y = torch.randint(0, classes, (n,), generator=g)
    return TensorDataset(x, y)


class BoringClassifier(pl.LightningModule):
    """Cross-entropy on a given network with plain SGD."""

    def __init__(self, network: nn.Module, lr: float = 0.1, momentum: float = 0.0) -> None:
        super().__init__()
        self.network = network
        self.lr = lr
        self.momentum = momentum

    @override
    def forward(self, x: Tensor) -> Tensor:
        return self.network(x)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y))

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


def quiet_trainer(root: Path, callbacks: list[pl.Callback] | None = None, **trainer_kwargs: Any) -> pl.Trainer:
    """A Trainer on one device of :data:`ACCELERATOR` without logger, progress bar, model summary or checkpoints;
    ``trainer_kwargs`` add to or override these."""
    defaults: dict[str, Any] = dict(
        default_root_dir=root,
        accelerator=ACCELERATOR,
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    return pl.Trainer(callbacks=callbacks or [], **{**defaults, **trainer_kwargs})


def _fit(
    tmp_path: Path,
    model: pl.LightningModule,
    data: TensorDataset,
    *,
    batch_size: int,
    callbacks: list[pl.Callback] | None = None,
    ckpt_path: str | None = None,
    **trainer_kwargs: Any,
) -> pl.Trainer:
    """Fit on :data:`ACCELERATOR` without logger, progress bar, summary or validation; extra kwargs go to the
    Trainer (:func:`quiet_trainer`)."""
    trainer = quiet_trainer(
        tmp_path, callbacks, **{"num_sanity_val_steps": 0, "limit_val_batches": 0, **trainer_kwargs}
    )
    trainer.fit(model, DataLoader(data, batch_size=batch_size, shuffle=False), ckpt_path=ckpt_path)
    return trainer


def spy_moments(pre: BNPPreconditioner) -> dict[str, Moments]:
    """The pooled moments each layer brings to the latest step of ``pre`` (filled at every step)."""
    seen: dict[str, Moments] = {}
    transform = pre._step.transform

    def recording(ready: list[Any], pending: Any, not_run_here: set[str]) -> None:
        seen.update({layer.name: m for layer, m, _ in ready})
        transform(ready, pending, not_run_here)

    pre._step.transform = recording  # type: ignore[method-assign]
    return seen


class Affine(nn.Module):
    """A linear-like layer no layer kind names: ``x @ matrix`` (BNP leaves it alone as an unknown layer type)."""

    def __init__(self, features: int = 4) -> None:
        super().__init__()
        self.matrix = nn.Parameter(torch.eye(features))

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.matrix


def record_compiles(monkeypatch: Any) -> tuple[list[dict[str, Any]], list[int]]:
    """Replace ``torch.compile`` with a recorder that returns the function as given (mutation testing's selection
    compiles nothing): the options of each call, and one entry per run of a returned function."""
    given: list[dict[str, Any]] = []
    runs: list[int] = []

    def recorder(fn: Any, **options: Any) -> Any:
        given.append(options)
        return lambda *args: (runs.append(1), fn(*args))[1]

    monkeypatch.setattr(torch, "compile", recorder)
    return given, runs
