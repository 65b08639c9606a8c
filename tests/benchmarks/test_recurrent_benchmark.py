"""``benchmarks.recurrent`` (the character-level LSTM / GRU section): its text, its verdict rule, and the quick run
end to end (slow), which writes its section into an existing report without touching the others."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import recurrent
from benchmarks.recurrent import HEADER, Job, corpus, section


def test_the_text_is_the_same_prose_every_call() -> None:
    text = corpus()
    assert text == corpus() and len(text) > 50_000 and "Return" in text


def _run(method: str, lr: float, seed: int, valid: float, test: float, diverged: bool = False):
    return (Job("LSTM", 32, 10, method, lr, seed, False), valid, test, diverged, 1.0)


def test_the_rate_is_chosen_on_validation_and_the_verdict_needs_a_gap_beyond_the_spread() -> None:
    results = [
        _run("vanilla", 0.1, 0, 3.0, 3.0),
        _run("vanilla", 0.1, 1, 3.1, 3.2),
        _run("vanilla", 1.0, 0, 2.5, 9.0),  # best on validation: its test bpc is the one reported
        _run("vanilla", 1.0, 1, 2.6, 9.1),
        _run("BNP", 1.0, 0, 2.0, 2.0),
        _run("BNP", 1.0, 1, 2.1, 2.05),
        _run("BNP", 3.0, 0, float("inf"), float("inf"), diverged=True),  # a diverged seed: never chosen
        _run("BNP", 3.0, 1, 1.0, 1.0),
        _run("Adam", 0.01, 0, 2.0, 2.0),
        _run("Adam", 0.01, 1, 2.1, 2.1),
    ]
    lines = section(results, 2, "note")
    assert "| LSTM | 32 | 10 | vanilla | 1 | 9.050 [9.000–9.100] | 0/2 | 1 |" in lines
    assert "| LSTM | 32 | 10 | BNP | 1 | 2.025 [2.000–2.050] | 0/2 | 1 |" in lines
    assert "- LSTM, batch 32: BNP is ahead of vanilla." in lines
    assert "- LSTM, batch 32: BNP is level with Adam." in lines  # 0.075 apart, spread 0.1


@pytest.mark.slow
def test_the_quick_run_replaces_only_its_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(recurrent, "SETTINGS", (("GRU", 2, 3),))
    (tmp_path / "RESULTS.md").write_text(f"# Report\n\n## 7. Before\n\nkept\n\n{HEADER}\n\nold\n\n---\nsummary\n")
    recurrent.main(["--quick", "--out", str(tmp_path), "--workers", "1"])
    text = (tmp_path / "RESULTS.md").read_text()
    assert "old" not in text and "kept" in text and text.count(HEADER) == 1 and text.index(HEADER) < text.index("---")
    assert "| GRU | 2 | 12 | BNP |" in text and "QUICK MODE" in text
    assert "![recurrent](results/recurrent.png)" in text and (tmp_path / "results" / "recurrent.png").stat().st_size
    # the saved runs give the same section again without training
    (tmp_path / "RESULTS.md").write_text(f"# Report\n\n{HEADER}\n\nold\n\n---\nsummary\n")
    recurrent.main(["--quick", "--out", str(tmp_path), "--rerender"])
    assert "| GRU | 2 | 12 | BNP |" in (tmp_path / "RESULTS.md").read_text()


def test_the_section_is_extracted_for_the_reproduction_to_keep() -> None:
    """``benchmarks.reproduce`` rewrites RESULTS.md and splices §8 back from the old report (as it keeps §7)."""
    report = f"# Report\n\n## 7. Transformers\n\nt\n\n{HEADER}\n\n| a |\n\n---\nsummary\n"
    assert recurrent.extract(report) == [HEADER, "", "| a |"]
    assert recurrent.extract("# Report\n") == []
