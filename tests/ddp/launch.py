"""Run a DDP worker module (``python -m tests.ddp.<worker>``) as a subprocess and read back the
per-rank state files it wrote (``rank*.pt`` in ``out``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]


def run_worker(worker: str, out: Path, *args: str) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", f"tests.ddp.{worker}", "--out", str(out), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [torch.load(path, weights_only=False) for path in sorted(out.glob("rank*.pt"))]
