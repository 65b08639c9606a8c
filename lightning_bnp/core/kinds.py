"""Layer kinds: what BNP needs to know about one kind of layer (DESIGN §1b).

BNP's transform is row-local: output row i of a weight needs G_w[i, :], G_b[i] and the statistics of the
input that row multiplies. So a layer kind only says

* which modules it applies to (:attr:`LayerKind.module_type`, subclasses included);
* which tensor of a forward call is the input (:meth:`LayerKind.input`, from the forward hook's ``args``/``kwargs``);
* which weight and bias that input feeds (:attr:`~LayerKind.weight_name`, :attr:`~LayerKind.bias_name`) and how they
  map to BNP's layout of output rows × input features (:meth:`LayerKind.rows`, :meth:`LayerKind.bias_rows`: a weight
  stored transposed, or a row block of a larger weight);
* how to reduce the input to per-feature moments (:meth:`LayerKind.moments`), and the ``fan_in``, ``groups`` and
  ``features`` that follow from the layout;
* what else sets it apart, so that the preconditioner never asks for a module class: the weight whose ``F.linear``
  calls give its input (``watched``: :attr:`LayerKind.captures`), what an entry of its statistics is, and whether
  statistics saved under other options fit it (:meth:`LayerKind.statistics_unit`, :meth:`~LayerKind.statistics_differ`).

The preconditioner iterates over (module, kind) pairs and never special-cases a module class. ``nn.Linear``
and ``nn.Conv{1,2,3}d`` are two built-in kinds (registered by :mod:`~lightning_bnp.core.builtin_kinds`);
``transformers.pytorch_utils.Conv1D`` (GPT-2's linear layer, weight stored (in, out)) is a third, resolved lazily:
``transformers`` is never imported here, and a model can only hold a Conv1D once the user has imported it. A
user teaches BNP a new kind with :func:`register_layer_kind`; its :attr:`~LayerKind.name` is then accepted in
``layer_types`` (YAML too).

Several kinds may apply to one module (each then feeds its own rows of its own weight from its own input, e.g. the q,
k and v blocks of one packed projection: :meth:`~LayerKind.rows` returns ``weight[a:b]``, and :attr:`~LayerKind.suffix`
names the layer ``<module name><suffix>``; or a recurrent layer's column blocks: :meth:`~LayerKind.column_block`).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, ClassVar

from torch import Tensor, nn

from lightning_bnp.core.moments import (
    column_moments_of_input,
    feature_moments,
    masked_feature_moments,
    moments_of_input,
    token_moments,
)
from lightning_bnp.core.reparametrization import bias_leaf, tensor_leaf, unsupported, weight_leaf
from lightning_bnp.core.selection import filter_by_name, layer_name
from lightning_bnp.core.statistics import Moments, statistics_dtype

__all__ = [
    "LINEAR_FAMILY",
    "ConvNdKind",
    "EmbeddingKind",
    "LayerKind",
    "LinearKind",
    "ModelScan",
    "TransformersConv1DKind",
    "layer_kinds",
    "register_built_in_kinds",
    "register_layer_kind",
    "select_layer_kinds",
    "unregister_layer_kind",
]

LINEAR_FAMILY = "Linear"


class LayerKind:
    """How BNP reads one kind of layer. Subclass it, set :attr:`name` and :attr:`module_type`, override what
    differs from a linear layer ``y = x @ weight.T + bias`` (the defaults), and :func:`register_layer_kind` it.
    Every method gets the module, so one instance serves every module of its type.

    Example (a linear layer that stores its weight (in, out), as GPT-2's ``Conv1D`` does)::

        class TransposedLinearKind(LayerKind):
            name = "TransposedLinear"
            module_type = TransposedLinear
            family = "Linear"  # also managed when `layer_types` names "Linear" (the default)

            def rows(self, module, weight):
                return weight.t()  # (in, out) -> BNP's (out, in) rows; a view: the transform stays in place

        register_layer_kind(TransposedLinearKind())
    """

    #: the name ``layer_types`` uses for this kind
    name: ClassVar[str] = ""
    #: the module class(es) this kind applies to (subclasses included); see also :meth:`module_types`
    module_type: ClassVar[type[nn.Module] | tuple[type[nn.Module], ...]] = ()
    #: a built-in ``layer_types`` name that also selects this kind (``"Linear"``: a linear layer in another layout is
    #: managed whenever linear layers are), or ``None``: only its own :attr:`name` selects it
    family: ClassVar[str | None] = None
    #: appended to the module's name to name the BNP layer (several kinds on one module need distinct ones)
    suffix: ClassVar[str] = ""
    #: the parameters this kind feeds (attributes of the module)
    weight_name: ClassVar[str] = "weight"
    bias_name: ClassVar[str | None] = "bias"
    #: the keyword of the input in ``forward`` (when it is not passed positionally)
    input_name: ClassVar[str] = "input"
    #: True where every row of the input is one sample (dense layers): N = rows, so ``statistics="batch"``
    #: needs two rows per step. False for layers whose rows are positions of a sample (convolutions).
    dense: ClassVar[bool] = True
    #: preconditioner options that shape this kind's statistics (saved with the state when such a layer exists)
    options: ClassVar[tuple[str, ...]] = ()
    #: set per class: :meth:`rows`, :meth:`bias_rows` and :meth:`input` are the defaults (the step and the forward hook
    #: then skip calling them: they run for every layer every step)
    same_rows: ClassVar[bool] = True
    default_input: ClassVar[bool] = True
    default_calls: ClassVar[bool] = True
    #: set per class: True where the class defines ``watched(module) -> Tensor``, the weight whose ``F.linear`` calls
    #: during the module's forward give its input (captured: :func:`~lightning_bnp.core.attention.capturing`), which
    #: is then not an argument of the forward (:class:`~lightning_bnp.core.attention.FunctionalLinearKind`)
    captures: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.same_rows = cls.rows is LayerKind.rows and cls.bias_rows is LayerKind.bias_rows
        cls.default_input = cls.input is LayerKind.input
        cls.default_calls = cls.calls is LayerKind.calls
        cls.captures = callable(getattr(cls, "watched", None))

    def module_types(self) -> tuple[type[nn.Module], ...]:
        """The classes this kind applies to now (resolved lazily by some, e.g. :class:`TransformersConv1DKind`)."""
        types = self.module_type
        return types if isinstance(types, tuple) else (types,)

    def configure(self, **options: Any) -> LayerKind:
        """This kind under the preconditioner's options (e.g. ``conv_statistics``); ``self`` by default."""
        return self

    def statistics_differ(self, **options: Any) -> bool:
        """Whether statistics kept under the preconditioner ``options`` (a saved state's settings) have another
        layout than this kind's, which cannot be converted (``conv_statistics``: per channel or per column)."""
        return self.configure(**options) is not self

    def statistics_unit(self, module: nn.Module) -> str:
        """What one entry of μ and σ² is, in words (for messages)."""
        return "input features" if self.dense else "input channels"

    def input(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The input of one forward call, from the forward hook's arguments: the first positional argument,
        else the keyword :attr:`input_name`. Anything but a tensor is ignored."""
        return args[0] if args else kwargs.get(self.input_name)

    def calls(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> list[tuple[Any, Any]]:
        """``[(input, output)]`` pairs of one forward call: the input the rows multiply and a tensor (or a tuple of
        them: any one) the backward reaches when it reaches those rows (the statistics count then). ``[(input(…),
        output)]`` by default; a kind whose module returns a tuple (``nn.MultiheadAttention``) overrides it."""
        return [(self.input(module, args, kwargs), output)]

    def claims(self, module: nn.Module) -> tuple[nn.Module, ...]:
        """Submodules whose weight this kind feeds in their place (their kinds then leave them alone), e.g. a Linear
        its parent uses through ``F.linear``. None by default."""
        return ()

    def refuse(self, module: nn.Module) -> str | None:
        """Why BNP cannot manage this module in its form (selecting it is then an error naming it), or ``None``."""
        return None

    def reparametrized(self, module: nn.Module) -> str | None:
        """Why BNP leaves this module alone in its current form: the tensors this kind feeds (:attr:`weight_name`,
        :attr:`bias_name`) are reparametrized in a way eq. 15 cannot follow
        (:func:`~lightning_bnp.core.reparametrization.unsupported`); ``None`` when BNP preconditions their leaves."""
        return unsupported(module, self.weight_name, self.bias_name)

    def weight(self, module: nn.Module) -> Tensor:
        """The trainable weight leaf (``parametrizations.<name>.original`` under ``torch.nn.utils.parametrize``:
        :func:`~lightning_bnp.core.reparametrization.tensor_leaf`)."""
        return tensor_leaf(module, self.weight_name)

    def bias(self, module: nn.Module) -> Tensor | None:
        """The bias the input's rows feed, or ``None``."""
        if self.bias_name is None:
            return None
        if self.bias_name == "bias":  # `bias`, or `bias_orig` when pruned (core.reparametrization)
            return bias_leaf(module)
        parameters = module._parameters  # not through nn.Module.__getattr__: runs every step
        bias = parameters[self.bias_name] if self.bias_name in parameters else getattr(module, self.bias_name, None)
        return bias if isinstance(bias, Tensor) else None

    def rows(self, module: nn.Module, weight: Tensor) -> Tensor:
        """A weight-shaped tensor (the weight, its gradient, a decay term …) as BNP's rows: a **view** of shape
        (out, features) for a linear layer, ``(out, c_in/groups, *kernel)`` for a convolution. Identity by default;
        ``weight.t()`` for a weight stored (in, out); ``weight[a:b]`` for a row block."""
        return weight

    def bias_rows(self, module: nn.Module, bias: Tensor) -> Tensor:
        """A bias-shaped tensor as the (out,) view matching :meth:`rows`. Identity by default."""
        return bias

    def row_block(self, module: nn.Module) -> tuple[int, int] | None:
        """``(i, n)`` where this layer's rows are block i of n equal, consecutive row blocks of a 2-D weight (and
        of its bias), the other blocks being the layers of n − 1 sibling kinds on the same module (the q, k, v
        blocks of ``nn.MultiheadAttention.in_proj_weight``): the step may then transform the n blocks as one
        grouped matrix, each block with its own statistics (one kernel for the n bias updates). ``None``
        (the default): the layer's rows are transformed on their own."""
        return None

    def column_block(self, module: nn.Module) -> tuple[int, int] | None:
        """``(i, n)``: this weight is column block i of n of one linear layer (sibling kinds next to it on the module),
        whose n bias tensors get one gradient (``nn.LSTM``'s ``[W_ih | W_hh]``, bias ``b_ih + b_hh``): one ε1 floor
        for the n blocks, each bias takes 1/n of G_b/q² (:mod:`~lightning_bnp.core.recurrent`). ``None`` by default."""
        return None

    def present(self, module: nn.Module) -> bool:
        """Whether ``module`` holds this kind's rows in its form (e.g. a reverse direction). True by default."""
        return True

    def left_alone(self, module: nn.Module, attribute: str) -> str | None:
        """Why a parameter ``attribute`` of ``module`` that no kind feeds is left alone, or ``None`` (the generic)."""
        return None

    def groups(self, module: nn.Module) -> int:
        """Convolution groups (1 for a linear layer)."""
        return 1

    def fan_in(self, module: nn.Module) -> int:
        """What one output row sees: ``rows(weight)[0].numel()`` (q²'s n_in)."""
        return self.rows(module, self.weight(module))[0].numel()

    def features(self, module: nn.Module) -> int:
        """Length of μ and σ² (a linear layer's input features)."""
        return self.fan_in(module)

    def moments(self, module: nn.Module, h: Tensor, output: Any) -> Moments:
        """Statistics of one forward call's input ``h``: a linear layer's, per feature (last dimension) over
        every leading dimension (:func:`~lightning_bnp.core.moments.feature_moments`)."""
        return feature_moments(h)

    def token_rows(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], h: Tensor, mask: Tensor
    ) -> Tensor | None:
        """The token mask set with ``BNPPreconditioner.token_mask`` (bool, True = a real token) as one flag per
        row of the input ``h``, shaped as ``h``'s leading dimensions; ``None`` when ``mask`` does not fit this
        input (the preconditioner then raises, naming the layer and both shapes). By default the mask must have
        exactly ``h.shape[:-1]`` (a (B, T, F) input takes a (B, T) mask), and only dense kinds take one."""
        return mask if self.dense and mask.shape == h.shape[:-1] else None

    def masked_moments(self, module: nn.Module, h: Tensor, output: Any, real: Tensor) -> Moments:
        """:meth:`moments` of the rows of ``h`` that ``real`` (from :meth:`token_rows`) marks, their count on
        the device (:func:`~lightning_bnp.core.moments.masked_feature_moments`)."""
        return masked_feature_moments(h, real)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class LinearKind(LayerKind):
    """``nn.Linear`` (and subclasses): the input is ``forward``'s ``input``, the weight (out, in)."""

    name = "Linear"
    module_type = nn.Linear
    family = LINEAR_FAMILY
    weight = staticmethod(weight_leaf)  # the same call, one frame less

    def features(self, module: nn.Module) -> int:
        return int(module.in_features)  # type: ignore[arg-type]

    fan_in = features

    moments = staticmethod(moments_of_input)  # type: ignore[assignment]  # the same call, one frame less


class ConvNdKind(LayerKind):
    """``nn.Conv{1,2,3}d``: per input channel statistics over batch and positions (eqs. 21–22), or per im2col
    column with ``conv_statistics="column"`` (eqs. 19–20)."""

    dense = False
    options = ("conv_statistics",)
    weight = staticmethod(weight_leaf)

    def __init__(self, name: str, module_type: type[nn.Module], *, columns: bool = False) -> None:
        self.name = name  # type: ignore[misc]
        self.module_type = module_type  # type: ignore[misc]
        self.columns = columns
        self.moments = column_moments_of_input if columns else moments_of_input  # type: ignore[method-assign,assignment]

    def configure(self, **options: Any) -> LayerKind:
        columns = options.get("conv_statistics", "channel") == "column"
        return self if columns == self.columns else ConvNdKind(self.name, self.module_type, columns=columns)  # type: ignore[arg-type]

    def groups(self, module: nn.Module) -> int:
        return int(module.groups)  # type: ignore[arg-type]

    def fan_in(self, module: nn.Module) -> int:
        return int(module.in_channels) // self.groups(module) * math.prod(module.kernel_size)  # type: ignore[arg-type]

    def features(self, module: nn.Module) -> int:
        channels = int(module.in_channels)  # type: ignore[arg-type]
        return channels * math.prod(module.kernel_size) if self.columns else channels  # type: ignore[arg-type]

    def statistics_unit(self, module: nn.Module) -> str:
        return "columns" if self.columns else "input channels"


class TransformersConv1DKind(LayerKind):
    """``transformers.pytorch_utils.Conv1D`` (GPT-2, GPT, …): ``addmm(bias, x, weight)``, weight stored (in, out)."""

    name = "transformers.Conv1D"
    family = LINEAR_FAMILY
    input_name = "x"

    def module_types(self) -> tuple[type[nn.Module], ...]:
        conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)  # (never imported here)
        return (conv1d,) if isinstance(conv1d, type) else ()

    def rows(self, module: nn.Module, weight: Tensor) -> Tensor:
        return weight.t()

    def features(self, module: nn.Module) -> int:
        return int(module.nx)  # type: ignore[arg-type]

    fan_in = features


