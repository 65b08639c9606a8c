"""The README and the documentation as a user reads them: every Python snippet runs as written, every YAML snippet's
callbacks build from their ``init_args``, every ``.venv/bin/python -m`` command runs (example-project fits as
``fast_dev_run``, benchmarks and other long jobs as ``--help``: they are benchmarks, not tests), the site builds
strictly, and the API reference has an entry for every public name.

One mechanism for the README and every page under ``docs/``: the snippets are the fenced blocks of the Markdown files
(indented ones inside list items included). Python snippets run in a new process in an empty folder, as a user pastes
them (forked from an interpreter that has imported torch and Lightning and run nothing: ``warm_python.py``). A bash
block's commands run in order in one folder (a config that ``--print_config > file.yaml`` wrote is there for the next
command); a command in running text runs alone. The ``-m`` commands run in this process through ``runpy`` — what
``python -m`` itself does — with the command's arguments in ``sys.argv`` and the working directory that folder: the same
code path without the seconds a new interpreter spends importing torch and Lightning. A fit on several devices
(``--trainer.devices 2``) runs as a new process (``warm_python.py``), as the user runs it: Lightning starts the other
ranks by running the command again, and its process group must not outlive the command in this process. A command with a
``<placeholder>`` (a checkpoint the user's own run wrote) runs as ``--help``. Set-up commands (``make``, ``pip``,
``tensorboard``) are what the suite itself runs under."""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import runpy
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import lightning_bnp
import lightning_bnp.core
from tests.warm_python import run_python

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^( *)```(\w+)\n(.*?)^\1```", re.M | re.S)
COMMAND = ".venv/bin/python -m "


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def blocks(language: str, pages: list[Path] = PAGES) -> list[tuple[str, str]]:
    """``(where, code)`` of every fenced block in ``language``; ``where`` is ``page:line``. A block that an earlier
    page holds as well (the README's examples in "Getting started") is listed once."""
    found: list[tuple[str, str]] = []
    for page in pages:
        text = page.read_text()
        for match in FENCE.finditer(text):
            if match.group(2) == language:
                line = text.count("\n", 0, match.start()) + 1
                code = textwrap.dedent(match.group(3))
                if all(code != seen for _, seen in found):
                    found.append((f"{_name(page)}:{line}", code))
    return found


def _as_run(command: str) -> tuple[str, ...]:
    """What a command runs here: an example project's fit as itself (plus ``FAST_FIT``), anything else ``--help``."""
    command, _, redirect = command.partition(" > ")
    args = shlex.split(re.sub(r"\[[^\]]*\]", "", command))  # drop usage brackets: [--lam λ]
    if not (args[2].startswith("example_projects.") and "fit" in args and not any("<" in a for a in args)):
        args = [*args[:3], "--help"]
    return (*args, *(["> " + redirect] if redirect else []))


def command_groups() -> list[tuple[str, list[tuple[str, ...]]]]:
    """Every ``.venv/bin/python -m`` command as it runs here: those of one bash block as one group, in order; each in
    running text alone. Continuation lines are joined, comments dropped, a module pattern
    (``example_projects.<project>``) is not a command, and what runs the same (``--help``) runs once."""
    groups: dict[tuple[tuple[str, ...], ...], str] = {}
    for page in PAGES:
        text = FENCE.sub("", page.read_text())
        for span in re.findall(r"`(\.venv/bin/python -m [^`]+)`", text):
            groups.setdefault((_as_run(re.sub(r"\s+", " ", span).strip()),), _name(page))
    for where, block in blocks("bash"):
        lines = [line.split(" #")[0].strip() for line in block.replace("\\\n", " ").splitlines()]
        runs = tuple(dict.fromkeys(_as_run(re.sub(r"\s+", " ", c)) for c in lines if c.startswith(COMMAND)))
        if runs:
            groups.setdefault(runs, where)
    return [(where, list(runs)) for runs, where in groups.items() if not any("<" in run[2] for run in runs)]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.mark.slow
