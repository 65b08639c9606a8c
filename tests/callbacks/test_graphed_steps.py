"""``GraphedSteps``: a plain ``Trainer.fit`` (automatic optimization) whose optimizer steps are replayed from one
captured graph ends where the eager fit ends — weights, BNP's running statistics, ``global_step``, every logged value
and every ``on_train_batch_end`` loss, step for step — with validation, gradient clipping and a resume from a
checkpoint in between; and what a replay cannot follow is refused by name.

On the CPU the suite's stand-in for CUDA graphs runs the captured steps (``tests/recorded_graphs.py``: the step's
tensor operations recorded at capture, nothing written or read back to the host there, replayed on the same
tensors and no Python); ``test_cuda_graph_fit.py`` runs the same fit on a GPU."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_bnp import BatchNormPreconditioning, GraphedSteps, WeightConditioning, ZSpaceRegularization
from tests.helpers import make_data, quiet_trainer
from tests.recorded_graphs import RecordedGraph, RecordedGraphs


@pytest.fixture(autouse=True)
def _recorded_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(GraphedSteps, "runtime", RecordedGraphs())


class Classifier(pl.LightningModule):
    """An MLP whose own ``on_train_batch_start`` augments the batch (it replaces the batch's input tensor: hooks
    after the callback's may change the batch that the step reads)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.network = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        batch[0] = batch[0] * 0.5 + 0.25

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.network(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        self.log("weight_norm", self.network[0].weight.norm())
        return loss

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.network(x), y))

    @override
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class Record(pl.Callback):
    """Per step: the loss the loop hands ``on_train_batch_end`` (kept as the tensor it is), the logged values and
    whether every parameter shows its gradient; at the end, BNP's state."""

    def __init__(self) -> None:
        self.loss_tensors: list[Tensor] = []
        self.logged: list[dict[str, float]] = []
        self.grads_shown: list[bool] = []
        self.statistics: dict[str, tuple[Tensor, Tensor, int]] = {}

    @property
    def losses(self) -> list[float]:
        return [float(loss) for loss in self.loss_tensors]

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.loss_tensors.append(outputs["loss"])  # (read at the end: a later step must not rewrite it)
        self.logged.append({k: float(v) for k, v in trainer.callback_metrics.items()})
        self.grads_shown.append(all(p.grad is not None for p in pl_module.parameters()))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        bnp = next(c for c in trainer.callbacks if isinstance(c, BatchNormPreconditioning))  # type: ignore[attr-defined]
        assert bnp.preconditioner is not None
        for name, layer in bnp.preconditioner.layers.items():
            r = layer.running
            self.statistics[name] = (r.mean_acc.clone(), r.var_acc.clone(), r.steps)


def _trainer(root: Path, callbacks: list[pl.Callback], *, max_steps: int, **trainer: Any) -> pl.Trainer:
    """A quiet Trainer on the CPU (the stand-in runtime's device)."""
    return quiet_trainer(root, callbacks, accelerator="cpu", max_steps=max_steps, **trainer)


def _fit(
    root: Path, graphed: GraphedSteps | None, max_steps: int = 24, ckpt_path: str | None = None, **trainer: Any
) -> tuple[Classifier, Record, pl.Trainer]:
    model, record = Classifier(), Record()
    callbacks: list[pl.Callback] = [BatchNormPreconditioning(verbose=False), record]
    if graphed is not None:
        callbacks.append(graphed)
    fit = _trainer(root, callbacks, max_steps=max_steps, gradient_clip_val=0.5, **trainer)
    data = DataLoader(make_data(n=96), batch_size=16, shuffle=True, drop_last=True)
    torch.manual_seed(1)
    fit.fit(model, data, DataLoader(make_data(n=32, seed=2), batch_size=16), ckpt_path=ckpt_path)
    return model, record, fit