EMBEDDING = "Embedding"


class EmbeddingKind(LayerKind):
    """``nn.Embedding`` (issue 24, item 4): ``out = weight[x]`` is ``onehot(x) @ weight``, a bias-free linear
    layer on one-hot inputs whose weight is stored (in, out) = (num_embeddings, embedding_dim). BNP's rows are
    the columns of ``weight`` (:meth:`rows` is ``weight.t()``), its input features the vocabulary, so Alg. 2
    applies as it does to ``nn.Linear(num_embeddings, embedding_dim, bias=False)`` with weight ``weight.t()``:
    σ² is the uncentred second moment of a one-hot column, the token's frequency, and q² = max(V/N, 1) with
    N the tokens of the step. The one-hot matrix is never built (:func:`~lightning_bnp.core.moments.
    token_moments`). Not in the default ``layer_types``: ``BNPPreconditioner(model, embeddings=True)``.

    ``padding_idx`` positions are not counted (their row gets no gradient; μ, σ², N are the real tokens');
    ``sparse=True`` is refused (its gradient is a sparse tensor); ``max_norm`` renormalizes the looked-up rows
    of the stored weight in place during the forward, and BNP transforms the gradient of the weight that
    forward used, as for any layer (README "Embeddings").
    """

    name = EMBEDDING
    module_type = nn.Embedding
    bias_name = None
    weight = staticmethod(weight_leaf)

    def refuse(self, module: nn.Module) -> str | None:
        if module.sparse:
            return (
                "sparse=True gives a sparse gradient (only the looked-up rows), which BNP does not transform; "
                "use sparse=False, or leave the embedding to the optimizer (embeddings=False, or `exclude` it)"
            )
        return None

    def rows(self, module: nn.Module, weight: Tensor) -> Tensor:
        return weight.t()

    def features(self, module: nn.Module) -> int:
        return int(module.num_embeddings)  # type: ignore[arg-type]

    fan_in = features

    def moments(self, module: nn.Module, h: Tensor, output: Any) -> Moments:
        dtype = statistics_dtype(output.dtype)  # float32 (float64 for a float64 model): h holds indices
        return token_moments(h, int(module.num_embeddings), module.padding_idx, dtype)  # type: ignore[arg-type]

    def token_rows(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], h: Tensor, mask: Tensor
    ) -> Tensor | None:
        """The input holds one token per position: a (B, T) batch of indices takes the (B, T) mask itself."""
        return mask if mask.shape == h.shape else None

    def masked_moments(self, module: nn.Module, h: Tensor, output: Any, real: Tensor) -> Moments:
        """The masked-out positions are not tokens (as ``padding_idx`` positions are not)."""
        dtype = statistics_dtype(output.dtype)
        return token_moments(h, int(module.num_embeddings), module.padding_idx, dtype, real)  # type: ignore[arg-type]


