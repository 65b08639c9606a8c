"""Attention layers: ``nn.MultiheadAttention`` in every form, and Linears whose parent calls ``F.linear`` with
their weight (issue 24, items 1–2).

Two layer kinds (:mod:`lightning_bnp.core.kinds`; the built-in ones are registered by
:mod:`~lightning_bnp.core.builtin_kinds`) and one capture mechanism:

* :class:`MHAProjectionKind` ×3 — the q, k and v projections of a ``nn.MultiheadAttention``: the row blocks
  ``in_proj_weight[0:E]``, ``[E:2E]``, ``[2E:3E]`` (or the separate ``q_proj_weight``/``k_proj_weight``/
  ``v_proj_weight`` when ``kdim``/``vdim`` differ from ``embed_dim``) and the matching slices of
  ``in_proj_bias``. Each block's input is the MHA forward's ``query``, ``key`` or ``value`` argument (layout
  ``batch_first`` either way: a linear layer's statistics are per feature over every leading dimension). In
  self-attention the three are one tensor, reduced once for the three layers (``shared_moments`` in
  :mod:`~lightning_bnp.core.call_hooks`); the step transforms the three row blocks of ``in_proj_weight`` as
  one grouped matrix, each block with its own statistics (:meth:`~LayerKind.row_block`). The layers are named
  ``<mha>.q``, ``<mha>.k``, ``<mha>.v``.
* :class:`FunctionalLinearKind` — a ``nn.Linear`` child that its parent uses through ``F.linear(x,
  child.weight, child.bias)`` instead of calling it, so the child's forward hook never runs: the MHA's
  ``out_proj`` (input: the attention output), torchvision's ``ShiftedWindowAttention.qkv`` and ``.proj``
  (Swin). The layer is named as the child (``<mha>.out_proj``) and takes the child's place: the plain
  ``Linear`` kind leaves a child claimed this way alone (:meth:`~LayerKind.claims`).

Capture (:func:`capturing`): during a training forward of the parent, ``torch.nn.functional.linear`` is
routed through a recorder that keeps ``(input, output)`` of every call whose weight is a watched tensor (by
identity); the forward hook (``always_call``: also after an exception) restores it. Cost: one Python frame per
``F.linear`` call made while a watched parent runs — nothing is recomputed, the input is the very tensor the
projection multiplies (exact). A weight passed in another form (e.g. recomputed by a parametrization of the
child) is not recognised: its layer then warns after the step that its forward never ran.

Under ``torch.compile`` the capture is traced (one graph, ``fullgraph=True`` holds): Dynamo sees the swap of the
module global as a side effect of the traced hooks and inlines ``_recording_linear``. Two more globals are swapped
for the same span, because Dynamo keeps ``F.multi_head_attention_forward`` whole in its graph (the ``F.linear``
inside would never be seen): :data:`_TRACEABLE_MHA`, the same code under another identity, which it inlines, and
``F._check_key_padding_mask``, whose ``torch._check`` messages it cannot trace. The lock is taken in eager only
(Dynamo cannot enter it; a compiled forward applies its swaps as the graph's side effects).

Left as they are: ``bias_k``/``bias_v`` (1-D parameters appended to the projected keys and values, not weight
matrices: not preconditioned), ``add_zero_attn`` (appends zeros after the projections: nothing to precondition),
``static_k``/``static_v``. The MHA fast path (``torch._native_multi_head_attention``) only runs without
gradients, when BNP records nothing.
"""

from __future__ import annotations

import inspect
import re
import sys
import textwrap
import threading
import types
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_bnp.core.kinds import LINEAR_FAMILY, LayerKind, register_layer_kind
from lightning_bnp.core.reparametrization import unsupported, weight_leaf

__all__ = [
    "FunctionalLinearKind",
    "MHAOutProjKind",
    "MHAProjectionKind",
    "capturing",
    "inferred_functional_linears",
    "register_functional_linear",
]

_BLOCKS = ("q", "k", "v")
_INPUTS = ("query", "key", "value")


