"""Which strategies run `fit` in worker processes (pins Lightning's private launcher class the check relies on)."""

from __future__ import annotations

from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from lightning_bnp import BatchNormPreconditioning, ConditionNumberMonitor, WeightConditioning, ZSpaceRegularization
from lightning_bnp.callbacks._strategy import holds_full_replica, shards_rows, spawns_workers
from tests.helpers import BoringClassifier, make_mlp


@pytest.mark.parametrize(
    ("strategy", "spawned"),
    [("ddp_spawn", True), ("ddp_fork", True), ("ddp_notebook", True), ("ddp", False), ("auto", False)],
)
def test_spawning_strategies_are_recognised(strategy: str, spawned: bool) -> None:
    devices = 1 if strategy == "auto" else 2
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False)
    assert spawns_workers(trainer.strategy) is spawned
    assert holds_full_replica(trainer.strategy)


class _Mesh:
    """A 2-D device mesh stand-in ("data_parallel", "tensor_parallel"): its sizes are all the check reads."""

    def __init__(self, tp: int) -> None:
        self.tp = tp

    def __getitem__(self, name: str) -> SimpleNamespace:
        return SimpleNamespace(size=lambda: self.tp if name == "tensor_parallel" else 2)


def _model_parallel(tp: int) -> SimpleNamespace:
    strategy = ModelParallelStrategy(data_parallel_size=2 // tp if tp <= 2 else 1, tensor_parallel_size=tp)
    strategy._device_mesh = _Mesh(tp)  # type: ignore[assignment]  # set by `setup_environment` in a real run
    return SimpleNamespace(strategy=strategy, callbacks=[], log_every_n_steps=50, loggers=[])


def test_fsdp2_is_supported_and_tensor_parallelism_and_fsdp1_are_refused_pointing_to_it() -> None:
    trainer = _model_parallel(1)
    assert shards_rows(trainer.strategy) and not holds_full_replica(trainer.strategy)
    BatchNormPreconditioning._check_strategy(trainer)  # type: ignore[arg-type]
    for refused, cause in ((_model_parallel(2), r"tensor parallelism \(tensor_parallel_size=2\)"),
                           (SimpleNamespace(strategy=FSDPStrategy()), "whole rows")):  # fmt: skip
        with pytest.raises(RuntimeError, match=rf"(?s){cause}.*ModelParallelStrategy\(tensor_parallel_size=1\)"):
            BatchNormPreconditioning._check_strategy(refused)  # type: ignore[arg-type]


def test_callbacks_that_need_whole_weights_are_refused_under_fsdp2_with_the_reason() -> None:
    trainer, module = _model_parallel(1), BoringClassifier(make_mlp())
    with pytest.raises(RuntimeError, match=r"gradient_penalty>0.*FSDP2.*The weight decay"):
        ZSpaceRegularization(gradient_penalty=0.1).setup(trainer, module, "fit")  # type: ignore[arg-type]
    ZSpaceRegularization(weight_decay=0.1).setup(trainer, module, "fit")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"ConditionNumberMonitor is not supported under FSDP2.*shard"):
        ConditionNumberMonitor().setup(trainer, module, "fit")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="WeightConditioning does not support the ModelParallelStrategy"):
        WeightConditioning().setup(trainer, module, "fit")  # type: ignore[arg-type]
