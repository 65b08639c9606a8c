"""The distribution: one version, an SPDX licence with its text, and the PEP 561 marker in the wheel."""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
import zipfile
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


def test_wheel_ships_py_typed_and_the_license(tmp_path: Path) -> None:
    # built from a copy of what the wheel needs: setuptools writes build/ beside the sources it builds
    source = tmp_path / "source"
    shutil.copytree(ROOT / "lightning_bnp", source / "lightning_bnp", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    pip_wheel = [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run([*pip_wheel, "-w", str(tmp_path)], check=True, cwd=tmp_path)
    (wheel,) = tmp_path.glob("lightning_bnp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "lightning_bnp/py.typed" in names
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names), names
