"""The package as a user installs it: ``python -m build`` makes an sdist and a wheel that pass ``twine check``, and the
README's examples run with the installed wheel alone, in a folder where the repository is not importable.

Nothing is downloaded: the build runs without isolation (setuptools of this environment), and the wheel is installed
with ``--no-deps --no-index`` into a fresh target folder; torch, Lightning and the other dependencies come from this
environment's site-packages, which an installed user has too. ``PYTHONPATH`` puts the target first, so
``lightning_bnp`` is the wheel's (the snippet checks it) and ``example_projects`` (not in the wheel) is not there."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.test_docs import blocks

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # built from a copy of what the distribution needs: setuptools writes build/ and *.egg-info beside the sources
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    shutil.copytree(ROOT / "lightning_bnp", source / "lightning_bnp", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    build = [sys.executable, "-m", "build", "--no-isolation", "--sdist", "--wheel", "--outdir", str(tmp / "dist")]
    done = subprocess.run([*build, str(source)], capture_output=True, text=True, cwd=tmp, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return tmp / "dist"


def test_sdist_and_wheel_pass_twine_check(dist: Path) -> None:
    files = sorted(str(p) for p in dist.iterdir())
    assert sorted(Path(f).suffix for f in files) == [".gz", ".whl"], files
    done = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *files], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_wheel_ships_the_package_py_typed_and_the_license(dist: Path) -> None:
    (wheel,) = dist.glob("lightning_bnp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "lightning_bnp/py.typed" in names and "lightning_bnp/core/preconditioner.py" in names
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names), names
    assert not any(name.startswith(("example_projects/", "benchmarks/", "tests/")) for name in names)
    (sdist,) = dist.glob("lightning_bnp-*.tar.gz")
    assert any(name.endswith("/lightning_bnp/py.typed") for name in tarfile.open(sdist).getnames())


@pytest.mark.slow
def test_readme_examples_run_with_the_installed_wheel_alone(dist: Path, tmp_path: Path) -> None:
    (wheel,) = dist.glob("lightning_bnp-*.whl")
    site = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)]
    subprocess.run([*install, "-q"], check=True, capture_output=True)
    work = tmp_path / "work"
    work.mkdir()
    check = (
        "import importlib.util, lightning_bnp\n"
        f"assert lightning_bnp.__file__.startswith({str(site)!r}), lightning_bnp.__file__\n"
        "assert importlib.util.find_spec('example_projects') is None\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    snippets = blocks("python", [ROOT / "README.md"])
    assert len(snippets) >= 2
    for where, code in snippets:
        done = subprocess.run(
            [sys.executable, "-c", check + code], cwd=work, env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, f"{where}\n{done.stderr[-3000:]}"
