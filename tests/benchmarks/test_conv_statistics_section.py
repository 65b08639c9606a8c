"""§6 of RESULTS.md (issue 18 §1): regenerated alone with ``--sections conv_statistics``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from benchmarks.reproduce.conv_statistics import HEADER, splice, unfold_moments
from lightning_bnp.core.moments import column_moments_of_input
from tests.warm_python import run_python

ROOT = Path(__file__).resolve().parents[2]
REPORT = "# Report\n\n## 5. Before\n\ntext\n\n---\nTraining runs: 3.\n"


def test_splice_inserts_before_the_run_summary_then_replaces_in_place() -> None:
    first = splice(REPORT, [f"{HEADER}\n", "old"])
    assert first.index("## 5. Before") < first.index(HEADER) < first.index("---\nTraining runs")
    second = splice(first + "\n## 7. After\n", [f"{HEADER}\n", "new"])
    assert "old" not in second and second.count(HEADER) == 1
    assert second.index(HEADER) < second.index("## 7. After") and "## 5. Before" in second


def test_the_unfold_comparison_computes_the_same_statistics() -> None:
    """The hook-cost table compares two computations of one thing."""
    conv = nn.Conv2d(3, 4, 3, padding=1, stride=2).double()
    x = torch.randn(5, 3, 9, 8, dtype=torch.float64) + 2
    a, b = column_moments_of_input(conv, x, conv(x)), unfold_moments(conv, x, conv(x))
    assert a.rows == b.rows
    torch.testing.assert_close(a.mean, b.mean)
    torch.testing.assert_close(a.var, b.var)


@pytest.mark.slow
def test_quick_section_alone_rewrites_only_its_section(tmp_path: Path) -> None:
    # one seed and one torch thread, as in test_reproduce.py: this checks the section's text, not its numbers
    (tmp_path / "RESULTS.md").write_text(REPORT)
    proc = run_python(
        "-m", "benchmarks.reproduce", "--sections", "conv_statistics", "--quick", "--out", str(tmp_path),
        "--workers", "2", "--threads", "1", "--seeds", "1",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (tmp_path / "RESULTS.md").read_text()
    assert text.startswith("# Report\n\n## 5. Before") and text.rstrip().endswith("Training runs: 3.")
    assert HEADER in text and "QUICK MODE" in text and "| CNN-5, batch 2 | 0.01 |" in text