_REGISTRY: dict[str, LayerKind] = {}
_BUILT_IN: set[str] = set()  # registered by lightning_bnp.core.builtin_kinds: never unregistered


def register_layer_kind(kind: LayerKind, *, replace: bool = False) -> LayerKind:
    """Teach BNP a layer kind: its :attr:`~LayerKind.name` is then accepted in ``layer_types`` (also from a
    LightningCLI YAML file, once the module that registers it is imported, e.g. the one defining the model),
    and every :class:`BNPPreconditioner` built afterwards manages modules of its type. Returns ``kind``.

    Args:
        kind: an instance of a :class:`LayerKind` subclass.
        replace: replace a kind registered under the same name (otherwise an error).

    Raises:
        TypeError: ``kind`` is not a :class:`LayerKind` instance.
        ValueError: its name is empty or already registered (and ``replace`` is false), or its
            :attr:`~LayerKind.family` is not a registered name.
    """
    if not isinstance(kind, LayerKind):
        raise TypeError(f"`kind` must be an instance of a LayerKind subclass, got {kind!r} ({type(kind).__name__})")
    if not isinstance(kind.name, str) or not kind.name:
        raise ValueError(f"a layer kind needs a non-empty `name` (the `layer_types` entry), got {kind.name!r}")
    if kind.name in _REGISTRY and not replace:
        raise ValueError(
            f"a layer kind named {kind.name!r} is already registered ({_REGISTRY[kind.name]!r}); pass "
            "replace=True to replace it"
        )
    if kind.family is not None and kind.family not in _REGISTRY and kind.family != kind.name:
        raise ValueError(f"layer kind {kind.name!r}: `family` {kind.family!r} is not a registered layer type")
    _REGISTRY[kind.name] = kind
    return kind