@pytest.mark.parametrize(("where", "code"), blocks("python"), ids=[w for w, _ in blocks("python")])
def test_python_snippet_runs_as_written(where: str, code: str, tmp_path: Path) -> None:
    if code.startswith("# needs a CUDA device") and not torch.cuda.is_available():
        pytest.skip("a snippet that needs a CUDA device (it runs on the GPU machine)")
    done = run_python("-c", code, cwd=tmp_path, env=_env())
    assert done.returncode == 0, f"{where}\n{done.stderr[-3000:]}"


def _class_paths(node: Any) -> list[dict[str, Any]]:
    if isinstance(node, dict):
        found = [node] if "class_path" in node else []
        return found + [c for value in node.values() for c in _class_paths(value)]
    if isinstance(node, list):
        return [c for value in node for c in _class_paths(value)]
    return []


@pytest.mark.parametrize(("where", "text"), blocks("yaml"), ids=[w for w, _ in blocks("yaml")])
def test_yaml_snippet_callbacks_build(where: str, text: str) -> None:
    for entry in _class_paths(yaml.safe_load(text)):
        module, _, name = entry["class_path"].rpartition(".")
        getattr(importlib.import_module(module), name)(**entry.get("init_args", {}))


FAST_FIT = ["--trainer.fast_dev_run=true", "--trainer.accelerator=cpu"]


def _run(run: tuple[str, ...], folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    redirect = run[-1][2:] if run[-1].startswith("> ") else None
    args = list(run[:-1] if redirect else run)
    module = args[2]
    if args[-1] != "--help":  # a fit: its runs/ and data/ go to the folder; a config the group wrote is there
        args = [a if not a.endswith(".yaml") or (folder / a).exists() else str(ROOT / a) for a in args] + FAST_FIT
    if "--trainer.devices" in args and args[args.index("--trainer.devices") + 1] != "1":
        done = run_python(*args[1:], cwd=folder, env=_env())
        assert done.returncode == 0, f"{run}: exit status {done.returncode}\n{done.stderr[-3000:]}"
        return
    monkeypatch.chdir(folder)
    monkeypatch.setattr(sys, "argv", [module, *args[3:]])
    with open(folder / redirect, "w") if redirect else contextlib.nullcontext() as out:
        with contextlib.redirect_stdout(out) if out else contextlib.nullcontext():
            try:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            except SystemExit as stop:  # argparse's --help, or a CLI's exit
                assert stop.code in (0, None), f"{run}: exit status {stop.code}"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("where", "runs"), command_groups(), ids=[" && ".join(" ".join(r[2:]) for r in g) for _, g in command_groups()]
)
def test_commands_run(where: str, runs: list[tuple[str, ...]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for run in runs:
        _run(run, tmp_path, monkeypatch)


def test_every_page_is_found_and_the_readme_is_a_landing_page() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
    assert any(_name(p) == "docs/getting_started.md" for p in PAGES)
    assert blocks("python", [ROOT / "docs" / "weight_conditioning.md"])[-1][1].startswith("import ")  # indented block


def test_api_reference_names_every_public_name() -> None:
    api = "\n".join(p.read_text() for p in (ROOT / "docs" / "api").glob("*.rst"))
    documented = set(re.findall(r"^\.\. auto(?:class|function):: (\w+)", api, re.M))
    assert set(lightning_bnp.__all__) | set(lightning_bnp.core.__all__) <= documented


def test_no_internal_issue_numbers_in_user_facing_text() -> None:
    for page in [*PAGES, ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "RESULTS.md"]:
        found = re.findall(r".{0,40}\bissues? \d+.{0,20}", page.read_text(), re.I)
        assert not found, (_name(page), found)


@pytest.mark.slow
def test_docs_build_strictly(tmp_path: Path) -> None:
    # `make docs`, the target a user runs: warnings are errors (a broken link, a missing reference, a docstring that
    # does not parse); `-o` keeps make from refreshing the environment this suite runs in
    done = subprocess.run(
        ["make", "-s", "-o", ".venv/.installed", "docs", f"DOCS_OUT={tmp_path / 'html'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "html" / "api" / "callbacks.html").is_file()
