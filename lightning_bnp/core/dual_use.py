"""Linears that their parent both calls and uses through their weight (issue 37, item 6).

A parent whose ``forward`` calls ``self.lin(x)`` and also passes ``self.lin.weight`` on (``F.linear(y,
self.lin.weight, self.lin.bias)``) feeds the weight's gradient with two inputs; a forward hook on the Linear sees
only the first, and P built from it alone is off (μ, σ² and N of one input). Such a Linear is managed as the parent's
``F.linear`` user instead (:class:`~lightning_bnp.core.attention.FunctionalLinearKind`, as
:func:`~lightning_bnp.core.attention.register_functional_linear` would make it): every ``F.linear`` call with its
weight while the parent runs counts — the direct calls too, since ``nn.Linear.forward`` is one — so both inputs are
pooled as one layer called twice. Its layer name is unchanged. Read from the source of the parent class's
``forward``, once per class: a ``linear(...)`` call there with ``self.<child>.weight`` among its arguments (a weight
read for anything else — a penalty, its dtype — is no second input, and the Linear keeps its own hook). Calls of the
Linear made outside its parent's forward are then not counted (the step names the layer if it has a gradient and no
statistics); a weight passed on to a helper that calls ``F.linear`` is not seen.
"""

from __future__ import annotations

import re
import weakref

from torch import nn

from lightning_bnp.core.attention import FunctionalLinearKind, forward_source
from lightning_bnp.core.kinds import LayerKind, LinearKind

__all__ = ["count_both_uses"]

_LINEAR_CALL = re.compile(r"\blinear\s*\(")  # F.linear(, torch.nn.functional.linear(, linear(
_WEIGHT_READ = re.compile(r"\bself\.([A-Za-z_]\w*)\.weight\b")
_CALLED_AND_PASSED: weakref.WeakKeyDictionary[type, frozenset[str]] = weakref.WeakKeyDictionary()


def _arguments(source: str, start: int) -> str:
    """The text between the parenthesis opened just before ``start`` and the one that closes it."""
    depth = 1
    for end in range(start, len(source)):
        depth += {"(": 1, ")": -1}.get(source[end], 0)
        if depth == 0:
            return source[start:end]
    return source[start:]


def _called_and_passed(parent_type: type[nn.Module]) -> frozenset[str]:
    """Attributes ``a`` that the source of ``parent_type.forward`` calls, ``self.a(...)``, and whose weight it passes
    to a ``linear(...)`` call (``F.linear(y, self.a.weight, self.a.bias)``); empty when the source cannot be read.
    A weight read for anything else (a penalty, its dtype) is not a second input."""
    found = _CALLED_AND_PASSED.get(parent_type)
    if found is None:
        source = forward_source(parent_type)
        passed = {
            a for call in _LINEAR_CALL.finditer(source) for a in _WEIGHT_READ.findall(_arguments(source, call.end()))
        }
        found = frozenset(a for a in passed if re.search(rf"\bself\.{a}\s*\(", source))
        _CALLED_AND_PASSED[parent_type] = found
    return found


def count_both_uses(
    model: nn.Module, chosen: dict[str, tuple[nn.Module, LayerKind]]
) -> dict[str, tuple[nn.Module, LayerKind]]:
    """``chosen`` (layer name → (module, kind)) with every plain ``nn.Linear`` that its parent both calls and passes
    to ``F.linear`` managed as that parent's ``F.linear`` user, under the same layer name."""
    result = dict(chosen)
    for parent_name, parent in model.named_modules():
        for attr in sorted(_called_and_passed(type(parent))):
            child = parent._modules.get(attr)
            name = f"{parent_name}.{attr}" if parent_name else attr
            entry = chosen.get(name)
            if entry is None or entry[0] is not child or type(entry[1]) is not LinearKind:
                continue
            result[name] = (parent, FunctionalLinearKind(type(parent), attr))
    return result
