"""A ``Trainer`` fit whose steps are replayed from a CUDA graph ends where the eager fit with the callback in
automatic optimization ends: the same weights and running statistics after 24 steps. Two ways: the
``GraphedSteps`` callback in automatic optimization, and manual optimization with ``GraphedTrainingStep`` and the
callback's preconditioner (the docs' "CUDA graphs" guide). On a CUDA device (skipped without one) and on the CPU
with the suite's stand-in for CUDA graphs (``tests/recorded_graphs.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_bnp import BatchNormPreconditioning, GraphedSteps
from lightning_bnp.core import GraphedTrainingStep
from tests.helpers import make_data, quiet_trainer
from tests.recorded_graphs import RecordedGraphs

CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"))


@pytest.fixture(params=[CUDA, "cpu"])
def device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "cpu":
        runtime = RecordedGraphs()
        monkeypatch.setattr(GraphedTrainingStep, "runtime", runtime)
        monkeypatch.setattr(GraphedSteps, "runtime", runtime)
    return str(request.param)


class Classifier(pl.LightningModule):
    def __init__(self, graphed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.network = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))
        self.automatic_optimization = not graphed
        self.graphed: GraphedTrainingStep | None = None

    def loss_of(self, x: Tensor, y: Tensor) -> Tensor:
        return nn.functional.cross_entropy(self.network(x), y)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> Tensor | None:
        if self.automatic_optimization:
            return self.loss_of(*batch)
        if self.graphed is None:
            bnp = next(c for c in self.trainer.callbacks if isinstance(c, BatchNormPreconditioning))
            self.graphed = GraphedTrainingStep(self.loss_of, self.optimizers(), bnp.preconditioner)
        loss = self.graphed(*batch)
        self.log("train_loss", loss.clone())
        return None

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class RecordStatistics(pl.Callback):
    """The running statistics at the end of training (the callback drops its preconditioner at teardown)."""

    def __init__(self, bnp: BatchNormPreconditioning) -> None:
        self.bnp, self.state = bnp, {}

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.bnp.preconditioner is not None
        for name, layer in self.bnp.preconditioner.layers.items():
            r = layer.running
            self.state[name] = (r.mean_acc.clone(), r.var_acc.clone(), r.steps)


def _fit(tmp_path: Path, device: str, graphed: bool, callback: bool = False) -> tuple[Classifier, dict[str, Any]]:
    model, bnp = Classifier(graphed and not callback), BatchNormPreconditioning(verbose=False)
    record = RecordStatistics(bnp)
    graphed_steps = [GraphedSteps()] if callback else []
    trainer = quiet_trainer(
        tmp_path,
        [bnp, record, *graphed_steps],
        accelerator=device,
        max_steps=24,
        max_epochs=4,  # (24 steps: a fit that stops counting steps ends anyway)
    )
    data = DataLoader(make_data(n=96), batch_size=16, shuffle=False, drop_last=True)
    trainer.fit(model, data)
    assert trainer.global_step == 24  # (every replay counted as an optimizer step)
    return model, record.state


@pytest.mark.parametrize("callback", [False, True], ids=["manual-GraphedTrainingStep", "automatic-GraphedSteps"])
def test_a_graphed_fit_ends_where_the_eager_fit_ends(tmp_path: Path, device: str, callback: bool) -> None:
    eager, eager_statistics = _fit(tmp_path / "eager", device, graphed=False)
    graphed, graphed_statistics = _fit(tmp_path / "graphed", device, graphed=True, callback=callback)
    assert callback or (graphed.graphed is not None and graphed.graphed.captured)
    for (name, p), q in zip(eager.named_parameters(), graphed.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
    assert list(graphed_statistics) == list(eager_statistics) == ["network.0", "network.2", "network.4"]
    for name, (mean_acc, var_acc, steps) in eager_statistics.items():
        got = graphed_statistics[name]
        torch.testing.assert_close(got[0], mean_acc, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(got[1], var_acc, rtol=1e-5, atol=1e-6, msg=name)
        assert got[2] == steps == 24