def _assert_same_fit(got: tuple[Classifier, Record, pl.Trainer], want: tuple[Classifier, Record, pl.Trainer]) -> None:
    (model, record, trainer), (eager, eager_record, eager_trainer) = got, want
    assert trainer.global_step == eager_trainer.global_step
    for (name, p), q in zip(eager.named_parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
    assert list(record.statistics) == list(eager_record.statistics) == ["network.0", "network.2", "network.4"]
    for name, (mean_acc, var_acc, steps) in eager_record.statistics.items():
        torch.testing.assert_close(record.statistics[name][0], mean_acc, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(record.statistics[name][1], var_acc, rtol=1e-5, atol=1e-6, msg=name)
        assert record.statistics[name][2] == steps
    assert record.losses == pytest.approx(eager_record.losses, rel=1e-5)
    assert record.grads_shown == eager_record.grads_shown  # (Lightning drops them before each validation)
    assert [sorted(d) for d in record.logged] == [sorted(d) for d in eager_record.logged]
    for step, (d, e) in enumerate(zip(record.logged, eager_record.logged)):
        assert d == pytest.approx(e, rel=1e-5), f"step {step}"


def test_a_graphed_fit_ends_where_the_eager_fit_ends_step_for_step(tmp_path: Path) -> None:
    eager = _fit(tmp_path / "eager", None, val_check_interval=5)
    graphed_steps = GraphedSteps(warmup_steps=3)
    graphed = _fit(tmp_path / "graphed", graphed_steps, val_check_interval=5)
    _assert_same_fit(graphed, eager)
    assert graphed[2].global_step == 24 and len(graphed[1].losses) == 24
    (graph,) = GraphedSteps.runtime.graphs  # type: ignore[attr-defined]
    assert isinstance(graph, RecordedGraph) and graph.replays == 24 - 3  # (the capture step is a replay too)
    assert "optimizer_step" not in vars(graphed[0])  # the module's own hook again after the fit
    assert not graphed_steps.captured  # (the graph and its tensors are dropped at teardown)


def _resumed(root: Path, graphed: bool) -> tuple[Classifier, Record, pl.Trainer]:
    """12 steps, a checkpoint, and 8 more steps from it (in a new Trainer, with a new model)."""
    first = _fit(root / "first", GraphedSteps(warmup_steps=2) if graphed else None, max_steps=12)
    path = root / "half.ckpt"
    first[2].save_checkpoint(path)
    return _fit(root / "resumed", GraphedSteps(warmup_steps=2) if graphed else None, max_steps=20, ckpt_path=str(path))


def test_a_graphed_fit_resumed_from_a_checkpoint_ends_where_the_eager_fit_resumed_ends(tmp_path: Path) -> None:
    graphed = _resumed(tmp_path / "graphed", graphed=True)
    assert graphed[2].global_step == 20 and len(graphed[1].losses) == 8
    _assert_same_fit(graphed, _resumed(tmp_path / "eager", graphed=False))
    assert all(steps == 20 for _, _, steps in graphed[1].statistics.values())  # (BNP's step count carried over)


class TensorLrSGD(torch.optim.Optimizer):
    """Plain SGD that reads its lr as a tensor in its step (as Adam's capturable=True step does on CUDA)."""

    def __init__(self, params: Any, lr: Tensor | float, momentum: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "momentum": momentum})  # (momentum: read by schedulers only)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None if closure is None else closure()  # (Lightning's closure: forward and backward)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(group["lr"] * p.grad)
        return loss


class Options(Classifier):
    """The classifier with another optimizer, a scheduler, manual optimization or a logged Metric or float."""

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.options = options
        self.automatic_optimization = not options.get("manual", False)
        if options.get("metric"):
            from torchmetrics import MeanSquaredError  # (its update reads nothing back: MulticlassAccuracy's does)

            self.error = MeanSquaredError()

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.options.get("metric"):
            self.error(self.network(batch[0])[:, 0], batch[1].float())
            self.log("error", self.error)
        if self.options.get("python_value"):
            self.log("batch_idx", float(batch_idx))
        return loss

    @override
    def configure_optimizers(self) -> Any:
        opt = self.options.get("optimizer", lambda p: torch.optim.SGD(p, lr=0.05))(self.parameters())
        if "scheduler" in self.options:
            make = self.options["scheduler"]
            scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2) if make is True else make(opt)
            return {"optimizer": opt, "lr_scheduler": scheduler}
        return opt


