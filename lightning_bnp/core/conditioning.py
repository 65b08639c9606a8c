"""Weight Conditioning: equilibrated weights as ``torch.nn.utils.parametrize`` parametrizations.

Saratchandran, Wang & Lucey, *Weight Conditioning for Smooth Optimization of Neural Networks*
(paper 004), §4 (row, column and row-column equilibration), §5.1 (eq. 16: the layer uses the
preconditioned weight E_k·W_k; Thm. 5.1, Prop. 1) and §6.1 (CNNs: the first convolution and the
last dense layer).

Orientation. The paper writes a dense layer as F_k = φ(F_{k−1}·W_k + b_k) with W_k of shape
(n_in, n_out); PyTorch stores ``weight`` as (out, in), i.e. W_k = ``weight.T``. Hence

* paper **row** equilibration E·W (one factor per *input* feature, scaling its outgoing weights to
  unit 2-norm) normalises the **columns** of PyTorch's weight (norms over dim 0);
* paper **column** equilibration W·E (one factor per *output* neuron) normalises PyTorch's **rows**;
* **row-column** is sequential: first the rows (paper) of W, then the columns (paper) of the
  row-equilibrated matrix: W ↦ (E_r·W)·E_c with E_c computed from E_r·W, so every output neuron
  ends with unit norm and every input feature with its share of it.

A convolution kernel (out, in/groups, *k) is equilibrated as the (out, in/groups·∏k) matrix: an
"input feature" is one (input channel, kernel position) column of that 2-D view.

.. math::
    W_{\\text{row}} = E_r W,\\quad (E_r)_{ii} = \\frac{1}{\\|W_{i:}\\|_2}, \\qquad
    W_{\\text{col}} = W E_c,\\quad (E_c)_{jj} = \\frac{1}{\\|W_{:j}\\|_2}
    \\qquad (\\text{a factor is } 1 \\text{ where the norm is} \\le ε)

Zero norms. A vector with a norm above ε gets exactly unit norm (1/‖·‖₂, not 1/(‖·‖₂ + ε)), so the
forward matches the paper's formula to rounding, and row or column equilibration is a projection
(applying it to its own output changes nothing; row-column is one sweep: its paper columns are unit,
its rows are not). A vector with norm ≤ ε (default 1e-12; in practice an all-zero vector, e.g. a
zero-initialised head) is left as it is: its factor is 1 and its Jacobian the identity, so it
outputs 0 and its gradient is the plain gradient at unit scale. One SGD step moves it to −η·ḡ, and
from the next forward on it is a unit vector (as soon as a step gives it a nonzero gradient). The
earlier factor 1/max(‖·‖₂, ε) scaled that first gradient by 1/ε = 1e12 — 1e24 through both sweeps of
row-column, where the float32 squared norm of the resulting ``original`` overflowed and the
conditioned weight stayed 0 for good. The factor is formed from the squared norm with the masked
entries replaced before the square root, so first and second derivatives are finite at zero vectors.
Norms are taken in float32 at least (half/bfloat16 weights are upcast, then the result is cast
back) and never under autocast.

Cost. Weights of at least :data:`FUSED_MIN_NUMEL` elements go through a custom autograd Function
with the analytic backward (one weight-sized buffer per pass, norms over dim 0 as one GEMV); smaller
ones through plain autograd ops, whose per-op overhead is lower. Both are twice differentiable and
traceable by ``torch.compile(fullgraph=True)``.

Van der Sluis. For a full-rank W with m rows, E_r·W has unit rows, so ‖E_r W‖₂ ≤ √m and
σ_min(E_r W) ≥ σ_min(W) / max_i ‖W_{i:}‖ ≥ σ_min(W) / ‖W‖₂: κ(E_r W) ≤ √m·κ(W) in every shape, and
for m ≤ n (full row rank) κ(E_r W) ≤ √m·min_D κ(D W) over diagonal D (Van der Sluis, 1969). The
paper's Thm. 5.1 / Prop. 1 drop the √m: κ(E_r W) ≤ κ(W) holds for two rows but not in general
(W = [[2, 0, 0], [2, 2, 1], [2, 1, 2]]: κ(W) = 4.372, κ(E_r W) = 4.731). See
:func:`condition_number`.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar, Literal, get_args

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy
from torch.nn.utils import parametrize

from lightning_bnp.core.reparametrization import describe
from lightning_bnp.core.selection import DEFAULT_LAYER_TYPES, select_layers, validate_layer_types
from lightning_bnp.core.validation import check_choice, check_float, check_patterns

__all__ = [
    "DEFAULT_EPS",
    "Equilibration",
    "LayerChoice",
    "Mode",
    "apply_weight_conditioning",
    "bake_weight_conditioning",
    "condition_number",
    "conditioned_layers",
    "equilibrate",
    "validate_conditioning_arguments",
    "zero_norm_count",
]

Mode = Literal["row", "column", "row_column"]
LayerChoice = Literal["all", "first_and_last"]
MODES: tuple[str, ...] = get_args(Mode)
LAYER_CHOICES: tuple[str, ...] = get_args(LayerChoice)
DEFAULT_EPS = 1e-12
FUSED_MIN_NUMEL = 1 << 14  # weights this large use the custom autograd Function (see _scale_to_unit_norm)


def validate_conditioning_arguments(
    mode: str,
    layers: str,
    eps: float,
    layer_types: object = DEFAULT_LAYER_TYPES,
    include: object = None,
    exclude: object = None,
) -> tuple[list[str], list[str] | None, list[str] | None]:
    """Shared constructor checks; messages name the argument and the value.

    Returns:
        ``(layer_types, include, exclude)`` as lists; a bare string is one entry (one pattern).

    Raises:
        TypeError: ``eps`` not a number (or a bool), or ``layer_types``/``include``/``exclude`` neither a
            string nor a list of strings.
        ValueError: an unknown ``mode``, ``layers`` or layer type, ``eps`` not a finite number > 0, or an
            empty ``layer_types``/``include``/``exclude`` list.
    """
    check_choice("mode", mode, MODES)
    check_choice("layers", layers, LAYER_CHOICES)
    check_float("eps", eps, low=0.0, low_open=True)
    return validate_layer_types(layer_types), check_patterns("include", include), check_patterns("exclude", exclude)  # type: ignore[arg-type]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _dots(a: Tensor, b: Tensor, dim: int) -> Tensor:
    """Σ a∘b along ``dim`` of 2-D tensors (keepdim). Along dim 0 it is 1ᵀ·(a∘b), one GEMV: the strided
    ``vector_norm(w, dim=0)`` costs about 4× more on CPU (ResNet-18: 11 vs 3 ms per pass)."""
    if dim == 0:
        return a.new_ones(1, a.shape[0]) @ (a * b)
    return torch.linalg.vecdot(a, b, dim=1).unsqueeze(1)


def _inverse_norm(sq: Tensor, eps: float) -> Tensor:
    """s = 1/‖v‖ where ‖v‖ > ε, else 1, from the squared norms ``sq``: a vector of norm ≤ ε (e.g. all
    zero) is left as it is, with an identity Jacobian, so its gradient is the plain gradient.

    Not 1/max(‖v‖, ε): that scales a zero vector's gradient by 1/ε = 1e12, so one SGD step threw
    ``original`` to ~1e10 (row) or, through the two sweeps of row-column, ~1e22, whose float32 squared
    norm overflowed to inf and left the conditioned weight at exactly 0 for good. The masked entries
    are replaced by 1 *before* the square root, so neither √0 nor 1/0 reaches autograd: first and
    second derivatives stay finite at zero vectors."""
    return torch.where(sq > eps * eps, sq, torch.ones_like(sq)).rsqrt()


def _no_autocast(t: Tensor) -> AbstractContextManager[object]:
    """Autocast off on ``t``'s device (norms and dot products in float32/64 under AMP)."""
    if torch.amp.is_autocast_available(t.device.type):
        return torch.autocast(t.device.type, enabled=False)
    return nullcontext()  # e.g. the meta device


