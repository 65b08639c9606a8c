"""BNP under Lightning's manual optimization and under Lightning Fabric (issue 37, items 1 and 4): the running
statistics and the parameters equal those of the plain-torch loop on the same batches, with gradient accumulation
and with clipping, which sees the preconditioned gradient as in automatic optimization."""

from __future__ import annotations

import copy
import pickle
import warnings
from pathlib import Path
from typing import Any, ClassVar

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override

from lightning_bnp import BatchNormPreconditioning, BNPPreconditioner
from lightning_bnp.core.preconditioner import BNPWarning
from tests.helpers import EXACT, _fit, make_data, make_mlp

BATCH, STEPS, LR = 8, 4, 0.1
FLOAT64 = {"rtol": 1e-12, "atol": 1e-12}


def reference(
    *,
    steps: int = STEPS,
    accumulate: int = 1,
    clip_norm: float | None = None,
    dtype: torch.dtype = torch.float32,
    output_dtype: torch.dtype | None = None,
) -> tuple[nn.Module, BNPPreconditioner]:
    """The plain-torch loop: ``accumulate`` micro-batches of BATCH per step, BNP, clipping, SGD; the network's
    output cast to ``output_dtype`` before the loss (as Fabric's ``precision="64-true"`` returns it)."""
    network = make_mlp().to(dtype)
    pre = BNPPreconditioner(network)
    opt = torch.optim.SGD(network.parameters(), lr=LR)
    batches = iter(_loader(dtype))
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(accumulate):
            x, y = next(batches)
            out = network(x)
            nn.functional.cross_entropy(out if output_dtype is None else out.to(output_dtype), y).backward()
        pre.step(opt)
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(network.parameters(), clip_norm)
        opt.step()
    return network, pre


def _loader(dtype: torch.dtype = torch.float32) -> DataLoader:
    x, y = make_data().tensors
    return DataLoader(TensorDataset(x.to(dtype), y), batch_size=BATCH, shuffle=False)


def assert_same(network: nn.Module, pre: BNPPreconditioner, ref: nn.Module, ref_pre: BNPPreconditioner,
                prefix: str = "", **tol: float) -> None:  # fmt: skip
    for name, layer in ref_pre.layers.items():
        ours = pre.layers[prefix + name].running
        assert ours.steps == layer.running.steps, name
        torch.testing.assert_close(ours.mu.cpu(), layer.running.mu, msg=name, **tol)
        torch.testing.assert_close(ours.var.cpu(), layer.running.var, msg=name, **tol)
    for (name, p), q in zip(network.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), msg=name, **tol)


