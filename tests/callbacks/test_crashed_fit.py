"""A fit that raises (issue 37, item 3): Lightning calls no ``teardown`` after an exception, so the callback's
``on_exception`` detaches BNP: the next fit, with the same callback or a new one, starts clean."""

from __future__ import annotations

from pathlib import Path

import pytest
from typing_extensions import override

from lightning_bnp import BatchNormPreconditioning
from tests.helpers import BoringClassifier, _fit, make_data, make_mlp, spy_moments

BATCH = 16


class CrashesAfterBackward(BoringClassifier):
    """Raises after the backward of its ``crash_at``-th batch, before that step's optimizer step."""

    def __init__(self, crash_at: int | None) -> None:
        super().__init__(make_mlp())
        self.crash_at = crash_at

    @override
    def on_after_backward(self) -> None:
        if self.crash_at is not None and self.trainer.global_step == self.crash_at:
            raise RuntimeError("crash")


def _crash(tmp_path: Path, model: CrashesAfterBackward, bnp: BatchNormPreconditioning) -> None:
    with pytest.raises(RuntimeError, match="crash"):
        _fit(tmp_path, model, make_data(), batch_size=BATCH, callbacks=[bnp], max_steps=4)


def test_a_crashed_fit_detaches_and_a_new_callback_attaches(tmp_path: Path) -> None:
    model, crashed = CrashesAfterBackward(crash_at=1), BatchNormPreconditioning()
    _crash(tmp_path, model, crashed)
    assert crashed.preconditioner is not None and not crashed.preconditioner.attached
    model.crash_at = None
    fresh = BatchNormPreconditioning()
    _fit(tmp_path, model, make_data(), batch_size=BATCH, callbacks=[fresh], max_steps=2)  # no "already managed"
    assert fresh.preconditioner is not None
    assert all(layer.running.steps == 2 for layer in fresh.preconditioner.layers.values())


def test_the_same_callback_after_a_crash_pools_no_rows_of_the_crashed_fit(tmp_path: Path) -> None:
    model, bnp = CrashesAfterBackward(crash_at=1), BatchNormPreconditioning()
    _crash(tmp_path, model, bnp)
    assert bnp.preconditioner is not None
    assert all(layer.moments is None for layer in bnp.preconditioner.layers.values())
    seen = spy_moments(bnp.preconditioner)
    model.crash_at = None
    _fit(tmp_path, model, make_data(), batch_size=BATCH, callbacks=[bnp], max_steps=1)
    # the new fit's first step pools its own batch only, not the crashed step's rows as well
    assert {name: int(m.rows) for name, m in seen.items()} == dict.fromkeys(bnp.preconditioner.layers, BATCH)