class _Equilibrate(torch.autograd.Function):
    """y = w·s, s = 1/‖w‖₂ (1 where ‖w‖₂ ≤ ε) along ``dim`` of a 2-D float32/float64 ``w``, with the analytic VJP

    .. math::
        \\bar w = s \\odot \\big(\\bar y - y \\odot \\textstyle\\sum_{dim}(\\bar y \\odot y)\\,[‖w‖ > ε]\\big)

    (one weight-sized buffer instead of autograd's four, and no strided reductions: ResNet-18, every
    layer, 2 CPU threads: 140 → ~25 ms per forward+backward). Autocast is off inside: the norms stay
    in the dtype of ``w``. Under ``create_graph`` (double backward, e.g. gradient regularization) the
    backward is recomputed from ``w`` with differentiable ops, so higher derivatives are exact.
    """

    @staticmethod
    def forward(ctx: Any, w: Tensor, dim: int, eps: float) -> Tensor:
        with _no_autocast(w):
            if dim == 0:  # w∘w goes into the buffer that then receives y: one weight-sized allocation
                y = w * w
                sq = w.new_ones(1, w.shape[0]) @ y
            else:
                sq = torch.linalg.vecdot(w, w, dim=1).unsqueeze(1)
            s = _inverse_norm(sq, eps)  # exactly unit norm above ε, identity at or below (see module doc)
            y = torch.mul(w, s, out=y) if dim == 0 else w * s
        ctx.dim, ctx.eps = dim, eps
        ctx.save_for_backward(w, y, s, sq > eps * eps)
        return y

    @staticmethod
    def backward(ctx: Any, grad_y: Tensor) -> tuple[Tensor, None, None]:
        w, y, s, above = ctx.saved_tensors
        dim = ctx.dim
        with _no_autocast(w):
            if torch.is_grad_enabled():  # create_graph: every factor as a differentiable function of w
                sq = _dots(w, w, dim)
                s = _inverse_norm(sq, ctx.eps)
                y = w * s
                return s * (grad_y - y * (_dots(grad_y, y, dim) * (sq > ctx.eps * ctx.eps))), None, None
            if dim == 0:  # ȳ∘y goes into the buffer that then receives w̄: one weight-sized allocation
                grad_w = grad_y * y
                t = w.new_ones(1, w.shape[0]) @ grad_w
            else:
                grad_w = torch.empty_like(y)
                t = torch.linalg.vecdot(grad_y, y, dim=1).unsqueeze(1)
            t.mul_(above)  # per-vector Σ ȳ∘y, 0 where the norm is ≤ ε (there s = 1, ∂s/∂w = 0)
            return torch.addcmul(grad_y, y, t, value=-1.0, out=grad_w).mul_(s), None, None