# ------------------------------------------------------------------ manual optimization
class Manual(pl.LightningModule):
    """Manual optimization as Lightning's docs write it: ``accumulate`` backwards per step, optional clipping."""

    def __init__(self, accumulate: int = 1, clip: float | None = None) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.network = make_mlp()
        self.accumulate, self.clip = accumulate, clip

    @override
    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        self.manual_backward(nn.functional.cross_entropy(self.network(x), y))
        if (batch_idx + 1) % self.accumulate == 0:
            if self.clip is not None:
                self.clip_gradients(opt, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def _fit_manual(tmp_path: Path, model: Manual, steps: int = STEPS, **kwargs: Any) -> BNPPreconditioner:
    bnp = BatchNormPreconditioning(verbose=False)
    x, y = make_data().tensors
    data = TensorDataset(x, y)
    _fit(tmp_path, model, data, batch_size=BATCH, callbacks=[bnp], max_steps=steps, **kwargs)
    assert bnp.preconditioner is not None
    return bnp.preconditioner


@pytest.mark.parametrize("accumulate", [1, 2])
def test_manual_optimization_equals_the_plain_loop(tmp_path: Path, accumulate: int) -> None:
    model = Manual(accumulate)
    pre = _fit_manual(tmp_path, model, steps=STEPS)
    ref, ref_pre = reference(accumulate=accumulate)
    assert_same(model.network, pre, ref, ref_pre, "network.", **EXACT)


def test_manual_clipping_sees_the_preconditioned_gradient(tmp_path: Path) -> None:
    model = Manual(clip=0.05)
    pre = _fit_manual(tmp_path, model)
    ref, ref_pre = reference(clip_norm=0.05)
    assert_same(model.network, pre, ref, ref_pre, "network.", rtol=1e-6, atol=1e-7)
    assert "clip_gradients" not in model.__dict__  # Lightning's own method again after the fit


class TwoUpdatesPerBatch(Manual):
    """One optimizer clipped and stepped twice in one ``training_step``, once per half of the batch (as a critic
    trained for several updates on one batch)."""

    @override
    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        for x, y in zip(*(part.chunk(2) for part in batch)):
            self.manual_backward(nn.functional.cross_entropy(self.network(x), y))
            self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()


def test_an_optimizer_clipped_and_stepped_twice_in_one_batch_is_preconditioned_at_both_steps(tmp_path: Path) -> None:
    """The second clipping of the batch is a new step's (its optimizer stepped since): BNP's step runs again, as in
    the plain loop over the half batches."""
    model = TwoUpdatesPerBatch()
    pre = _fit_manual(tmp_path, model, steps=2 * STEPS)  # (Lightning counts both steps of a batch)
    network = make_mlp()
    ref_pre = BNPPreconditioner(network)
    opt = torch.optim.SGD(network.parameters(), lr=LR)
    for x, y in list(_loader())[:STEPS]:
        for half_x, half_y in zip(x.chunk(2), y.chunk(2)):
            opt.zero_grad()
            nn.functional.cross_entropy(network(half_x), half_y).backward()
            ref_pre.step(opt)
            torch.nn.utils.clip_grad_norm_(network.parameters(), 0.05)
            opt.step()
    assert ref_pre.layers["0"].running.steps == 2 * STEPS
    assert_same(model.network, pre, network, ref_pre, "network.", rtol=1e-6, atol=1e-7)


class WarmsUpAtTrainStart(Manual):
    """Manual optimization with one step of its own before the first batch (``on_train_start``)."""

    @override
    def on_train_start(self) -> None:
        opt = self.optimizers()
        x, y = next(iter(_loader()))
        self.manual_backward(nn.functional.cross_entropy(self.network(x), y))
        opt.step()
        opt.zero_grad()


def test_a_manual_step_before_the_first_batch_is_preconditioned(tmp_path: Path) -> None:
    """An optimizer step outside any batch (no batch has started: nothing was clipped yet) is BNP's step as any
    other: the fit equals the plain loop with that step first."""
    model = WarmsUpAtTrainStart()
    pre = _fit_manual(tmp_path, model, steps=STEPS)  # (Lightning does not count the warm-up step)
    network = make_mlp()
    ref_pre = BNPPreconditioner(network)
    opt = torch.optim.SGD(network.parameters(), lr=LR)
    batches = list(_loader())
    for x, y in [batches[0], *batches[:STEPS]]:
        opt.zero_grad()
        nn.functional.cross_entropy(network(x), y).backward()
        ref_pre.step(opt)
        opt.step()
    assert_same(model.network, pre, network, ref_pre, "network.", **EXACT)


def test_manual_optimization_in_float64(tmp_path: Path) -> None:
    model = Manual(clip=0.05)
    pre = _fit_manual(tmp_path, model, precision="64-true")
    ref, ref_pre = reference(clip_norm=0.05, dtype=torch.float64)
    assert_same(model.network, pre, ref, ref_pre, "network.", **FLOAT64)


class ManualByHand(Manual):
    """Copies of the module while BNP's clipping is installed: they get Lightning's own ``clip_gradients``."""

    copies: ClassVar[list[nn.Module]] = []

    @override
    def training_step(self, batch: Any, batch_idx: int) -> None:
        self.copies.append(copy.deepcopy(self))
        self.copies.append(pickle.loads(pickle.dumps(self)))
        super().training_step(batch, batch_idx)


def test_a_copy_of_the_module_during_fit_clips_as_lightning(tmp_path: Path) -> None:
    model = ManualByHand(clip=0.05)
    _fit_manual(tmp_path, model, steps=1)
    assert model.copies and all("clip_gradients" not in vars(c) or vars(c)["clip_gradients"].__self__ is c
                               for c in model.copies)  # fmt: skip


# ------------------------------------------------------------------ Lightning Fabric
def _fabric_loop(
    fabric: Fabric, *, accumulate: int = 1, clip_norm: float | None = None, dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, BNPPreconditioner]:
    """The loop of docs/lightning_loops.md, "Lightning Fabric"."""
    network = make_mlp()
    pre = BNPPreconditioner(network)  # on the module itself, before fabric.setup
    model, opt = fabric.setup(network, torch.optim.SGD(network.parameters(), lr=LR))
    loader = fabric.setup_dataloaders(_loader(dtype))
    for i, (x, y) in enumerate(loader):
        if i == STEPS * accumulate:
            break
        stepping = (i + 1) % accumulate == 0
        with fabric.no_backward_sync(model, enabled=not stepping):
            fabric.backward(nn.functional.cross_entropy(model(x), y))
        if stepping:
            pre.step(opt)  # after the backward (and the all-reduce), before clipping and the step
            if clip_norm is not None:
                fabric.clip_gradients(model, opt, max_norm=clip_norm)
            opt.step()
            opt.zero_grad()
    return network, pre


@pytest.mark.parametrize(("accumulate", "clip_norm"), [(1, None), (2, None), (1, 0.05)])
def test_fabric_equals_the_plain_loop(accumulate: int, clip_norm: float | None) -> None:
    network, pre = _fabric_loop(Fabric(accelerator="cpu", devices=1), accumulate=accumulate, clip_norm=clip_norm)
    ref, ref_pre = reference(accumulate=accumulate, clip_norm=clip_norm)
    tol = {"rtol": 0.0, "atol": 0.0} if clip_norm is None else {"rtol": 1e-6, "atol": 1e-7}
    assert_same(network, pre, ref, ref_pre, **tol)


def test_fabric_in_float64() -> None:
    fabric = Fabric(accelerator="cpu", devices=1, precision="64-true")
    network, pre = _fabric_loop(fabric, clip_norm=0.05, dtype=torch.float64)
    # Fabric's "64-true" hands the model's output back in the default dtype (float32): the loss is float32 there
    ref, ref_pre = reference(clip_norm=0.05, dtype=torch.float64, output_dtype=torch.get_default_dtype())
    assert_same(network, pre, ref, ref_pre, **FLOAT64)


class CopiesTheCallbackAfterClipping(Manual):
    """The callback copied between ``clip_gradients`` and ``opt.step()``, while it remembers the optimizer."""

    copies: ClassVar[list[Any]] = []

    @override
    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        self.manual_backward(nn.functional.cross_entropy(self.network(x), y))
        self.clip_gradients(opt, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        bnp = next(c for c in self.trainer.callbacks if isinstance(c, BatchNormPreconditioning))  # type: ignore[attr-defined]
        self.copies.extend([copy.deepcopy(bnp), pickle.loads(pickle.dumps(bnp))])
        opt.step()
        opt.zero_grad()


def test_a_copy_of_the_callback_during_fit_installs_nothing(tmp_path: Path) -> None:
    _fit_manual(tmp_path, CopiesTheCallbackAfterClipping(), steps=1)
    copies = CopiesTheCallbackAfterClipping.copies
    assert copies and all(c._clipping.module is None and c._clipping.early == [] for c in copies)


# --------------------------------------- the callback's preconditioner stepped by the training_step itself
class StepsTheCallbacksPreconditioner(Manual):
    """``bnp.preconditioner.step(opt)`` in ``training_step`` before ``opt.step()`` (whose ``on_before_optimizer_step``
    runs the callback's step too): before the clipping, or after it (the clipping runs the callback's step first)."""

    def __init__(self, clip: float | None = None, user_first: bool = True) -> None:
        super().__init__(clip=clip)
        self.user_first = user_first

    @override
    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        self.manual_backward(nn.functional.cross_entropy(self.network(x), y))
        bnp = next(c for c in self.trainer.callbacks if isinstance(c, BatchNormPreconditioning))  # type: ignore[attr-defined]
        assert bnp.preconditioner is not None
        if self.user_first:
            bnp.preconditioner.step(opt)
        if self.clip is not None:
            self.clip_gradients(opt, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
        if not self.user_first:
            bnp.preconditioner.step(opt)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize(("clip", "user_first"), [(None, True), (0.05, True), (0.05, False)])
def test_the_callbacks_preconditioner_stepped_in_training_step_transforms_once(
    tmp_path: Path, clip: float | None, user_first: bool
) -> None:
    """It warned "already preconditioned", stored no statistic (steps stayed 0), and the parameters drifted from one
    transform per step; now either call may come first, silently, and the run equals the plain loop."""
    model = StepsTheCallbacksPreconditioner(clip=clip, user_first=user_first)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BNPWarning)
        pre = _fit_manual(tmp_path, model)
    ref, ref_pre = reference(clip_norm=clip)
    tol = EXACT if clip is None else {"rtol": 1e-6, "atol": 1e-7}
    assert pre.layers["network.0"].running.steps == STEPS
    assert_same(model.network, pre, ref, ref_pre, "network.", **tol)


def test_a_plain_loop_may_step_one_optimizer_twice_before_its_step() -> None:
    """``pre.step(opt)`` twice before ``opt.step()``: the second finds the gradients transformed and used to replace
    the first's pending statistics by nothing."""
    network = make_mlp()
    pre = BNPPreconditioner(network)
    opt = torch.optim.SGD(network.parameters(), lr=LR)
    for x, y in list(_loader())[:STEPS]:
        opt.zero_grad()
        nn.functional.cross_entropy(network(x), y).backward()
        pre.step(opt)
        with warnings.catch_warnings():
            warnings.simplefilter("error", BNPWarning)
            pre.step(opt)
        opt.step()
    ref, ref_pre = reference()
    assert_same(network, pre, ref, ref_pre, **EXACT)


# ------------------------------------------- two optimizers, each clipped twice, with the callback's regularizer
class RegularizerRecorder:
    """Stands in for the callback's regularizer (the slot ``ZSpaceRegularization`` fills at setup): records each
    call and what it is given."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def before_precondition(self, optimizer: torch.optim.Optimizer) -> None:
        self.calls.append(("before", optimizer))

    def after_precondition(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer, pre: Any
    ) -> None:
        self.calls.append(("after", trainer, pl_module, optimizer))


VALUE_CLIP, NORM_CLIP = 0.02, 0.05


class TwoOptimizers(Manual):
    """An optimizer for the first layer and one for the last, each clipped twice (by value, then by norm given
    positionally): both before either steps (``interleaved``), or each clipped and stepped in turn."""

    def __init__(self, interleaved: bool) -> None:
        super().__init__()
        self.interleaved = interleaved

    def _clip(self, opt: Any) -> None:
        self.clip_gradients(opt, gradient_clip_val=VALUE_CLIP, gradient_clip_algorithm="value")
        self.clip_gradients(opt, NORM_CLIP, "norm")

    @override
    def training_step(self, batch: Any, batch_idx: int) -> None:
        first, last = self.optimizers()  # type: ignore[misc]
        x, y = batch
        self.manual_backward(nn.functional.cross_entropy(self.network(x), y))
        if self.interleaved:
            self._clip(first)
            self._clip(last)
            first.step()
            last.step()
        else:
            for opt in (first, last):
                self._clip(opt)
                opt.step()
        first.zero_grad()
        last.zero_grad()

    @override
    def configure_optimizers(self) -> list[torch.optim.Optimizer]:  # type: ignore[override]
        return [torch.optim.SGD(self.network[i].parameters(), lr=LR) for i in (0, 2)]


def two_optimizers_reference() -> tuple[nn.Module, BNPPreconditioner]:
    """The plain-torch loop of :class:`TwoOptimizers`: BNP, then each layer's gradients clipped by value and by
    norm on their own, SGD."""
    network = make_mlp()
    pre = BNPPreconditioner(network)
    opt = torch.optim.SGD(network.parameters(), lr=LR)
    for x, y in list(_loader())[:STEPS]:
        opt.zero_grad()
        nn.functional.cross_entropy(network(x), y).backward()
        pre.step()
        for i in (0, 2):
            torch.nn.utils.clip_grad_value_(network[i].parameters(), VALUE_CLIP)
            torch.nn.utils.clip_grad_norm_(network[i].parameters(), NORM_CLIP)
        opt.step()
    return network, pre


@pytest.mark.parametrize("interleaved", [False, True], ids=["each in turn", "interleaved"])
def test_manual_clipping_of_two_optimizers_runs_each_ones_step_and_regularizer_once(
    tmp_path: Path, interleaved: bool
) -> None:
    """Each optimizer's BNP step runs at its first clipping, and the regularizer's terms (its ``after_precondition``,
    given the fit's trainer and module) are added once per step of each optimizer: not again at its second clipping,
    nor at its ``opt.step()``, also when the other optimizer was clipped in between; every clipping sees the
    preconditioned gradient (its arguments passed on, positional ones too), as the plain loop's."""
    model = TwoOptimizers(interleaved)
    bnp = BatchNormPreconditioning(verbose=False)
    recorder = RegularizerRecorder()
    bnp.regularizer = recorder
    x, y = make_data().tensors
    # (Lightning counts every optimizer's step: 2 * STEPS for STEPS batches)
    trainer = _fit(tmp_path, model, TensorDataset(x, y), batch_size=BATCH, callbacks=[bnp], max_steps=2 * STEPS)
    first, last = trainer.optimizers
    expected = [("before", first), ("after", trainer, model, first), ("before", last), ("after", trainer, model, last)]
    assert recorder.calls == expected * STEPS
    assert bnp.preconditioner is not None
    ref, ref_pre = two_optimizers_reference()
    assert_same(model.network, bnp.preconditioner, ref, ref_pre, "network.", rtol=1e-6, atol=1e-7)
