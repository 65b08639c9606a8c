"""Linears that their parent both calls and uses through their weight (issue 37, item 6).

A parent whose ``forward`` calls ``self.lin(x)`` and also passes ``self.lin.weight`` on (``F.linear(y,
self.lin.weight, self.lin.bias)``) feeds the weight's gradient with two inputs; a forward hook on the Linear sees
only the first, and P built from it alone is off (μ, σ² and N of one input). Such a Linear is managed as the parent's
``F.linear`` user instead (:class:`~lightning_bnp.core.attention.FunctionalLinearKind`, as
:func:`~lightning_bnp.core.attention.register_functional_linear` would make it): every ``F.linear`` call with its
weight while the parent runs counts — the direct calls too, since ``nn.Linear.forward`` is one — so both inputs are
pooled as one layer called twice. Its layer name is unchanged. Read from the source of the parent class's
``forward``, once per class; calls of the Linear made outside its parent's forward are then not counted (the
step names the layer if it has a gradient and no statistics).
"""

from __future__ import annotations

import inspect
import re
import textwrap
import weakref

from torch import nn

from lightning_bnp.core.attention import FunctionalLinearKind
from lightning_bnp.core.kinds import LayerKind, LinearKind

__all__ = ["count_both_uses"]

_WEIGHT_READ = re.compile(r"\bself\.([A-Za-z_]\w*)\.weight\b")
_CALLED_AND_READ: weakref.WeakKeyDictionary[type, frozenset[str]] = weakref.WeakKeyDictionary()


def _called_and_read(parent_type: type[nn.Module]) -> frozenset[str]:
    """Attributes ``a`` whose ``self.a.weight`` the source of ``parent_type.forward`` reads and that it also calls,
    ``self.a(...)``; empty when the source cannot be read."""
    found = _CALLED_AND_READ.get(parent_type)
    if found is None:
        try:
            source = textwrap.dedent(inspect.getsource(parent_type.forward))
        except (OSError, TypeError):
            source = ""
        read = set(_WEIGHT_READ.findall(source))
        found = frozenset(a for a in read if re.search(rf"\bself\.{a}\s*\(", source))
        _CALLED_AND_READ[parent_type] = found
    return found


def count_both_uses(
    model: nn.Module, chosen: dict[str, tuple[nn.Module, LayerKind]]
) -> dict[str, tuple[nn.Module, LayerKind]]:
    """``chosen`` (layer name → (module, kind)) with every plain ``nn.Linear`` that its parent both calls and uses
    through its weight managed as that parent's ``F.linear`` user, under the same layer name."""
    result = dict(chosen)
    for parent_name, parent in model.named_modules():
        for attr in sorted(_called_and_read(type(parent))):
            child = parent._modules.get(attr)
            name = f"{parent_name}.{attr}" if parent_name else attr
            entry = chosen.get(name)
            if entry is None or entry[0] is not child or type(entry[1]) is not LinearKind:
                continue
            result[name] = (parent, FunctionalLinearKind(type(parent), attr))
    return result