def _scale_to_unit_norm(w: Tensor, dim: int, eps: float) -> Tensor:
    """w/‖w‖₂ along ``dim`` (w itself where ‖w‖₂ ≤ ε): :class:`_Equilibrate` for weights of at least
    :data:`FUSED_MIN_NUMEL` elements, plain autograd ops below (there the custom Function's Python
    overhead, ~25 µs, outweighs its savings). Both compute the same formula, in the dtype of ``w``."""
    if w.numel() >= FUSED_MIN_NUMEL:
        return _Equilibrate.apply(w, dim, eps)
    # mul and sum keep the input dtype under autocast (not on its lower-precision lists)
    return w * _inverse_norm((w * w).sum(dim=dim, keepdim=True), eps)


def equilibrate(weight: Tensor, mode: Mode = "row", eps: float = DEFAULT_EPS) -> Tensor:
    """The conditioned weight in PyTorch's (out, in, *k) layout (differentiable, twice).

    Args:
        weight: a Linear (out, in) or ConvNd (out, in/groups, *k) weight.
        mode: ``"row"`` (paper E·W: unit norm per input feature, i.e. per column of the (out, in·k)
            view), ``"column"`` (paper W·E: unit norm per output neuron, i.e. per row of the view)
            or ``"row_column"`` (row, then column of the row-equilibrated matrix).
        eps: vectors of norm ≤ ``eps`` are left as they are (see the module docstring).

    Example::

        w = equilibrate(torch.randn(4, 3))  # == w / w.norm(dim=0, keepdim=True)
    """
    w = weight.reshape(weight.shape[0], -1).to(_compute_dtype(weight.dtype))
    if mode in ("row", "row_column"):  # paper rows = input features = PyTorch columns (dim 0 norms)
        w = _scale_to_unit_norm(w, 0, eps)
    if mode in ("column", "row_column"):  # paper columns = output neurons = PyTorch rows (dim 1 norms)
        w = _scale_to_unit_norm(w, 1, eps)
    return w.to(weight.dtype).reshape(weight.shape)


