"""The README as a user reads it (issue 17, items 1 and 2): every Python snippet runs as written, every
YAML snippet's callbacks build from their ``init_args``, and every ``.venv/bin/python -m`` command runs
(example-project fits as ``fast_dev_run``, benchmarks and other long jobs as ``--help``: they are
benchmarks, not tests).

Python snippets run in a fresh interpreter, as a user pastes them. The ``-m`` commands run in this process
through ``runpy`` — what ``python -m`` itself does — with the command's arguments in ``sys.argv`` and the working
directory a fresh folder: the same code path without the seconds a new interpreter spends importing torch and
Lightning (issue 27: the suite's speed). A fit on several devices (``--trainer.devices 2``) runs as a subprocess, as
the user runs it: Lightning starts the other ranks by running the command again, and its process group must not
outlive the command in this process."""

from __future__ import annotations

import importlib
import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, flags=re.M | re.S)


def commands() -> list[str]:
    found = [re.sub(r"\s+", " ", c) for c in re.findall(r"`(\.venv/bin/python -m [^`]+)`", README)]
    found += [line.split("#")[0].strip() for block in blocks("bash") for line in block.splitlines()]
    return sorted({c for c in found if c.startswith(".venv/bin/python -m ")})


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.mark.slow
@pytest.mark.parametrize("code", blocks("python"), ids=lambda c: c.strip().splitlines()[-1][:40])
def test_python_snippet_runs_as_written(code: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]


def _class_paths(node: Any) -> list[dict[str, Any]]:
    if isinstance(node, dict):
        found = [node] if "class_path" in node else []
        return found + [c for value in node.values() for c in _class_paths(value)]
    if isinstance(node, list):
        return [c for value in node for c in _class_paths(value)]
    return []


@pytest.mark.parametrize("text", blocks("yaml"))
def test_yaml_snippet_callbacks_build(text: str) -> None:
    entries = _class_paths(yaml.safe_load(text))
    assert entries
    for entry in entries:
        module, _, name = entry["class_path"].rpartition(".")
        getattr(importlib.import_module(module), name)(**entry.get("init_args", {}))


FAST_FIT = ["--trainer.fast_dev_run=true", "--trainer.accelerator=cpu"]


@pytest.mark.slow
@pytest.mark.parametrize("command", commands())
def test_command_runs(command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = shlex.split(re.sub(r"\[[^\]]*\]", "", command))  # drop usage brackets: [--lam λ]
    module = args[2]
    if module.startswith("example_projects.") and "fit" in args:
        # run in tmp_path (its runs/ and data/ go there), the config path as the README means it: from the root
        args = [str(ROOT / a) if a.endswith(".yaml") else a for a in args] + FAST_FIT
    else:
        args = [*args[:3], "--help"]
    if "--trainer.devices" in args and args[args.index("--trainer.devices") + 1] != "1":
        done = subprocess.run(
            [sys.executable, *args[1:]], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, f"{command}: exit status {done.returncode}\n{done.stderr[-3000:]}"
        return
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [module, *args[3:]])
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:  # argparse's --help, or a CLI's exit
        assert stop.code in (0, None), f"{command}: exit status {stop.code}"
