"""lightning_bnp.callbacks uses only public names of lightning_bnp.core (issue 34; DESIGN §1: the callbacks are
thin adapters over the core, which its owners may rearrange behind its public names)."""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_bnp.callbacks
import lightning_bnp.core


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_names(package: Path) -> set[str]:
    """Every private name a package defines: functions, classes, module globals and attributes it assigns."""
    names: set[str] = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {name for name in names if _private(name)}


def _uses_of_core_private_names(source: str, core_private: set[str]) -> list[str]:
    """Imports of private core modules or names, and reads of attributes named like a private name of the core
    on anything but ``self`` (a callback's own ``self._warned`` is its own). ``core_private`` leaves out the names
    the callbacks define themselves (``self._bnp._attach`` is BatchNormPreconditioning's), so a read of one of
    those on a core object would go unseen: the price of a check that does not know the receiver's type."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_bnp.core"):
            module = node.module or ""
            found += [f"from {module} import {alias.name}" for alias in node.names if _private(alias.name)]
            if any(_private(part) for part in module.split(".")):
                found.append(f"from {module}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("lightning_bnp.core") and any(map(_private, alias.name.split("."))):
                    found.append(f"import {alias.name}")
        elif isinstance(node, ast.Attribute) and node.attr in core_private:
            if not (isinstance(node.value, ast.Name) and node.value.id == "self"):
                found.append(f"line {node.lineno}: .{node.attr}")
    return found


def test_callbacks_import_and_read_no_private_name_of_the_core() -> None:
    callbacks = Path(lightning_bnp.callbacks.__file__).parent
    core_private = _private_names(Path(lightning_bnp.core.__file__).parent) - _private_names(callbacks)
    assert core_private  # the scan sees the core
    found = {
        path.name: uses
        for path in sorted(callbacks.glob("*.py"))
        if (uses := _uses_of_core_private_names(path.read_text(), core_private))
    }
    assert not found, found


def test_the_check_finds_private_imports_and_reads() -> None:
    source = (
        "from lightning_bnp.core.preconditioner import _hidden\n"
        "from lightning_bnp.core._impl import public\n"
        "import lightning_bnp.core._impl\n"
        "x = pre._layers\n"
        "y = self._layers\n"
    )
    assert _uses_of_core_private_names(source, {"_layers"}) == [
        "from lightning_bnp.core.preconditioner import _hidden",
        "from lightning_bnp.core._impl",
        "import lightning_bnp.core._impl",
        "line 4: ._layers",
    ]
