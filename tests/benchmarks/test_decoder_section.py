"""§9 of RESULTS.md: the transposed-convolution decoder, regenerated alone with ``--sections decoder``."""

from __future__ import annotations

from pathlib import Path

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
