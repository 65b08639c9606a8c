"""Layers built in ``LightningModule.configure_model`` (issue 26 item 1): Lightning calls it after every callback's
``setup``, so the callbacks find their layers at ``on_fit_start``; a run equals the same network built in
``__init__``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_bnp import BatchNormPreconditioning, ConditionNumberMonitor, WeightConditioning, ZSpaceRegularization
from tests.helpers import BoringClassifier, _fit, make_cnn, make_data


class LateClassifier(BoringClassifier):
    """The same classifier, its network built in ``configure_model`` (once: Lightning may call it again)."""

    def __init__(self) -> None:
        super().__init__(nn.Identity())
        self.network: nn.Module | None = None  # type: ignore[assignment]

    def configure_model(self) -> None:
        if self.network is None:
            # built on the CPU like the `__init__` twin: inside Lightning's init context a GPU run would
            # otherwise draw the initial weights from the CUDA generator
            with torch.device("cpu"):
                self.network = make_cnn()


DATA = make_data(32, shape=(2, 5, 5))


def _callbacks() -> list[Any]:
    return [
        BatchNormPreconditioning(verbose=False),
        ZSpaceRegularization(weight_decay=0.05),  # bias excluded: found among the late layers
        ConditionNumberMonitor(layers="network.5", every_n_steps=1000),  # its pattern matches a late layer
    ]


def _state(model: BoringClassifier, trainer: Any) -> dict[str, Any]:
    bnp = next(cb for cb in trainer.callbacks if isinstance(cb, BatchNormPreconditioning))
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}, "bnp": bnp.state_dict()}


def _assert_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["params"].keys() == b["params"].keys()
    for name, value in a["params"].items():
        torch.testing.assert_close(value, b["params"][name], rtol=0, atol=1e-6, msg=name)
    assert a["bnp"]["layers"].keys() == b["bnp"]["layers"].keys() == {"network.0", "network.2", "network.5"}
    for name, layer in a["bnp"]["layers"].items():
        for key, value in layer.items():
            torch.testing.assert_close(value, b["bnp"]["layers"][name][key], rtol=0, atol=1e-6, msg=f"{name}.{key}")


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_layers_built_in_configure_model_equal_layers_built_in_init(tmp_path: Path) -> None:
    early = BoringClassifier(make_cnn())
    trainer = _fit(tmp_path / "early", early, DATA, batch_size=8, callbacks=_callbacks(), max_steps=3)
    late = LateClassifier()
    late_trainer = _fit(tmp_path / "late", late, DATA, batch_size=8, callbacks=_callbacks(), max_steps=3)
    reference, state = _state(early, trainer), _state(late, late_trainer)
    assert int(state["bnp"]["layers"]["network.0"]["steps"]) == 3
    assert not torch.equal(state["params"]["network.0.weight"], make_cnn().state_dict()["0.weight"])
    _assert_equal(state, reference)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_configure_model_layers_resume_from_checkpoint(tmp_path: Path) -> None:
    straight = LateClassifier()
    trainer = _fit(tmp_path / "straight", straight, DATA, batch_size=8, callbacks=_callbacks(), max_epochs=2)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    callbacks = [*_callbacks(), ckpt]
    _fit(tmp_path / "first", LateClassifier(), DATA, batch_size=8, callbacks=callbacks, max_epochs=1,
         enable_checkpointing=True)  # fmt: skip
    resumed = LateClassifier()
    resumed_trainer = _fit(tmp_path / "resumed", resumed, DATA, batch_size=8, callbacks=_callbacks(), max_epochs=2,
                           ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))  # fmt: skip
    state = _state(resumed, resumed_trainer)
    assert int(state["bnp"]["layers"]["network.0"]["steps"]) == 8
    _assert_equal(state, _state(straight, trainer))


def test_weight_conditioning_refuses_layers_built_in_configure_model(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"(?s)no Linear.*`configure_model` after every callback's `setup`"):
        _fit(tmp_path, LateClassifier(), DATA, batch_size=8, callbacks=[WeightConditioning()], max_steps=1)

    class Partly(LateClassifier):  # one layer in __init__, the others in configure_model
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Linear(2, 2)

    with pytest.raises(RuntimeError, match=r"layers \['network.0', 'network.2', 'network.5'\] were built in"):
        _fit(tmp_path, Partly(), DATA, batch_size=8, callbacks=[WeightConditioning()], max_steps=1)
