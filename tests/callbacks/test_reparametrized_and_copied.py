"""The Lightning side of issue 25: pruning mid-training, pickled and copied callbacks, lazy layers, and a
resume from a checkpoint without BNP state."""

from __future__ import annotations

import copy
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, ModelPruning
from torch import nn

from lightning_bnp import (
    BatchNormPreconditioning,
    ConditionNumberMonitor,
    TimingMonitor,
    WeightConditioning,
    ZSpaceRegularization,
)
from lightning_bnp.core import BNPWarning
from tests.helpers import BoringClassifier, _fit, make_data, make_mlp


def test_model_pruning_at_an_epoch_end_is_followed_every_step(tmp_path: Path) -> None:
    """Lightning's ModelPruning prunes weight and bias at the end of epoch 0: BNP keeps transforming both layers,
    with the centred transform (a pruned bias is still a bias), on all 8 steps."""
    bnp = BatchNormPreconditioning()
    pruning = ModelPruning(
        "l1_unstructured", amount=0.3, parameter_names=["weight", "bias"], make_pruning_permanent=False
    )
    model = BoringClassifier(make_mlp())
    with warnings.catch_warnings():
        warnings.simplefilter("error", BNPWarning)
        _fit(tmp_path, model, make_data(n=64), batch_size=16, callbacks=[pruning, bnp], max_epochs=2)
    assert hasattr(model.network[0], "weight_orig") and hasattr(model.network[0], "bias_orig")
    assert bnp.preconditioner is not None
    for name, layer in bnp.preconditioner.layers.items():
        assert layer.running.steps == 8, name
        assert layer.weight is model.network[int(name.split(".")[-1])].weight_orig
    transforms = bnp.preconditioner.step_transforms(model.parameters())
    assert len(transforms) == 2 and all(t.mu is not None for _, t in transforms.values())


def callbacks_under_test() -> list[Any]:
    return [
        BatchNormPreconditioning(verbose=False),
        ZSpaceRegularization(weight_decay=0.01),
        ConditionNumberMonitor(every_n_steps=2),
        TimingMonitor(every_n_steps=2),
    ]


def copies(obj: Any, pickles: bool = True) -> None:
    assert type(copy.deepcopy(obj)) is type(obj)
    if pickles:
        assert type(pickle.loads(pickle.dumps(obj))) is type(obj)


@pytest.mark.filterwarnings("ignore:.*(logger|no logger).*")
def test_every_callback_pickles_and_deepcopies_before_and_after_fit(tmp_path: Path) -> None:
    callbacks = callbacks_under_test()
    for callback in callbacks:
        copies(callback)
    model = BoringClassifier(make_mlp())
    _fit(tmp_path, model, make_data(n=32), batch_size=8, callbacks=callbacks, max_steps=3)
    for callback in callbacks:
        copies(callback)
    copies((model, callbacks))


@pytest.mark.filterwarnings("ignore:.*(logger|no logger).*")
def test_weight_conditioning_pickles_and_deepcopies_and_bnp_on_it_deepcopies(tmp_path: Path) -> None:
    """A parametrized model pickles only through its state_dict (torch's rule); it deep-copies, with BNP."""
    wc, bnp = WeightConditioning(include=["network.2"], verbose=False), BatchNormPreconditioning(verbose=False)
    copies(wc)
    model = BoringClassifier(make_mlp())
    _fit(tmp_path, model, make_data(n=32), batch_size=8, callbacks=[wc, bnp], max_steps=3)
    copies(wc)
    copies((model, bnp), pickles=False)


def test_an_unpickled_model_and_callback_go_on_exactly_as_the_original(tmp_path: Path) -> None:
    data = make_data(n=64)
    bnp = BatchNormPreconditioning()
    model = BoringClassifier(make_mlp())
    _fit(tmp_path / "a", model, data, batch_size=16, callbacks=[bnp], max_steps=3)
    model2, bnp2 = pickle.loads(pickle.dumps((model, bnp)))
    model3, bnp3 = copy.deepcopy((model, bnp))
    for m, cb, where in ((model, bnp, "b"), (model2, bnp2, "c"), (model3, bnp3, "d")):
        _fit(tmp_path / where, m, data, batch_size=16, callbacks=[cb], max_steps=4)
    for m, cb in ((model2, bnp2), (model3, bnp3)):
        for (n, p), (_, q) in zip(model.named_parameters(), m.named_parameters()):
            torch.testing.assert_close(q, p, rtol=0, atol=0, msg=n)
        assert cb.preconditioner is not None and bnp.preconditioner is not None
        for name, layer in bnp.preconditioner.layers.items():
            other = cb.preconditioner.layers[name].running
            assert other.steps == layer.running.steps == 7
            assert torch.equal(other.mean_acc, layer.running.mean_acc)
            assert torch.equal(other.var_acc, layer.running.var_acc)