def _fit_options(
    tmp_path: Path, model: Options, max_steps: int = 6, callbacks: list[pl.Callback] | None = None, **trainer: Any
) -> pl.Trainer:
    """A fit with ``GraphedSteps(warmup_steps=1)`` (or the given callbacks)."""
    fit = _trainer(
        tmp_path, [GraphedSteps(warmup_steps=1)] if callbacks is None else callbacks, max_steps=max_steps, **trainer
    )
    fit.fit(model, DataLoader(make_data(n=96), batch_size=16, drop_last=True))
    return fit


@pytest.mark.parametrize(
    ("options", "trainer", "message"),
    [
        (
            {"manual": True},
            {},
            "GraphedSteps wraps the optimizer steps of automatic optimization, and this LightningModule sets "
            "automatic_optimization=False: call lightning_bnp.core.GraphedTrainingStep from its training_step instead "
            "(docs 'CUDA graphs')",
        ),
        (
            {},
            {"precision": "bf16-mixed"},
            "GraphedSteps cannot replay steps with precision='bf16-mixed' (MixedPrecision): a GradScaler reads whether "
            "the gradients are finite back to the host at every step, and autocast's cast cache is not graph-safe. "
            "Use '32-true' or 'bf16-true'",
        ),
        (
            {},
            {"accumulate_grad_batches": 2},
            "GraphedSteps replays whole optimizer steps, and accumulate_grad_batches=2 runs the other micro-batches' "
            "backward outside them (they re-create the gradient tensors the graph writes): use "
            "accumulate_grad_batches=1",
        ),
        (
            {"optimizer": lambda p: torch.optim.Adam(p, capturable=False)},
            {},
            "`optimizer` (Adam) has capturable=False in param group 0: a CUDA graph replays its step only with "
            "capturable=True (e.g. torch.optim.Adam(..., capturable=True))",
        ),
        (
            {"scheduler": True},
            {},
            "GraphedSteps: the learning-rate scheduler StepLR changes the lr of param group 0 of SGD, which reads it "
            "as a Python float (lr=0.05) that a replay keeps at its captured value: give the optimizer a tensor lr "
            "(torch.optim.Adam(..., lr=torch.tensor(1e-3), capturable=True))",
        ),
        (
            {
                "optimizer": lambda p: TensorLrSGD(p, lr=torch.tensor(0.05), momentum=0.9),
                "scheduler": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=40),
            },
            {},
            "GraphedSteps: the learning-rate scheduler OneCycleLR cycles the momentum (cycle_momentum=True), a Python "
            "float of the optimizer that a replay keeps at its captured value: pass cycle_momentum=False",
        ),
    ],
    ids=[
        "manual",
        "mixed precision",
        "accumulation",
        "not capturable",
        "scheduler of a float lr",
        "scheduler of the momentum",
    ],
)
def test_what_a_replay_cannot_follow_is_refused_at_fit_start(
    tmp_path: Path, options: dict[str, Any], trainer: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError) as raised:
        _fit_options(tmp_path, Options(**options), **trainer)
    assert str(raised.value) == message


def test_without_a_device_of_its_runtime_it_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(GraphedSteps.runtime, "available", lambda: False)
    with pytest.raises(RuntimeError) as raised:
        _fit_options(tmp_path, Options())
    assert str(raised.value) == (
        "GraphedSteps needs a recorded CPU graphs device to capture steps on, and this machine has none: remove the "
        "callback to train eagerly"
    )
    monkeypatch.setattr(GraphedSteps.runtime, "available", lambda: True)
    monkeypatch.setattr(GraphedSteps.runtime, "device_type", "cuda")
    with pytest.raises(RuntimeError) as raised:
        _fit_options(tmp_path, Options())
    assert str(raised.value) == (
        "GraphedSteps captures the steps of one cuda device; this fit runs on SingleDeviceStrategy (cpu): use "
        "Trainer(accelerator='cuda', devices=1) (a multi-device strategy's collectives are not captured by this "
        "callback)"
    )


