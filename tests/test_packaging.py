"""The distribution: one version, an SPDX licence with its text, and the PEP 561 marker in the wheel."""

from __future__ import annotations

import importlib.metadata
import re
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
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(ROOT),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
        ],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("lightning_bnp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "lightning_bnp/py.typed" in names
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names), names
