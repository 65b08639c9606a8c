"""Sphinx configuration of the lightning_bnp documentation (``make docs``: a strict build, warnings are errors).

Sphinx, not MkDocs: the package's docstrings are Google style with reStructuredText inside (``.. math::`` blocks,
``Example::`` literal blocks, ``:class:`` roles), which napoleon + autodoc render as written; the guides are Markdown
(MyST), the same files the snippet tests run. No intersphinx: the build reads nothing from the network.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the worktree's lightning_bnp, as the tests import it

import lightning_bnp  # noqa: E402

project = "lightning_bnp"
author = "lightning_bnp developers"
copyright = "the lightning_bnp developers, Apache-2.0"
release = version = lightning_bnp.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 4  # [text](page.md#a-heading) links resolve, and a broken one fails the build

# API reference: the public import path (lightning_bnp.BNPPreconditioner), not the private module that defines it
# members are listed per directive (docs/api/*.rst): the callbacks' Lightning hooks are not API a user calls
autodoc_default_options = {"member-order": "bysource"}
autodoc_typehints = "description"  # types beside each documented argument, not in a long signature
autodoc_typehints_description_target = "documented_params"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True  # defaults as written in the signature (list(DEFAULT_LAYER_TYPES), not its value)
autodoc_class_signature = "mixed"  # the constructor's signature in the class header, its arguments in the class's Args
add_module_names = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

nitpicky = True  # a reference that resolves to nothing is a warning, so an error
nitpick_ignore_regex = [
    # external names (no intersphinx: no network at build time)
    (
        r"py:.*",
        r"(torch|lightning|typing|typing_extensions|collections|contextlib|jsonargparse|numpy|builtins|abc)"
        r"(\..*)?",
    ),
    (r"py:class", r"(Tensor|Optimizer|Module|Callback|Trainer|LightningModule|Literal|Optional|Union|Any|Callable)"),
    (r"py:class", r"(Iterator|Iterable|Mapping|Sequence|Generator|Path|pl\..*|nn\..*|optional|NoneType)"),
]

html_theme = "furo"
html_title = f"lightning_bnp {release}"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_theme_options = {"navigation_with_keys": True}

# `|λ|` (an absolute value) in a docstring would be read as a substitution reference
rst_prolog = ".. |λ| unicode:: U+007C U+03BB U+007C\n"


# --- references by public path --------------------------------------------------------------------------------------
# The docstrings name objects by the module that defines them (``lightning_bnp.core.kinds.register_layer_kind``); the
# reference documents them by their public path (``lightning_bnp.register_layer_kind``), so a private module can move
# without breaking a link. A reference to a name that no public path documents (an internal helper such as
# ``StepTransform``) renders as code without a link, but only if that name exists in the package: a reference to a
# name that exists nowhere stays unresolved, which the strict build turns into an error.


def _package_names() -> set[str]:
    import importlib
    import inspect
    import pkgutil
    import re

    names: set[str] = set()
    for info in pkgutil.walk_packages(lightning_bnp.__path__, "lightning_bnp."):
        module = importlib.import_module(info.name)
        names.add(info.name)
        for name, value in vars(module).items():
            names.update({name, f"{info.name}.{name}"})
            if inspect.isclass(value) and value.__module__ == info.name:
                assigned = re.findall(r"self\.(\w+)\s*[:=]", inspect.getsource(value))  # instance attributes
                for attribute in [*vars(value), *getattr(value, "__annotations__", {}), *assigned]:
                    names.update({f"{name}.{attribute}", f"{info.name}.{name}.{attribute}", attribute})
    return names


def _public_target(target: str) -> str | None:
    import lightning_bnp.core as core

    parts = target.split(".")
    for i, part in enumerate(parts):
        rest = ".".join(parts[i:])
        if part in lightning_bnp.__all__:
            return f"lightning_bnp.{rest}"
        if part in core.__all__:
            return f"lightning_bnp.core.{rest}"
    return None


_KNOWN: set[str] = set()


def _resolve_public(app, env, node, contnode):  # type: ignore[no-untyped-def]
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "")
    public = _public_target(target)
    if public is not None and public != target:
        domain = env.get_domain("py")
        found = domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], public, node, contnode)
        if found is not None:
            return found
    if not _KNOWN:
        _KNOWN.update(_package_names())
    if target.lstrip("~.") in _KNOWN:
        return contnode  # an internal name: code, no link
    return None


_ORIGINAL: dict[str, list[str]] = {}


def _keep_attribute_docstring(app, what, name, obj, options, lines) -> None:  # type: ignore[no-untyped-def]
    if what in ("attribute", "property"):
        _ORIGINAL[name] = list(lines)


def _attribute_docstrings_are_prose(app, what, name, obj, options, lines) -> None:  # type: ignore[no-untyped-def]
    # napoleon reads "text: more text" on the first line of an attribute's or property's docstring as "type:
    # description"; here that first line is prose ("Whether a step pools ...: ``sync_statistics`` ..."), and the type
    # comes from the annotation: where napoleon made a "type" of several words, the docstring stays as written
    if name in _ORIGINAL and any(line.startswith(":type: ") and " " in line[7:].strip() for line in lines):
        lines[:] = _ORIGINAL[name]


def setup(app):  # type: ignore[no-untyped-def]
    app.connect("missing-reference", _resolve_public)
    app.connect("autodoc-process-docstring", _keep_attribute_docstring, priority=100)  # before napoleon (500)
    app.connect("autodoc-process-docstring", _attribute_docstrings_are_prose, priority=900)  # after it