def test_a_scheduler_of_a_tensor_lr_changes_the_lr_of_every_replay(tmp_path: Path) -> None:
    """StepLR halves the lr every 2 epochs: it fills the tensor the captured step reads."""
    weights = []
    for graphed in (False, True):
        model = Options(scheduler=True, optimizer=lambda p: TensorLrSGD(p, lr=torch.tensor(0.5)))
        fit = _fit_options(tmp_path / str(graphed), model, max_steps=30, callbacks=[] if not graphed else None)
        assert fit.global_step == 30
        assert float(fit.optimizers[0].param_groups[0]["lr"]) == pytest.approx(0.5 * 0.1**2)  # (epochs 0-1, 2-3, 4)
        weights.append([p.detach().clone() for p in model.parameters()])
    for eager, replayed in zip(*weights):
        torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-6)


def test_a_batch_of_another_shape_is_refused_by_name(tmp_path: Path) -> None:
    fit = _trainer(tmp_path, [GraphedSteps(warmup_steps=1)], max_steps=8)
    with pytest.raises(ValueError, match=r"`batch` 2: its tensor 0 is \(10, 6\) torch.float32, the captured step's"):
        fit.fit(Options(), DataLoader(make_data(n=42), batch_size=16))  # (16, 16, 10)
    assert "optimizer_step" not in vars(fit.lightning_module)  # (unwrapped by on_exception)


