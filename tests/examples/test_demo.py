"""`make demo` (issue 17 item 3): the comparison runs end to end, prints and writes its table and figure, and
leaves TensorBoard runs with κ and timing values, histograms and heatmap images, none of them non-finite."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from example_projects import demo


@pytest.mark.slow
def test_quick_demo_writes_table_figure_and_finite_tensorboard_logs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = demo.main(["--quick", "--log-dir", str(tmp_path), "--accelerator", "cpu"])
    run_dir = tmp_path / "demo" / "version_0"
    summary = (run_dir / "summary.md").read_text()
    assert summary.strip() in capsys.readouterr().out
    table, rule = summary.strip().split("\n\n")
    assert len(table.splitlines()) == 2 + len(runs) == 8
    assert "n = 101 parameters" in rule and all(run.hessian_size == 101 for run in runs)  # 1 + 100 hidden units
    assert (run_dir / "comparison.png").stat().st_size > 10_000
    for run in runs:
        assert 0.0 <= run.test_acc <= 1.0
        events = EventAccumulator(
            str(run_dir / f"b{run.batch_size}_{run.method}"), size_guidance={"scalars": 0, "histograms": 0, "images": 0}
        )
        events.Reload()
        tags = events.Tags()["scalars"]
        expected = ["timing/step_ms", "val/acc", "train/loss"]
        expected += [t for t in tags if t.startswith("bnp/hessian_kappa/")][:1] or ["bnp/hessian_kappa/<missing>"]
        if run.method == "bnp":
            expected += [t for t in tags if t.startswith("bnp/kappa_D/")][:1] or ["bnp/kappa_D/<missing>"]
        assert set(expected) <= set(tags), (run.method, sorted(tags))
        assert all(math.isfinite(e.value) for tag in tags for e in events.Scalars(tag))
        histograms, images = events.Tags()["histograms"], events.Tags()["images"]
        assert any("spectrum" in tag for tag in histograms), (run.method, histograms)
        assert any("weight_kappa" in tag for tag in images), (run.method, images)
        if run.method == "bnp":
            assert any("sigma" in tag for tag in histograms) and any("kappa_D" in tag for tag in images)
        for tag in histograms:
            for event in events.Histograms(tag):
                assert math.isfinite(event.histogram_value.min) and math.isfinite(event.histogram_value.max)


def test_summary_counts_steps_to_target_and_medians() -> None:
    run = demo.Run(6, "bnp", 0.5, 0.9, {"val/acc": [(100, 0.85), (200, 0.91), (300, 0.89)],
                                       "bnp/kappa_D/a": [(0, 10.0), (5, 30.0)], "bnp/kappa_D/b": [(0, 20.0), (5, 5.0)],
                                       "timing/step_ms": [(0, 3.0), (5, 1.0), (10, 2.0)]})  # fmt: skip
    assert run.steps_to(0.9) == 200 and run.steps_to(0.95) is None
    assert run.median(r"bnp/kappa_D/.*", reduce="max") == 25.0  # max per record: 20, 30
    assert run.median("timing/step_ms") == 2.0
    assert "| 6 | BNP | 0.5 | 0.900 | 200 | – |" in demo.summary_table([run])


def test_the_table_has_no_time_per_step_and_sets_kappa_only_beside_its_own_preconditioned_block() -> None:
    """Issue 45 item 9: the table printed each network's κ side by side (BNP's 3.8e11 above vanilla's 8.8e10, two
    different networks at different losses) and ms/step of runs made one after another under changing load."""
    kappa = "bnp/hessian_kappa/network.7"
    bnp = demo.Run(60, "bnp", 1.0, 0.95, {f"{kappa}/original": [(0, 4e11), (20, 3e11), (40, 2e12)],
                                          f"{kappa}/preconditioned": [(0, 1e11), (20, 1e11), (40, 4e11)],
                                          "timing/step_ms": [(0, 3.0)]}, hessian_size=101)  # fmt: skip
    vanilla = demo.Run(60, "vanilla", 0.5, 0.94, {f"{kappa}/original": [(0, 8.8e10)], "timing/step_ms": [(0, 9.0)]})
    table, rule = demo.summary_table([vanilla, bnp]).split("\n\n")
    head, _, vanilla_row, bnp_row = table.splitlines()
    assert "ms" not in head and "3.00" not in table and "9.00" not in table
    assert "| 60 | vanilla | 0.5 | 0.940 | not reached | – | – | – |" == vanilla_row  # no κ of another network
    assert "| 4e+11 → 1e+11 | 4× | – |" in bnp_row  # medians of the same block at the same steps; the gains 4, 3, 5
    # the rule: |λ| ≤ n·eps·max|λ| is zero, so κ ≤ 1/(n·eps) for the 101-parameter block in float64
    ceiling = 1 / (101 * np.finfo(np.float64).eps)
    assert demo.kappa_ceiling(bnp) == pytest.approx(ceiling) and f"1/(n·eps) = {ceiling:.1e}" in rule
    assert "n = 101 parameters" in rule and "n·eps·max|λ| counts as zero" in rule


def test_gain_is_the_same_blocks_ratio_at_the_same_step_and_its_smoothing_ignores_one_record() -> None:
    kappa = "bnp/hessian_kappa/n.7"
    series = {
        f"{kappa}/original": [(0, 10.0), (20, 1e12), (40, 30.0)],
        f"{kappa}/preconditioned": [(0, 5.0), (20, 1e14), (40, 10.0)],
    }
    run = demo.Run(60, "bnp", 1.0, 0.9, series)
    assert demo.gains(run) == [(0, 2.0), (20, 0.01), (40, 3.0)]
    assert demo.rolling_median(demo.gains(run), width=3) == [(0, 1.005), (20, 2.0), (40, 1.505)]
    assert demo.gains(demo.Run(60, "vanilla", 0.5, 0.9, {"bnp/hessian_kappa/n.7/original": [(0, 1.0)]})) == []
    assert "| 2× |" in demo.summary_table([run])
