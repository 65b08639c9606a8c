"""docs/lightning_loops.md (the README's "Manual optimization" and "Lightning Fabric" sections): every Python
snippet runs as written, in a fresh interpreter, as a user pastes it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "lightning_loops.md").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("code", re.findall(r"^```python\n(.*?)^```", DOC, flags=re.M | re.S), ids=["manual", "fabric"])
def test_snippet_runs_as_written(code: str, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