class MHAProjectionKind(LayerKind):
    """One of the q, k, v projections of ``nn.MultiheadAttention`` (``block`` 0, 1, 2)."""

    family = LINEAR_FAMILY
    module_type = nn.MultiheadAttention
    bias_name = "in_proj_bias"

    def __init__(self, block: int) -> None:
        self.block = block
        self.name = f"MultiheadAttention.{_BLOCKS[block]}"  # type: ignore[misc]
        self.suffix = f".{_BLOCKS[block]}"  # type: ignore[misc]
        self.input_name = _INPUTS[block]  # type: ignore[misc]

    def weight(self, module: nn.Module) -> Tensor:
        if module._qkv_same_embed_dim:
            return module._parameters["in_proj_weight"]  # type: ignore[return-value]
        return module._parameters[f"{_BLOCKS[self.block]}_proj_weight"]  # type: ignore[return-value]

    def _span(self, module: nn.Module) -> slice:
        embed = int(module.embed_dim)  # type: ignore[arg-type]
        return slice(self.block * embed, (self.block + 1) * embed)

    def rows(self, module: nn.Module, weight: Tensor) -> Tensor:
        return weight[self._span(module)] if module._qkv_same_embed_dim else weight

    def bias_rows(self, module: nn.Module, bias: Tensor) -> Tensor:
        return bias[self._span(module)]

    def row_block(self, module: nn.Module) -> tuple[int, int] | None:
        return (self.block, 3) if module._qkv_same_embed_dim else None

    def features(self, module: nn.Module) -> int:
        return int((module.embed_dim, module.kdim, module.vdim)[self.block])  # type: ignore[arg-type]

    fan_in = features

    def input(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return args[self.block] if len(args) > self.block else kwargs.get(self.input_name)

    def token_rows(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], h: Tensor, mask: Tensor
    ) -> Tensor | None:
        """The query's rows: the token mask (in the MHA's layout, (N, L) with ``batch_first``, else (L, N)). The
        key's and value's rows: the MHA's own ``key_padding_mask`` when the call has one (True = padding, or
        −inf in a float mask; (N, S) whatever ``batch_first``), else the token mask."""
        padding = args[3] if len(args) > 3 else kwargs.get("key_padding_mask")
        if self.block == 0 or not isinstance(padding, Tensor):
            return mask if mask.shape == h.shape[:-1] else None
        real = _real_keys(padding, transpose=not module.batch_first and padding.dim() == 2)
        return real if real.shape == h.shape[:-1] else None

    def calls(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> list[tuple[Any, Any]]:
        """``[(input, output)]`` of one forward: the query/key/value and the attention output (whose gradient
        reaches this projection)."""
        out = output[0] if isinstance(output, tuple) else output
        return [(self.input(module, args, kwargs), out)]


class FunctionalLinearKind(LayerKind):
    """A ``nn.Linear`` child (attribute ``child``) of a ``parent_type`` module that calls ``F.linear`` with the
    child's weight: its input is captured from that call (:func:`capturing`)."""

    family = LINEAR_FAMILY

    def __init__(self, parent_type: type[nn.Module] | str, child: str, *, name: str | None = None) -> None:
        # a "package.module.Class" string is resolved when that module is imported (never imported here)
        self.parent_type = parent_type
        self.child = child
        qualname = parent_type if isinstance(parent_type, str) else parent_type.__name__
        self.name = name or f"{qualname.rpartition('.')[2]}.{child}"  # type: ignore[misc]
        self.suffix = f".{child}"  # type: ignore[misc]

    def module_types(self) -> tuple[type[nn.Module], ...]:
        if not isinstance(self.parent_type, str):
            return (self.parent_type,)
        module, _, cls = self.parent_type.rpartition(".")
        found = getattr(sys.modules.get(module), cls, None)
        return (found,) if isinstance(found, type) else ()

    def _child(self, module: nn.Module) -> nn.Module:
        return module._modules[self.child]  # type: ignore[return-value]

    def claims(self, module: nn.Module) -> tuple[nn.Module, ...]:
        child = module._modules.get(self.child)
        return (child,) if child is not None else ()

    def reparametrized(self, module: nn.Module) -> str | None:
        return unsupported(self._child(module))  # the child's weight and bias, which the parent passes to F.linear

    def weight(self, module: nn.Module) -> Tensor:
        return weight_leaf(self._child(module))

    def bias(self, module: nn.Module) -> Tensor | None:
        bias = self._child(module)._parameters.get("bias")
        return bias if isinstance(bias, Tensor) else None

    def features(self, module: nn.Module) -> int:
        return int(self._child(module).in_features)  # type: ignore[arg-type]

    fan_in = features

    def watched(self, module: nn.Module) -> Tensor:
        """The tensor the parent passes to ``F.linear``: the child's ``weight`` attribute (so :attr:`captures`)."""
        return self._child(module).weight  # type: ignore[return-value]


class MHAOutProjKind(FunctionalLinearKind):
    """``nn.MultiheadAttention.out_proj``: its input is the attention output flattened to (L·N, E), rows in
    (position, batch) order whatever ``batch_first``; a token mask is the query's."""

    def token_rows(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], h: Tensor, mask: Tensor
    ) -> Tensor | None:
        query = args[0] if args else kwargs.get("query")
        if not isinstance(query, Tensor) or mask.shape != query.shape[:-1]:
            return None
        rows = mask.t() if module.batch_first and mask.dim() == 2 else mask  # (L, N): the order of h's rows
        return rows.reshape(h.shape[:-1]) if rows.numel() == h.shape[:-1].numel() else None


