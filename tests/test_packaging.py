"""The distribution's metadata: one version, an SPDX licence with its text (the wheel itself: tests/test_wheel.py)."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import lightning_bnp

ROOT = Path(__file__).resolve().parents[1]


def test_version_has_one_source() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()  # (tomllib needs Python 3.11; the package supports 3.10)
    assert re.search(r'^dynamic = \["version"\]', pyproject, re.M) and not re.search(r'^version = "', pyproject, re.M)
    assert importlib.metadata.version("lightning-bnp") == lightning_bnp.__version__


def test_license_is_an_spdx_expression_with_its_text() -> None:
    assert importlib.metadata.metadata("lightning-bnp")["License-Expression"] == "Apache-2.0"
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")


# the wheel and the sdist themselves: tests/test_wheel.py