def unregister_layer_kind(name: str) -> None:
    """Forget a kind registered with :func:`register_layer_kind` (the built-in ones cannot be removed).

    Raises:
        ValueError: ``name`` is not registered or is built in.
    """
    if name in _BUILT_IN or name not in _REGISTRY:
        raise ValueError(f"{name!r} is not a user-registered layer kind; registered: {sorted(_REGISTRY)}")
    del _REGISTRY[name]


def register_built_in_kinds(*kinds: LayerKind) -> None:
    """Register the package's own kinds (:mod:`lightning_bnp.core.builtin_kinds`): never unregistered."""
    for kind in kinds:
        register_layer_kind(kind)
        _BUILT_IN.add(kind.name)


def layer_kinds() -> dict[str, LayerKind]:
    """The registered kinds by name (a copy)."""
    return dict(_REGISTRY)


@dataclass(frozen=True)
class ModelScan:
    """What a model holds for BNP, found in one pass over its modules by
    :func:`~lightning_bnp.core.model_scan.scan_model` and read by the selection (:func:`select_layer_kinds`), the
    layers (:func:`~lightning_bnp.core.layers.make_layers`) and the coverage report
    (:func:`~lightning_bnp.core.coverage.coverage`).

    Attributes:
        model: the model scanned.
        layer_types: the validated ``layer_types`` (every name a registered kind).
        selected_kinds: the kinds ``layer_types`` selects (:func:`~lightning_bnp.core.model_scan.kinds_for`).
        known: every registered kind, the selected ones first (they win a tie in :func:`~lightning_bnp.core.model_scan.
            kinds_of`).
        modules: ``named_modules()`` of the model.
        applicable: per module name, the registered kinds that apply to it
            (:func:`~lightning_bnp.core.model_scan.kinds_of`).
        kinds: per module name, the selected kinds that apply to it, and the ``F.linear`` kinds read from its
            class's source (:func:`~lightning_bnp.core.attention.inferred_functional_linears`).
        claims: ``id`` of a module whose weight a parent's kind feeds in its place (:meth:`LayerKind.claims`)
            → ``(parent name, kind)`` of each such claim.
    """

    model: nn.Module
    layer_types: tuple[str, ...]
    selected_kinds: tuple[LayerKind, ...]
    known: tuple[LayerKind, ...]
    modules: dict[str, nn.Module]
    applicable: dict[str, list[LayerKind]]
    kinds: dict[str, list[LayerKind]]
    claims: dict[int, tuple[tuple[str, LayerKind], ...]]

    def claimer_names(self, module: nn.Module) -> tuple[str, ...]:
        """The names under which ``include``/``exclude`` select a claimed module: its parents' names and their
        layers' names (``attn``, ``attn.out_proj``); empty for a module no kind claims."""
        return tuple(n for name, kind in self.claims.get(id(module), ()) for n in (name, layer_name(name, kind.suffix)))


