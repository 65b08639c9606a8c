"""Issue 17 item 9: what a user sees of a configured object (repr, --print_config) and the settings a
BNP checkpoint remembers."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_bnp import (
    BatchNormPreconditioning,
    ConditionNumberMonitor,
    GraphedSteps,
    TimingMonitor,
    WeightConditioning,
    ZSpaceRegularization,
)
from lightning_bnp.core import BNPPreconditioner, BNPWarning
from tests.helpers import BoringClassifier, _fit, make_data, make_mlp


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (
            lambda: BatchNormPreconditioning(rho=0.9, exclude="head"),
            "BatchNormPreconditioning(rho=0.9, eps1=0.01, eps2=0.0001, statistics='running', bias_correction=False, "
            "layer_types=['Linear', 'Conv1d', 'Conv2d', 'Conv3d'], include=None, exclude=['head'], "
            "sync_statistics=True, verbose=True)",
        ),
        (lambda: WeightConditioning(mode="column"), "WeightConditioning(mode='column', layers='all', layer_types=["),
        (
            lambda: ZSpaceRegularization(weight_decay=1e-4),
            "ZSpaceRegularization(weight_decay=0.0001, decay_space='z', ",
        ),
        (lambda: ConditionNumberMonitor(every_n_steps=7), "ConditionNumberMonitor(every_n_steps=7, layers=None, "),
        (lambda: TimingMonitor(every_n_steps=3), "TimingMonitor(every_n_steps=3)"),
        (lambda: GraphedSteps(warmup_steps=5), "GraphedSteps(warmup_steps=5)"),
    ],
    ids=[
        "BatchNormPreconditioning",
        "WeightConditioning",
        "ZSpaceRegularization",
        "ConditionNumberMonitor",
        "TimingMonitor",
        "GraphedSteps",
    ],
)
def test_callbacks_repr_their_arguments(make: Callable[[], object], expected: str) -> None:
    """The repr shows the arguments given and the defaults (built in the test, not at collection: a default
    changed at run time, e.g. by mutation testing, shows)."""
    assert repr(make()).startswith(expected)


def test_preconditioner_repr_names_its_layers_and_state() -> None:
    pre = BNPPreconditioner(nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1)), rho=0.5)
    text = repr(pre)
    assert text.startswith("BNPPreconditioner(rho=0.5, eps1=0.01,") and "model=" not in text
    assert text.endswith("layers=['0', '2'], attached=True)")
    pre.detach()
    assert repr(pre).endswith("attached=False)")


def _trained_state(**settings: object) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2))
    pre = BNPPreconditioner(model, **settings)  # type: ignore[arg-type]
    model(torch.randn(4, 3)).sum().backward()
    pre.step()
    return pre.state_dict()


def test_state_dict_saves_the_settings_and_a_mismatch_on_load_warns() -> None:
    state = _trained_state(rho=0.9, eps1=0.05)
    assert state["hyperparameters"] == {
        "rho": 0.9,
        "eps1": 0.05,
        "eps2": 1e-4,
        "statistics": "running",
        "bias_correction": False,
    }
    same = BNPPreconditioner(nn.Sequential(nn.Linear(3, 2)), rho=0.9, eps1=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same.load_state_dict(state)
    other = BNPPreconditioner(nn.Sequential(nn.Linear(3, 2)))
    with pytest.warns(BNPWarning, match=r"eps1: saved 0\.05, now 0\.01, rho: saved 0\.9, now 0\.99"):
        other.load_state_dict(state)
    assert other.layers["0"].running.steps == 1  # loaded all the same


def test_a_state_saved_before_settings_were_recorded_loads_silently() -> None:
    state = _trained_state()
    del state["hyperparameters"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        BNPPreconditioner(nn.Sequential(nn.Linear(3, 2)), rho=0.5).load_state_dict(state)


@pytest.mark.parametrize("verbose", [True, False])
def test_bnp_says_which_layers_it_manages_unless_quiet(
    verbose: bool, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 17 item 6: one rank-zero line naming the managed layers, as WeightConditioning's."""
    with caplog.at_level(logging.INFO):
        _fit(
            tmp_path,
            BoringClassifier(make_mlp()),
            make_data(),
            batch_size=16,
            max_steps=1,
            callbacks=[BatchNormPreconditioning(verbose=verbose), WeightConditioning(verbose=verbose)],
        )
    lines = [r.getMessage() for r in caplog.records]
    bnp = [line for line in lines if line.startswith("BatchNormPreconditioning: BNP manages")]
    wc = [line for line in lines if line.startswith("WeightConditioning:")]
    if verbose:
        assert bnp == ["BatchNormPreconditioning: BNP manages 2 layers: ['network.0', 'network.2']"]
        assert len(wc) == 1
    else:
        assert bnp == [] and wc == []