def test_a_metric_logged_in_the_captured_step_is_refused_and_a_python_value_is_warned_about(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as raised:
        _fit_options(tmp_path, Options(metric=True))
    assert str(raised.value) == (
        "GraphedSteps: self.log('error', <Metric>) in the captured step: a torchmetrics Metric updates and resets "
        "its state in Python, which a replay does not run; log the metric from on_train_batch_end with the step's "
        "outputs, or a tensor computed in the step"
    )
    message = (
        "GraphedSteps: self.log('batch_idx', 1.0) logs a Python value in the captured step; every replay logs that "
        "same value again (log a tensor to see each step's)"
    )
    with pytest.warns(UserWarning, match="^" + re.escape(message) + "$"):
        fit = _fit_options(tmp_path, Options(python_value=True))
    assert fit.callback_metrics["batch_idx"] == 1.0  # (the captured value, logged again by each replay)


@pytest.mark.parametrize("warmup", [0, -2, 1.5, True, "3"])
def test_warmup_steps_must_be_an_int_of_at_least_one(warmup: object) -> None:
    error = ValueError if isinstance(warmup, int) and not isinstance(warmup, bool) else TypeError
    with pytest.raises(error, match=r"`warmup_steps` must be an integer >= 1, got " + repr(warmup).replace(".", r"\.")):
        GraphedSteps(warmup_steps=warmup)  # type: ignore[arg-type]


class MaskedTokens(pl.LightningModule):
    """Per-token Linears on a dict batch whose integer ``attention_mask`` marks the real tokens (Hugging Face's)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.hidden, self.out = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 3)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        h = self.hidden(torch.relu(self.inp(batch["x"]))).relu()
        w = batch["attention_mask"].unsqueeze(-1).to(h.dtype)
        logits = self.out((h * w).sum(1) / w.sum(1).clamp_min(1.0))
        return nn.functional.cross_entropy(logits, batch["y"])

    @override
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _token_batches(n: int = 12) -> list[dict[str, Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        {
            "x": torch.randn(8, 5, 6, generator=g) * torch.logspace(-1, 1, 6) + 0.5,
            "attention_mask": (torch.arange(5).expand(8, 5) < torch.randint(1, 6, (8, 1), generator=g)).long(),
            "y": torch.randint(0, 3, (8,), generator=g),
        }
        for _ in range(n)
    ]


def test_a_graphed_fit_with_an_integer_token_mask_counts_each_batchs_real_tokens(tmp_path: Path) -> None:
    """The mask the captured forward reads is the one each replay's batch brings (an integer mask is made boolean
    inside the step, where the graph has it, not in the batch hook before it)."""
    fits = []
    for graphed in (False, True):
        model = MaskedTokens()
        bnp = BatchNormPreconditioning(verbose=False, token_mask="attention_mask", token_mask_layers=["inp", "hidden"])
        record = Record()
        graphed_steps = [GraphedSteps()] if graphed else []  # (the default: 3 warm-up steps)
        fit = _trainer(tmp_path / str(graphed), [bnp, record, *graphed_steps], max_steps=12)
        fit.fit(model, DataLoader(_token_batches(), batch_size=None))
        fits.append((model, record))
    assert GraphedSteps.runtime.graphs[0].replays == 12 - 3  # type: ignore[attr-defined]
    (eager, eager_record), (model, record) = fits
    for (name, p), q in zip(eager.named_parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
    for name, (mean_acc, var_acc, steps) in eager_record.statistics.items():
        torch.testing.assert_close(record.statistics[name][0], mean_acc, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(record.statistics[name][1], var_acc, rtol=1e-5, atol=1e-6, msg=name)
        assert record.statistics[name][2] == steps == 12


class OwnStep(Options):
    """A LightningModule with its own ``optimizer_step`` hook (which the callback captures with the rest), and a
    ``training_step`` that may skip a batch."""

    def __init__(self, skip: int | None = None) -> None:
        super().__init__()
        self.calls: list[tuple[int, int]] = []
        self.skip = skip

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Tensor | None:  # type: ignore[override]
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx == self.skip else loss

    @override
    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        self.calls.append((epoch, batch_idx))  # (Python: runs at the warm-up steps and the capture only)
        optimizer.step(closure=optimizer_closure)


def test_the_modules_own_optimizer_step_is_called_with_its_arguments_until_the_capture(tmp_path: Path) -> None:
    model = OwnStep()
    fit = _fit_options(tmp_path, model, max_steps=10, callbacks=[GraphedSteps(warmup_steps=2)], max_epochs=2)
    assert fit.global_step == 10
    assert model.calls == [(0, 0), (0, 1), (0, 2)]  # two warm-up steps and the captured one


def test_a_captured_step_that_training_step_skips_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as raised:
        _fit_options(tmp_path, OwnStep(skip=1))  # (warmup_steps=1: batch 1 is captured)
    assert str(raised.value) == (
        "GraphedSteps: the captured step's training_step returned None (a skipped step); every replay would skip it too"
    )


def test_a_checkpoint_that_gives_the_optimizer_a_float_lr_is_refused_when_a_scheduler_changes_it(
    tmp_path: Path,
) -> None:
    """Checked when training starts, after the checkpoint's param groups replaced the optimizer's tensor lr."""
    first = Options(scheduler=True, optimizer=lambda p: TensorLrSGD(p, lr=0.5))
    fit = _fit_options(tmp_path / "first", first, max_steps=4, callbacks=[])
    fit.save_checkpoint(tmp_path / "float_lr.ckpt")
    resumed = Options(scheduler=True, optimizer=lambda p: TensorLrSGD(p, lr=torch.tensor(0.5)))
    with pytest.raises(ValueError, match=r"changes the lr of param group 0 of TensorLrSGD, which reads it as a Python"):
        _trainer(tmp_path / "resumed", [GraphedSteps()], max_steps=8).fit(
            resumed, DataLoader(make_data(n=96), batch_size=16, drop_last=True), ckpt_path=tmp_path / "float_lr.ckpt"
        )


def test_a_token_mask_made_from_the_batch_before_the_step_is_refused(tmp_path: Path) -> None:
    bnp = BatchNormPreconditioning(
        verbose=False, token_mask=lambda batch: batch["attention_mask"] != 0, token_mask_layers=["inp", "hidden"]
    )
    with pytest.raises(ValueError) as raised:
        _trainer(tmp_path, [Record(), bnp, GraphedSteps(warmup_steps=1)], max_steps=4).fit(  # (BNP not first)
            MaskedTokens(), DataLoader(_token_batches(), batch_size=None)
        )
    assert str(raised.value).startswith(
        "GraphedSteps: BatchNormPreconditioning(token_mask=<function test_a_token_mask_made_from_the_batch_before_the_"
        "step_is_refused.<locals>.<lambda> at "
    )
    assert str(raised.value).endswith(
        ">) gave a mask that is not one of the batch's tensors (a function of the batch made it before the step): "
        "every replay would read the captured batch's. Give token_mask the batch's key or attribute, or a function "
        "that returns one of its tensors (an integer mask is fine)"
    )


class DrawsItsBatch(Classifier):
    @override
    def training_step(self, dataloader_iter: Any) -> Tensor:  # type: ignore[override]
        x, y = next(dataloader_iter)[0]
        return nn.functional.cross_entropy(self.network(x), y)


def test_a_training_step_that_draws_its_batch_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as raised:
        _trainer(tmp_path, [GraphedSteps()], max_steps=4).fit(
            DrawsItsBatch(), DataLoader(make_data(n=96), batch_size=16, drop_last=True)
        )
    assert str(raised.value) == (
        "GraphedSteps cannot replay a training_step that takes `dataloader_iter`: it draws its batch inside the step, "
        "which a replay does not run (every replay would train on the captured batch); take `batch` instead"
    )


class Tagged(pl.LightningModule):
    """A dict batch with a value that is not a tensor ahead of its tensors, and a step output with an extra tensor."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.network = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))

    @override
    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        logits = self.network(batch["x"])
        loss = nn.functional.cross_entropy(logits, batch["y"])
        return {"loss": loss, "logits_mean": logits.mean(), "tag": batch["tag"]}

    @override
    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class KeepOutputs(pl.Callback):
    def __init__(self) -> None:
        self.outputs: list[dict[str, Tensor]] = []

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.outputs.append(outputs)  # (the tensors themselves, read after the fit)