class Equilibration(nn.Module):
    """Parametrization ``weight = equilibrate(original, mode, eps)`` (paper §4, eq. 16).

    Registered on ``weight`` with :func:`torch.nn.utils.parametrize.register_parametrization`, so the
    trainable leaf is ``module.parametrizations.weight.original`` and ``module.weight`` is the
    conditioned value, recomputed at every access. There is no ``right_inverse``: assigning
    ``module.weight = X`` stores X as the free parameter, which equals the conditioned weight when X is
    already equilibrated.

    Args:
        mode: ``"row"``, ``"column"`` or ``"row_column"`` (see :func:`equilibrate`).
        eps: floor of the norms.
    """

    #: BNP preconditions the free parameter ``original`` as the layer's weight
    #: (:data:`~lightning_bnp.core.reparametrization.FOLLOWS_ORIGINAL`; README "Weight Conditioning")
    bnp_follows_original: ClassVar[bool] = True

    def __init__(self, mode: Mode = "row", eps: float = DEFAULT_EPS) -> None:
        super().__init__()
        validate_conditioning_arguments(mode, "all", eps)
        self.mode: Mode = mode
        self.eps = eps

    def forward(self, weight: Tensor) -> Tensor:
        return equilibrate(weight, self.mode, self.eps)

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, eps={self.eps:g}"


def _equilibration_of(module: nn.Module) -> Equilibration | None:
    if not parametrize.is_parametrized(module, "weight"):
        return None
    chain = module.parametrizations["weight"]  # type: ignore[index]
    return next((p for p in chain if isinstance(p, Equilibration)), None)


def conditioned_layers(model: nn.Module) -> dict[str, Equilibration]:
    """``{name: parametrization}`` of every module of ``model`` whose weight is equilibrated."""
    found = {name: _equilibration_of(module) for name, module in model.named_modules()}
    return {name: eq for name, eq in found.items() if eq is not None}