_LAST_KEYS: list[Any] = [None]  # the k and v blocks of one call invert its key_padding_mask once


def _real_keys(padding: Tensor, *, transpose: bool) -> Tensor:
    """True where ``key_padding_mask`` marks a real key (False, or not −inf in a float mask), in the key's
    layout ((S, N) when ``transpose``)."""
    last = _LAST_KEYS[0]
    compiling = torch.compiler.is_compiling()
    if not compiling and last is not None and last[0]() is padding and last[1:3] == (padding._version, transpose):
        return last[3]
    real = ~padding if padding.dtype == torch.bool else ~torch.isneginf(padding)
    real = real.t() if transpose else real
    if not compiling:
        _LAST_KEYS[0] = (weakref.ref(padding), padding._version, transpose, real)
    return real


# ------------------------------------------------------------------ F.linear capture
_LOCK = threading.Lock()
_ORIGINAL_LINEAR = F.linear
_ORIGINAL_MHA = F.multi_head_attention_forward
# The same function under another identity, reading torch.nn.functional's own globals (so its ``linear`` is
# whatever ``F.linear`` is at the call). Dynamo puts ``F.multi_head_attention_forward`` into its graph whole, as a
# torch function, and never sees the ``F.linear`` call inside it; this copy it inlines like any Python function.
_TRACEABLE_MHA = types.FunctionType(
    _ORIGINAL_MHA.__code__,
    _ORIGINAL_MHA.__globals__,
    _ORIGINAL_MHA.__name__,
    _ORIGINAL_MHA.__defaults__,
    _ORIGINAL_MHA.__closure__,
)
_TRACEABLE_MHA.__kwdefaults__ = _ORIGINAL_MHA.__kwdefaults__
_TRACEABLE_MHA.__qualname__ = _ORIGINAL_MHA.__qualname__
_TRACEABLE_MHA.__doc__ = _ORIGINAL_MHA.__doc__
# torch's check of key_padding_mask's shape gives torch._check messages whose closures hold the tensor, which Dynamo
# cannot trace (a graph break; an error with fullgraph=True); absent in some torch versions (then nothing to swap)
_ORIGINAL_CHECK_KPM = getattr(F, "_check_key_padding_mask", None)


def _traceable_check_key_padding_mask(key_padding_mask: Tensor, src_len: int, bsz: int) -> None:
    """torch's ``_check_key_padding_mask`` (the same messages in eager), traceable by Dynamo."""
    if not torch.compiler.is_compiling():
        _ORIGINAL_CHECK_KPM(key_padding_mask, src_len, bsz)  # type: ignore[misc]
        return
    # messages without the values: a closure over a size would hold a symbolic int under dynamic shapes
    torch._check_with(AssertionError, key_padding_mask.shape[0] == bsz, lambda: "key_padding_mask: not (N, S)")
    torch._check_with(AssertionError, key_padding_mask.shape[1] == src_len, lambda: "key_padding_mask: not (N, S)")


_WATCHED: dict[int, list[tuple[Tensor, Tensor]]] = {}
_ACTIVE = 0


