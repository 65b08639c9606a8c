"""§9 of RESULTS.md: the transposed-convolution decoder, regenerated alone with ``--sections decoder``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.reproduce.decoder import (
    HEADER,
    METHODS,
    DecoderJob,
    DecoderRun,
    DecoderSetting,
    autoencoder,
    choose,
    extract,
    plot,
    section,
    splice,
)
from tests.warm_python import run_python

REPORT = "# Report\n\n## 7. Transformers\n\ntext\n\n---\nTraining runs: 3.\n"


def test_splice_then_extract_gives_the_section_back() -> None:
    lines = [f"{HEADER}\n", "body", "", "| a |"]
    report = splice(REPORT, lines)
    assert report.index("## 7. Transformers") < report.index(HEADER) < report.index("---\nTraining runs")
    assert extract(report) == [HEADER, "", "body", "", "| a |"]
    assert extract(REPORT) == []
    assert splice(report, extract(report)) == report  # what a full run does with a kept section


def test_the_rate_is_chosen_on_validation_and_a_diverged_seed_rules_a_rate_out() -> None:
    s = DecoderSetting(batch=4, epochs=1, seeds=2)
    results = {}
    for lr in s.rates("BNP"):
        for seed in range(2):
            val = 0.01 if lr == 4.0 else 0.02 + lr / 100  # 4.0: best validation, but one seed diverges
            results[DecoderJob(s, "BNP", lr, seed)] = DecoderRun(
                [val], [1.0 - lr / 10], diverged=lr == 4.0 and seed == 1
            )
    c = choose(s, "BNP", results)
    assert c.lr == 0.05 and c.diverged[4.0] == 1 and c.test == [0.995, 0.995]


def test_the_bn_variant_normalizes_the_decoder_only_and_every_network_reconstructs_28x28() -> None:
    assert [type(m).__name__ for m in autoencoder("BN") if "BatchNorm" in type(m).__name__] == ["BatchNorm2d"] * 2
    assert not any("BatchNorm" in type(m).__name__ for m in autoencoder("BNP"))
    assert autoencoder("vanilla")(torch.rand(2, 1, 28, 28)).shape == (2, 1, 28, 28)


def test_the_section_names_every_method_and_its_verdicts() -> None:
    s = DecoderSetting(batch=4, epochs=1, seeds=1)
    results = {
        DecoderJob(s, m, lr, 0): DecoderRun([0.5], [0.01 * (i + 1)], diverged=m == "vanilla" and lr > 1.0)
        for i, m in enumerate(METHODS)
        for lr in s.rates(m)
    }
    text = "\n".join(section((s,), results, "note"))
    for m in METHODS:
        assert f"| {m} |" in text
    assert "| 4, 1000 | vanilla | 0.05 (grid edge) | 10.00 [10.00–10.00] | 2 (1/1), 4 (1/1) |" in text
    assert "- Batch 4: lowest test error vanilla; BNP's best form not below vanilla SGD (30.00 vs 10.00)" in text


def test_the_evaluation_steps_are_where_training_evaluates() -> None:
    assert DecoderSetting(batch=64, epochs=6, evals=3, max_steps=12).eval_steps == [0, 4, 8, 12]
    assert DecoderSetting(batch=64, epochs=6, evals=5, max_steps=12).eval_steps == [0, 2, 4, 6, 8, 10, 12]
    assert DecoderSetting(batch=4, epochs=1).eval_steps == [*range(0, 1001, 100)]  # 4,000 digits: 1,000 steps


def test_the_figure_draws_each_methods_curves_at_its_chosen_rate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = DecoderSetting(batch=64, epochs=6, seeds=2, evals=3, max_steps=12)
    results = {  # every rate but the second diverges in seed 1 after two evaluations; the second's errors span decades
        DecoderJob(s, m, lr, seed): DecoderRun(
            [0.1, 0.01, 0.001, 0.0005 * (seed + 1)] if lr == s.rates(m)[1] else [0.2, 0.3],
            [0.0] * 4,
            diverged=lr != s.rates(m)[1] and seed == 1,
        )
        for m in METHODS
        for lr in s.rates(m)
        for seed in range(2)
    }
    figures: list[Any] = []
    monkeypatch.setattr("benchmarks.reproduce.plotting.save_png", lambda fig, path: figures.append(fig))
    plot((s,), results, tmp_path / "decoder.png")
    (ax,) = figures[0].axes
    assert [line.get_label() for line in ax.lines] == [f"{m} (lr {s.rates(m)[1]:g})" for m in METHODS]
    for line in ax.lines:  # the mean over the seeds
        assert list(line.get_xdata()) == [0, 4, 8, 12]
        assert list(line.get_ydata()) == pytest.approx([0.1, 0.01, 0.001, 0.00075])
    assert ax.get_yscale() == "log" and ax.get_xlabel() == "training step" and ax.get_legend() is not None


@pytest.mark.slow
def test_quick_section_alone_rewrites_only_its_section(tmp_path: Path) -> None:
    (tmp_path / "RESULTS.md").write_text(REPORT)
    proc = run_python(
        "-m", "benchmarks.reproduce", "--sections", "decoder", "--quick", "--out", str(tmp_path),
        "--workers", "2", "--seeds", "1",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (tmp_path / "RESULTS.md").read_text()
    assert text.startswith("# Report\n\n## 7. Transformers") and text.rstrip().endswith("Training runs: 3.")
    assert HEADER in text and "QUICK MODE" in text and "| 64, 12 | BNP-col |" in text
    figure = tmp_path / "results" / "decoder.png"
    assert figure.stat().st_size > 1000
    lines = extract(text)
    assert lines[2].endswith("min.") and lines[3:5] == ["", "![decoder](results/decoder.png)"]  # right after the note
    figure.unlink()  # --rerender draws it again from the saved runs, at their settings (no --quick, --seeds given)
    proc = run_python(
        "-m", "benchmarks.reproduce", "--sections", "decoder", "--rerender", "--out", str(tmp_path), "--workers", "2",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert figure.stat().st_size > 1000 and (tmp_path / "RESULTS.md").read_text() == text