def _tagged_batches(n: int = 10, tags: tuple[str, ...] = ("digits",)) -> list[dict[str, Any]]:
    data = make_data(n=8 * n)
    return [
        {
            "tag": tags[min(i, len(tags) - 1)],
            "x": data.tensors[0][8 * i : 8 * i + 8],
            "y": data.tensors[1][8 * i : 8 * i + 8],
        }
        for i in range(n)
    ]


def test_a_dict_batch_with_a_value_that_is_not_a_tensor_and_extra_outputs_replays_as_eager(tmp_path: Path) -> None:
    runs = []
    for graphed in (False, True):
        model, keep = Tagged(), KeepOutputs()
        callbacks: list[pl.Callback] = [keep, *([GraphedSteps(warmup_steps=2)] if graphed else [])]
        _trainer(tmp_path / str(graphed), callbacks, max_steps=10).fit(
            model, DataLoader(_tagged_batches(), batch_size=None)
        )
        runs.append((model, [{k: v if isinstance(v, str) else float(v) for k, v in o.items()} for o in keep.outputs]))
    (eager, eager_outputs), (model, outputs) = runs
    assert len(outputs) == 10 and [sorted(o) for o in outputs] == [["logits_mean", "loss", "tag"]] * 10
    for got, want in zip(outputs, eager_outputs):
        assert got.pop("tag") == want.pop("tag") == "digits"
        assert got == pytest.approx(want, rel=1e-5)
    for p, q in zip(eager.parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("batches", "message"),
    [
        (
            _tagged_batches(tags=("digits", "digits", "digits", "letters")),
            "`batch` 3: its leaf 0 is 'letters', the captured step's was 'digits' (a value that is not a tensor is "
            "frozen into the graph)",
        ),
        (
            [*_tagged_batches(n=3), {"tag": "digits", "x": _tagged_batches()[0]["x"], "y": "none"}],
            "`batch` 3: its tensor 2 is 'none', the captured step's was (8,) torch.int64: a replay takes batches of "
            "the captured shapes (the last, smaller batch of an epoch: DataLoader(..., drop_last=True))",
        ),
    ],
    ids=["another value", "no tensor"],
)
def test_a_batch_unlike_the_captured_one_is_refused_by_name(tmp_path: Path, batches: list, message: str) -> None:
    with pytest.raises(ValueError) as raised:
        _trainer(tmp_path, [GraphedSteps(warmup_steps=1)], max_steps=6).fit(
            Tagged(), DataLoader(batches, batch_size=None)
        )
    assert str(raised.value) == message