def _recording_linear(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    out = _ORIGINAL_LINEAR(input, weight, bias)
    calls = _WATCHED.get(id(weight))
    if calls is not None:
        calls.append((input, out))
    return out


def _start(weight: Tensor) -> list[tuple[Tensor, Tensor]]:
    global _ACTIVE
    calls = _WATCHED.setdefault(id(weight), [])
    _ACTIVE += 1
    F.linear = _recording_linear  # the module global F.* functions look up
    F.multi_head_attention_forward = _TRACEABLE_MHA
    if _ORIGINAL_CHECK_KPM is not None:
        F._check_key_padding_mask = _traceable_check_key_padding_mask  # type: ignore[attr-defined]
    return calls


def _stop(weight: Tensor) -> list[tuple[Tensor, Tensor]]:
    global _ACTIVE
    calls = _WATCHED.pop(id(weight), [])
    _ACTIVE = max(_ACTIVE - 1, 0)
    if _ACTIVE == 0:
        F.linear = _ORIGINAL_LINEAR
        F.multi_head_attention_forward = _ORIGINAL_MHA
        if _ORIGINAL_CHECK_KPM is not None:
            F._check_key_padding_mask = _ORIGINAL_CHECK_KPM  # type: ignore[attr-defined]
    return calls


def capturing(weight: Tensor) -> list[tuple[Tensor, Tensor]]:
    """Start recording the ``(input, output)`` of ``F.linear`` calls with ``weight``; returns the list they are
    appended to. Stop with :func:`stop_capturing`. Traced by ``torch.compile`` (the lock, which Dynamo cannot
    enter, is taken in eager only: a traced forward's swaps are the graph's side effects)."""
    if torch.compiler.is_compiling():
        return _start(weight)
    with _LOCK:
        return _start(weight)


def stop_capturing(weight: Tensor) -> list[tuple[Tensor, Tensor]]:
    """Stop one :func:`capturing` of ``weight``; the calls recorded since."""
    if torch.compiler.is_compiling():
        return _stop(weight)
    with _LOCK:
        return _stop(weight)


def register_functional_linear(
    parent_type: type[nn.Module] | str, children: Sequence[str]
) -> list[FunctionalLinearKind]:
    """Teach BNP that modules of ``parent_type`` call ``F.linear`` with the weights of their ``nn.Linear``
    attributes ``children`` (instead of calling them): those Linears are then preconditioned from the inputs
    of those calls. Returns the registered kinds (named ``<parent class>.<child>``)."""
    kinds = [FunctionalLinearKind(parent_type, child) for child in children]
    for kind in kinds:
        register_layer_kind(kind)
    return kinds


_WEIGHT_READ = re.compile(r"\bself\.([A-Za-z_]\w*)\.weight\b")


_LINEAR_CHILDREN: weakref.WeakKeyDictionary[type, frozenset[str]] = weakref.WeakKeyDictionary()
_LINEAR_CALL = re.compile(r"\blinear\s*\(")  # F.linear(, torch.nn.functional.linear(, linear(
_SOURCES: weakref.WeakKeyDictionary[type, str] = weakref.WeakKeyDictionary()


def forward_source(parent_type: type[nn.Module]) -> str:
    """The source of ``parent_type.forward``, dedented, read once per class; empty when it cannot be read (a class
    made by ``exec``, a C extension)."""
    source = _SOURCES.get(parent_type)
    if source is None:
        try:
            source = textwrap.dedent(inspect.getsource(parent_type.forward))
        except (OSError, TypeError):
            source = ""
        _SOURCES[parent_type] = source
    return source


def _linear_children(parent_type: type[nn.Module]) -> frozenset[str]:
    """Attributes ``a`` whose ``self.a.weight`` the source of ``parent_type.forward`` uses as a linear layer's
    weight besides, or instead of, calling ``self.a(...)``: read while never called (passed to ``F.linear`` or to a
    function that calls it), or called and also passed to a ``linear(...)`` call (``F.linear(y, self.a.weight,
    self.a.bias)``: the weight's gradient then has two inputs, and a hook on the child would see only the direct
    call's). A weight read for anything else by a parent that calls the child (a penalty, its dtype) is no second
    input. Empty when the source cannot be read (a class made by ``exec``, a C extension). Read once per class."""
    found = _LINEAR_CHILDREN.get(parent_type)
    if found is None:
        source = forward_source(parent_type)
        passed = {
            a for call in _LINEAR_CALL.finditer(source) for a in _WEIGHT_READ.findall(_arguments(source, call.end()))
        }
        read = set(_WEIGHT_READ.findall(source))
        called = {a for a in read if re.search(rf"\bself\.{a}\s*\(", source)}
        found = _LINEAR_CHILDREN[parent_type] = frozenset(read - called | passed)
    return found


def _arguments(source: str, start: int) -> str:
    """The text between the parenthesis opened just before ``start`` and the one that closes it."""
    depth = 1
    for end in range(start, len(source)):
        depth += {"(": 1, ")": -1}.get(source[end], 0)
        if depth == 0:
            return source[start:end]
    return source[start:]


def inferred_functional_linears(module: nn.Module, claimed: frozenset[int] = frozenset()) -> list[FunctionalLinearKind]:
    """Kinds for the ``nn.Linear`` children that ``module``'s forward uses through their weight without calling
    them (``F.linear(x, self.proj.weight, self.proj.bias)``, or the weight passed on to a function that does), or
    both calls and passes to ``F.linear`` (:func:`_linear_children`), read from the source of its class's
    ``forward``: their inputs are then captured from the ``F.linear`` calls made with that weight while ``module``
    runs — a direct call of the child is one, since ``nn.Linear.forward`` calls it — as for a parent made known with
    :func:`register_functional_linear`. The layer keeps the child's name. A child whose ``id`` is in ``claimed`` (a
    registered kind feeds it) is left out."""
    kinds = []
    for child in sorted(_linear_children(type(module))):
        linear = module._modules.get(child)
        if isinstance(linear, nn.Linear) and id(linear) not in claimed:
            kinds.append(FunctionalLinearKind(type(module), child))
    return kinds