def apply_weight_conditioning(
    model: nn.Module,
    *,
    mode: Mode = "row",
    layers: LayerChoice = "all",
    layer_types: Sequence[str] = DEFAULT_LAYER_TYPES,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    eps: float = DEFAULT_EPS,
) -> dict[str, nn.Module]:
    """Register :class:`Equilibration` on the ``weight`` of the selected layers of ``model``.

    Selection: the modules of ``layer_types`` whose ``named_modules()`` name matches ``include``
    (all when ``None``) and none of ``exclude`` (shell globs, as
    :func:`lightning_bnp.core.selection.select_layers`); with ``layers="first_and_last"`` only the
    first and the last of those in ``named_modules()`` order (registration order: for the paper's
    CNNs the first convolution and the classifier, §6.1).

    Idempotent: a layer already equilibrated with the same ``mode`` and ``eps`` is left as it is (no
    second parametrization), so calling this twice — or fitting twice — changes nothing.

    Args:
        model: the network, modified in place.
        mode: ``"row"``, ``"column"`` or ``"row_column"`` (see :func:`equilibrate`).
        layers: ``"all"`` or ``"first_and_last"``.
        layer_types: which of ``Linear``, ``Conv1d``, ``Conv2d``, ``Conv3d`` to consider.
        include: glob patterns of module names to condition (a bare string is one pattern).
        exclude: glob patterns of module names to leave alone (a bare string is one pattern).
        eps: floor of the norms.

    Returns:
        ``{name: module}`` of the selected layers (newly and previously conditioned).

    Raises:
        ValueError: an invalid argument, a pattern that matches no layer, nothing selected, or a
            selected layer already equilibrated with another ``mode``/``eps``.

    Example::

        apply_weight_conditioning(model, layers="first_and_last")
        ...  # train
        bake_weight_conditioning(model)  # plain modules, same outputs
    """
    layer_types, include, exclude = validate_conditioning_arguments(mode, layers, eps, layer_types, include, exclude)
    try:
        selected = select_layers(model, layer_types, include, exclude)
    except ValueError as err:  # the shared helper names BNP as its client
        raise ValueError(str(err).replace("left for BNP", "left for WeightConditioning")) from None
    if layers == "first_and_last":
        names = list(selected)
        selected = {name: selected[name] for name in dict.fromkeys((names[0], names[-1]))}
    for name, module in selected.items():
        existing = _equilibration_of(module)
        if existing is not None:
            if (existing.mode, existing.eps) != (mode, eps):
                raise ValueError(
                    f"layer {name!r} is already conditioned with mode={existing.mode!r}, eps={existing.eps:g}; "
                    f"refusing to stack mode={mode!r}, eps={eps:g} on it (bake or remove it first)"
                )
            continue
        weight = module._parameters.get("weight")
        if not isinstance(weight, nn.Parameter) or is_lazy(weight):
            raise ValueError(f"layer {name!r} has no `weight` parameter to condition: {_no_weight_reason(module)}")
        parametrize.register_parametrization(module, "weight", Equilibration(mode, eps))
    return selected


def _no_weight_reason(module: nn.Module) -> str:
    """Why a selected layer has no plain ``weight`` parameter (for the error message)."""
    weight = module._parameters.get("weight")
    if weight is not None and is_lazy(weight):
        return "it is an uninitialised lazy layer (run one forward pass first)"
    return f"its weight is {describe(module, 'weight') or 'not a parameter'}; WeightConditioning needs a plain one"


def bake_weight_conditioning(model: nn.Module) -> list[str]:
    """Replace every equilibrated ``weight`` of ``model`` by a plain parameter holding its value.

    Uses ``remove_parametrizations(leave_parametrized=True)``: the model then has no
    parametrization on those weights, the same outputs, and ``weight`` keys in its ``state_dict``
    (loadable into the unmodified network). The ``Parameter`` object is kept (``set_``), so an
    optimizer holding ``parametrizations.weight.original`` now holds ``weight``. Other
    parametrizations chained on the same weight are baked with it.

    Returns:
        the names of the baked modules (empty if nothing was conditioned).

    Example::

        bake_weight_conditioning(model)
        torch.save(model.state_dict(), "plain.pt")
    """
    names = list(conditioned_layers(model))
    modules = dict(model.named_modules())
    for name in names:
        parametrize.remove_parametrizations(modules[name], "weight", leave_parametrized=True)
    return names


def zero_norm_count(weight: Tensor, mode: Mode = "row", eps: float = DEFAULT_EPS) -> int:
    """How many of the vectors that the first equilibration step normalises have norm ≤ ``eps``."""
    w = weight.detach().reshape(weight.shape[0], -1).to(_compute_dtype(weight.dtype))
    dim = 0 if mode in ("row", "row_column") else 1
    return int((torch.linalg.vector_norm(w, dim=dim) <= eps).sum())


def condition_number(weight: Tensor) -> float:
    """κ₂ = σ_max/σ_min of the (out, in·k) view, in float64 (``inf`` when rank deficient).

    κ is invariant under transposition, so this is also κ of the paper's W = ``weight.T``.
    """
    s = torch.linalg.svdvals(weight.detach().reshape(weight.shape[0], -1).to(torch.float64))
    return float(s[0] / s[-1]) if s[-1] > 0 else float("inf")