def test_a_batch_built_otherwise_is_refused_by_name(tmp_path: Path) -> None:
    batches = [*_tagged_batches(n=3), {"x": _tagged_batches()[0]["x"], "y": _tagged_batches()[0]["y"]}]
    with pytest.raises(ValueError, match=r"^`batch` 3 is not built as the captured batch was: TreeSpec\(dict"):
        _trainer(tmp_path, [GraphedSteps(warmup_steps=1)], max_steps=6).fit(
            Tagged(), DataLoader(batches, batch_size=None)
        )


class TakesAnyArguments(Classifier):
    @override
    def training_step(self, *args: Any) -> Tensor:  # type: ignore[override]
        return super().training_step(*args)


def test_a_training_step_of_any_arguments_is_not_taken_for_one_that_draws_its_batch(tmp_path: Path) -> None:
    fit = _trainer(tmp_path, [GraphedSteps(warmup_steps=1)], max_steps=4)
    fit.fit(TakesAnyArguments(), DataLoader(make_data(n=96), batch_size=16, drop_last=True))
    assert fit.global_step == 4


@pytest.mark.parametrize(
    "make",
    [
        lambda: [BatchNormPreconditioning(verbose=False), ZSpaceRegularization(weight_decay=1e-2)],
        lambda: [WeightConditioning()],
    ],
    ids=["BNP with decay in z", "Weight Conditioning"],
)
def test_the_packages_other_training_callbacks_replay_as_eager(tmp_path: Path, make: Any) -> None:
    """Decay in z (terms added in BNP's step) and Weight Conditioning (a parametrized forward) inside the graph."""
    weights = []
    for graphed in (False, True):
        model = Classifier()
        callbacks = [*make(), *([GraphedSteps(warmup_steps=2)] if graphed else [])]
        torch.manual_seed(1)
        _trainer(tmp_path / str(graphed), callbacks, max_steps=12).fit(
            model, DataLoader(make_data(n=96), batch_size=16, shuffle=True, drop_last=True)
        )
        weights.append([p.detach().clone() for p in model.parameters()])
    for eager, replayed in zip(*weights):
        torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-6)


def test_timing_monitor_logs_only_whole_steps_once_they_are_replayed(tmp_path: Path) -> None:
    """Replayed, BNP's statistics and transform run inside the graph: TimingMonitor says so once and logs no split
    (it logged 0 ms for them before), while the eager warm-up steps keep theirs."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    from lightning_bnp import TimingMonitor

    callbacks = [BatchNormPreconditioning(verbose=False), TimingMonitor(every_n_steps=2), GraphedSteps(warmup_steps=2)]
    fit = _trainer(tmp_path, callbacks, max_steps=8, logger=CSVLogger(tmp_path))
    message = "TimingMonitor: the steps are replayed from a CUDA graph (GraphedSteps), which runs BNP's statistics"
    with pytest.warns(UserWarning, match="^" + re.escape(message)) as warned:
        fit.fit(Classifier(), DataLoader(make_data(n=96), batch_size=16, drop_last=True))
    assert sum(message in str(w.message) for w in warned) == 1
    rows = [r for r in csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))) if r["timing/step_ms"]]
    assert [r["step"] for r in rows] == ["0", "2", "4", "6"]
    for part in ("bnp_ms", "bnp_share", "bnp_transform_ms", "bnp_statistics_ms"):  # (step 2 is the captured one)
        assert [bool(r[f"timing/{part}"]) for r in rows] == [True, False, False, False], part
    assert all(float(r["timing/step_ms"]) > 0 for r in rows)
