"""Issue 15's fault-injection test: training goes through a NaN sample, an Inf sample and a skipped
micro-batch — with and without gradient accumulation, in fp32 and bf16-mixed, with the Lightning
callback and with the plain-torch loop — and ends with finite statistics, and with parameters and
statistics equal to those of a run that never saw the bad batch's contribution:

* guard ``"skip"`` (``training_step`` returns ``None`` when the loss is not finite, after the forward
  pass): the same as skipping that micro-batch before its forward pass;
* guard ``"zero"`` (non-finite gradients set to 0 before the optimizer step): the bad batch poisons its
  whole accumulated step, so the run equals one that skipped every micro-batch of that step — in
  particular BNP stores no statistics from it (the rule: non-finite moments are never committed).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset
from typing_extensions import override

from lightning_bnp import BatchNormPreconditioning
from lightning_bnp.core import BNPPreconditioner
from tests.helpers import _fit

Guard = Literal["skip", "zero"]
BATCH, STEPS_OF_DATA, BAD, LR = 8, 6, 2, 0.2


def make_net() -> nn.Sequential:
    torch.manual_seed(0)  # LeakyReLU passes an Inf on, so every layer downstream sees it
    return nn.Sequential(nn.Linear(6, 8), nn.LeakyReLU(), nn.Linear(8, 3))


def make_batches(bad: float | None) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(STEPS_OF_DATA):
        x = torch.randn(BATCH, 6, generator=g) * torch.logspace(-1, 1, 6) + 1.0
        if i == BAD and bad is not None:
            x[5, 2] = bad
        out.append((x, torch.randint(0, 3, (BATCH,), generator=g)))
    return out


def skipped_batches(guard: Guard, accumulate: int) -> set[int]:
    """The micro-batches the reference run leaves out before their forward pass."""
    if guard == "skip":
        return {BAD}
    first = BAD - BAD % accumulate
    return set(range(first, first + accumulate))


def zero_non_finite_gradients(module: nn.Module) -> None:
    for p in module.parameters():
        if p.grad is not None:
            torch.nan_to_num_(p.grad, nan=0.0, posinf=0.0, neginf=0.0)


# ------------------------------------------------------------------------------- Lightning
class Batches(Dataset[tuple[Tensor, Tensor]]):
    def __init__(self, batches: list[tuple[Tensor, Tensor]]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.batches[i]


class GuardedClassifier(pl.LightningModule):
    def __init__(self, guard: Guard, skip_early: set[int]) -> None:
        super().__init__()
        self.network, self.guard, self.skip_early = make_net(), guard, skip_early

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Tensor | None:
        if batch_idx in self.skip_early:
            return None
        x, y = batch
        loss = F.cross_entropy(self.network(x), y)
        if self.guard == "skip" and not torch.isfinite(loss):
            return None
        return loss

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.guard == "zero":  # runs after the callbacks' hook: BNP has transformed by now
            zero_non_finite_gradients(self)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def run_lightning(
    tmp_path: Path, batches: list[tuple[Tensor, Tensor]], guard: Guard, skip: set[int], accumulate: int, precision: str
) -> tuple[nn.Module, BNPPreconditioner]:
    model, bnp = GuardedClassifier(guard, skip), BatchNormPreconditioning()
    _fit(tmp_path, model, Batches(batches), batch_size=None, callbacks=[bnp], max_epochs=1,  # type: ignore[arg-type]
         accumulate_grad_batches=accumulate, precision=precision)  # fmt: skip
    assert bnp.preconditioner is not None
    return model.network, bnp.preconditioner


# ------------------------------------------------------------------------------ plain loop
def run_plain(
    batches: list[tuple[Tensor, Tensor]], guard: Guard, skip: set[int], accumulate: int, precision: str
) -> tuple[nn.Module, BNPPreconditioner]:
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    pre = BNPPreconditioner(net)
    for i, (x, y) in enumerate(batches):
        if i not in skip:
            with autocast(precision):
                loss = F.cross_entropy(net(x), y)
            if guard == "zero" or torch.isfinite(loss):
                (loss / accumulate).backward()
        if (i + 1) % accumulate == 0:
            pre.step(opt)
            if guard == "zero":
                zero_non_finite_gradients(net)
            opt.step()
            opt.zero_grad()
    return net, pre


@contextlib.contextmanager
def autocast(precision: str) -> Iterator[None]:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        yield


# ----------------------------------------------------------------------------------- test
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("guard", ["skip", "zero"])
@pytest.mark.parametrize("loop", ["lightning", "plain"])
def test_training_through_a_bad_sample_equals_training_without_it(
    tmp_path: Path, loop: str, guard: Guard, bad: float, accumulate: int, precision: str
) -> None:
    def run(batches: list[tuple[Tensor, Tensor]], skip: set[int], name: str) -> tuple[nn.Module, BNPPreconditioner]:
        if loop == "lightning":
            return run_lightning(tmp_path / name, batches, guard, skip, accumulate, precision)
        return run_plain(batches, guard, skip, accumulate, precision)

    with pytest.warns(UserWarning) if guard == "zero" else contextlib.nullcontext():  # BNPWarning: not finite
        net, pre = run(make_batches(bad), set(), "bad")
    ref_net, ref_pre = run(make_batches(None), skipped_batches(guard, accumulate), "reference")
    assert all(layer.running.steps >= 2 for layer in ref_pre.layers.values())  # the reference trained
    for (name, p), q in zip(net.named_parameters(), ref_net.parameters()):
        assert torch.isfinite(p).all(), name
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    for name, layer in pre.layers.items():
        ref = ref_pre.layers[name].running
        assert layer.running.steps == ref.steps, name
        for mine, theirs in ((layer.running.mean_acc, ref.mean_acc), (layer.running.var_acc, ref.var_acc)):
            assert torch.isfinite(mine).all(), name
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0, msg=name)
