"""TimingMonitor beside each of Lightning's built-in profilers: the Trainer's report stays complete.

The monitor puts a forwarding profiler in front of ``trainer.profiler`` during ``fit`` (to time other
callbacks' hooks). The reference is the same fit without the monitor: every action that profiler reports
there, it must report with the monitor too (the monitor's own hooks come on top), and the fit must end
without an error. XLA's profiler needs a TPU and is not tested.
"""

from __future__ import annotations

import gc
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.profilers import AdvancedProfiler, PassThroughProfiler, Profiler, PyTorchProfiler, SimpleProfiler

from lightning_bnp.callbacks.bnp import BatchNormPreconditioning
from lightning_bnp.callbacks.timing_monitor import TimingMonitor
from tests.helpers import BoringClassifier, _fit, make_data, make_mlp


def _simple_actions(report: str) -> set[str]:
    """``SimpleProfiler``'s table rows as 'action × calls' (its columns: action, mean, calls, total, %)."""
    rows = re.findall(r"^\|\s+(\S[^\t|]*?)\s*\t\|\s+\S+\s*\t\|\s+(\d+)\s*\t\|", report, flags=re.MULTILINE)
    return {f"{action} × {calls}" for action, calls in rows if action not in ("Action", "Total")}


def _advanced_actions(report: str) -> set[str]:
    """``AdvancedProfiler`` writes one cProfile table per action, each headed 'Profile stats for: <action>'."""
    return set(re.findall(r"^Profile stats for: (.+?)\s*$", report, flags=re.MULTILINE))


def _pytorch_actions(report: str) -> set[str]:
    """``PyTorchProfiler`` names Lightning's actions ``[pl][profile]<action>`` in its table (names cut at the
    column width; every row is printed with ``row_limit=-1``)."""
    return set(re.findall(r"\[pl\]\[profile\]\S+", report))


PROFILERS: dict[str, tuple[Callable[[Path], Profiler], Callable[[str], set[str]]]] = {
    "simple": (lambda d: SimpleProfiler(dirpath=d, filename="report"), _simple_actions),
    "advanced": (lambda d: AdvancedProfiler(dirpath=d, filename="report"), _advanced_actions),
    "pytorch": (lambda d: PyTorchProfiler(dirpath=d, filename="report", row_limit=-1), _pytorch_actions),
}


def _profiled_fit(tmp_path: Path, profiler: Profiler | None, monitor: bool) -> Any:
    callbacks: list[Any] = [BatchNormPreconditioning()] + ([TimingMonitor(every_n_steps=1)] if monitor else [])
    trainer = _fit(tmp_path, BoringClassifier(make_mlp()), make_data(), batch_size=8, max_steps=3,
                   callbacks=callbacks, profiler=profiler, logger=CSVLogger(tmp_path))  # fmt: skip
    gc.collect()  # the monitor's stand-in, if anything still held it, is gone: the report must not change
    return trainer


@pytest.mark.parametrize("name", list(PROFILERS))
def test_the_trainers_profiler_reports_every_action_with_timing_monitor(tmp_path: Path, name: str) -> None:
    """Issue 45 item 6: the stand-in once tore the Trainer's profiler down when it was garbage-collected,
    before the Trainer's `describe()`: AdvancedProfiler's report was emptied, PyTorchProfiler's fit ended
    in an AssertionError."""
    make, actions = PROFILERS[name]
    reports = {}
    for monitor in (False, True):
        run = tmp_path / f"monitor={monitor}"
        profiler = make(run)
        trainer = _profiled_fit(run, profiler, monitor)
        assert trainer.profiler is profiler
        reports[monitor] = actions((run / "fit-report.txt").read_text())
    assert len(reports[False]) > 10  # the parser found the report's actions
    assert reports[False] <= reports[True]
    extra = reports[True] - reports[False]
    assert extra and all("TimingMonitor" in action for action in extra), extra
    if name == "simple":  # every action of the fit recorded as many times as without the monitor
        assert any("BatchNormPreconditioning.on_before_optimizer_step × 3" in a for a in reports[True])


def test_timing_monitor_without_a_profiler_keeps_the_pass_through_profiler(tmp_path: Path) -> None:
    """`profiler=None` (the Trainer's PassThroughProfiler): nothing reported, nothing raised, the monitor still
    times BNP's hooks through the stand-in and puts the PassThroughProfiler back."""
    for profiler in (None, PassThroughProfiler()):
        trainer = _profiled_fit(tmp_path, profiler, monitor=True)
        assert type(trainer.profiler) is PassThroughProfiler and (profiler is None or trainer.profiler is profiler)
        logged = (Path(trainer.logger.log_dir) / "metrics.csv").read_text().splitlines()[0].split(",")
        assert "timing/callbacks/BatchNormPreconditioning_ms" in logged


def test_the_stand_in_reads_the_trainers_profiler(tmp_path: Path) -> None:
    """During fit `trainer.profiler` is the monitor's stand-in; what a user reads from it (recorded durations,
    the report's directory) is the Trainer's profiler's."""
    seen: dict[str, Any] = {"steps": []}

    class Peek(BoringClassifier):
        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            seen["dirpath"] = self.trainer.profiler.dirpath
            seen["steps"].append(len(self.trainer.profiler.recorded_durations["run_training_batch"]))

    profiler = SimpleProfiler(dirpath=tmp_path / "reports", filename="report")
    _fit(tmp_path, Peek(make_mlp()), make_data(), batch_size=8, max_steps=2,
         callbacks=[BatchNormPreconditioning(), TimingMonitor(every_n_steps=1)], profiler=profiler,
         logger=CSVLogger(tmp_path))  # fmt: skip
    assert seen == {"dirpath": tmp_path / "reports", "steps": [1, 2]}  # `on_train_batch_end` follows each batch