def select_layer_kinds(
    scan: ModelScan, include: Sequence[str] | None = None, exclude: Sequence[str] | None = None
) -> dict[str, tuple[nn.Module, LayerKind]]:
    """``{layer name: (module, kind)}`` of what BNP manages: every module of the ``scan`` to which a kind that its
    ``layer_types`` selects applies (:func:`~lightning_bnp.core.model_scan.kinds_for`) and that no other kind
    claims, kept or dropped by ``include``/``exclude`` (validated pattern lists:
    :func:`~lightning_bnp.core.validation.check_patterns`) as :func:`~lightning_bnp.core.selection.select_layers`
    does (patterns match module names); a layer's name is its module's name plus its kind's
    :attr:`~LayerKind.suffix` (:func:`~lightning_bnp.core.selection.layer_name`).

    Raises:
        ValueError: a pattern that matches no candidate, or nothing left to manage.
    """
    layer_types, found = scan.layer_types, scan.kinds
    candidates = {name: m for name, m in scan.modules.items() if found[name] and id(m) not in scan.claims}
    # patterns match a module's name or a layer's (module name + suffix: `attn.q`, `attn.out_proj`)
    names = {name: [layer_name(name, k.suffix) for k in found[name]] for name in candidates}
    every = {n for name, layer_names in names.items() for n in (name, *layer_names)}
    kept = filter_by_name({n: nn.Module() for n in every}, layer_types, include, None)
    filter_by_name({n: nn.Module() for n in every}, layer_types, None, exclude)  # exclude patterns must match
    selected = {}
    for name, m in candidates.items():
        for kind in found[name]:
            both = (name, layer_name(name, kind.suffix))
            if include is not None and not any(n in kept for n in both):
                continue
            if any(fnmatchcase(n, p) for n in both for p in exclude or ()):
                continue
            selected[both[1]] = (m, kind)
    if not selected:
        raise ValueError(
            f"no {'/'.join(layer_types)} layer is left for BNP after include={include!r}, "
            f"exclude={exclude!r}; candidates are {sorted(every)}"
        )
    return selected