class LazyClassifier(BoringClassifier):
    def __init__(self, example: bool) -> None:
        super().__init__(nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, 3)))
        if example:
            self.example_input_array = torch.zeros(2, 6)


def test_lazy_layers_are_materialized_with_example_input_array(tmp_path: Path) -> None:
    bnp = BatchNormPreconditioning()
    model = LazyClassifier(example=True)
    _fit(tmp_path, model, make_data(n=32), batch_size=8, callbacks=[bnp], max_steps=2)
    assert bnp.preconditioner is not None and list(bnp.preconditioner.layers) == ["network.0", "network.2"]
    assert bnp.preconditioner.layers["network.0"].running.steps == 2


def test_lazy_layers_without_example_input_array_are_refused_naming_them(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"layers \['network.0'\] are uninitialised lazy modules.*example_input_array"):
        _fit(
            tmp_path,
            LazyClassifier(example=False),
            make_data(n=32),
            batch_size=8,
            callbacks=[BatchNormPreconditioning()],
            max_steps=2,
        )


def test_resume_from_a_checkpoint_without_bnp_state_warns_once(tmp_path: Path) -> None:
    data = make_data(n=32)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    _fit(
        tmp_path / "a",
        BoringClassifier(make_mlp()),
        data,
        batch_size=8,
        callbacks=[ckpt],
        max_epochs=1,
        enable_checkpointing=True,
    )
    last = str(tmp_path / "ckpt" / "last.ckpt")
    with pytest.warns(BNPWarning, match=r"holds no BNP state .* running statistics start fresh") as record:
        _fit(
            tmp_path / "b",
            BoringClassifier(make_mlp()),
            data,
            batch_size=8,
            callbacks=[BatchNormPreconditioning()],
            max_epochs=2,
            ckpt_path=last,
        )
    assert len([w for w in record if "holds no BNP state" in str(w.message)]) == 1
    ckpt2 = ModelCheckpoint(dirpath=tmp_path / "ckpt2", save_last=True)
    _fit(
        tmp_path / "c",
        BoringClassifier(make_mlp()),
        data,
        batch_size=8,
        callbacks=[BatchNormPreconditioning(), ckpt2],
        max_epochs=1,
        enable_checkpointing=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", BNPWarning)  # with BNP state: no word
        _fit(
            tmp_path / "d",
            BoringClassifier(make_mlp()),
            data,
            batch_size=8,
            callbacks=[BatchNormPreconditioning()],
            max_epochs=2,
            ckpt_path=str(tmp_path / "ckpt2" / "last.ckpt"),
        )


@pytest.mark.filterwarnings("ignore:.*(logger|no logger).*")
def test_a_layer_left_alone_is_named_once_and_the_monitors_still_run(tmp_path: Path) -> None:
    """A spectral-normed layer: one BNPWarning at setup; the other layer is managed; ConditionNumberMonitor
    still logs the weight κ of the left-alone layer (of the weight in use) without an internal error."""
    model = BoringClassifier(make_mlp())
    torch.nn.utils.parametrizations.spectral_norm(model.network[0])
    bnp = BatchNormPreconditioning(verbose=False)
    monitor = ConditionNumberMonitor(every_n_steps=1, hessian_block=False)
    with pytest.warns(BNPWarning, match=r"BNP layer 'network.0' .* is left alone: .*_SpectralNorm") as record:
        _fit(tmp_path, model, make_data(n=32), batch_size=8, callbacks=[bnp, monitor], max_steps=2)
    assert len([w for w in record if issubclass(w.category, BNPWarning)]) == 1
    assert bnp.preconditioner is not None and list(bnp.preconditioner.layers) == ["network.2"]
    assert bnp.preconditioner.layers["network.2"].running.steps == 2
