"""Conditioning and landscape metrics in pure torch (paper 000 §3.3 and §5.1; paper 003 §3.2; paper 002 §2).

* κ(D) with D = diag(1, σ)⁻¹ of the raw input statistics (paper 000, eq. 12; §5.1, Fig. 8 shows
  1e2–1e5): the paper's predictor of the gain, ``κ(Pᵀ∇²L P) ≈ κ(∇²L) / κ(D)²`` (§3.3 after
  Theorem 4) (:func:`kappa_d`); and max σ̃ / min σ̃ of BNP's floored σ̃ (:func:`sigma_ratio`), which
  is at most √((1 + ε1)/ε1) by construction.
* The exact Hessian of the loss with respect to one output neuron's ŵ = [b_i; w_i] (Prop. 2:
  ``∇²_ŵ L = Ĥᵀ S Ĥ``), and its preconditioned form ``Pᵀ ∇²_ŵ L P`` (Theorem 3) with

  .. math::
      P = \\begin{bmatrix} 1 & -(μ⊗e)^T \\\\ 0 & I \\end{bmatrix}
          \\operatorname{diag}(1, 1/(\\tilde σ⊗e)),

  where ``⊗e`` repeats an input channel's entry over its kernel positions (§4); P = diag(1/σ̃) for
  a layer without bias. Eigenvalues come from ``eigvalsh`` in float64 (:func:`spectrum`).
* κ of a weight matrix: ratio of the extreme singular values of its (out, in·k…) view.
* Extreme eigenvalues of a full Hessian by Lanczos with Hessian-vector products (:func:`lanczos_extremes`).
* The landscape probes of paper 003 (§3.2, App. A.2.2) along a direction d: loss range, gradient
  change and effective β-smoothness (:func:`landscape_probe`).
* The effective learning rate η/‖w‖² of scale-invariant weights (paper 002, Lemma 2.4 and §2.2),
  with the rule of :func:`scale_invariant_layers` deciding which weights are scale-invariant.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = [
    "LandscapeResult",
    "LossOf",
    "NeuronBlock",
    "Spectrum",
    "effective_learning_rate",
    "hessian_extremes",
    "kappa_d",
    "lanczos_extremes",
    "landscape_probe",
    "matrix_kappa",
    "neuron_hessians",
    "neuron_preconditioner",
    "scale_invariant_layers",
    "sigma_ratio",
    "spectrum",
]


LossOf = Callable[[dict[str, Tensor]], Tensor]
"""The loss given tensors that replace the named ones (e.g. ``torch.func.functional_call`` on a model)."""


def kappa_d(var: Tensor, mu: Tensor | None = None, *, bias_entry: bool = True, rtol: float | None = None) -> float:
    """The paper's κ(D) (paper 000, eq. 12; §5.1, Fig. 8): D = diag(1, σ)⁻¹ from the *raw* σ² of a
    layer's input (no ε floors), so κ(D) = max|d| / min|d| over the entries d of the diagonal.

    .. math::
        D = \\begin{bmatrix} 1 & 0 \\\\ 0 & \\operatorname{diag}(σ) \\end{bmatrix}^{-1}, \\qquad
        κ(D) = \\frac{\\max(1, 1/σ_{\\min})}{\\min(1, 1/σ_{\\max})}

    Dead units are left out: unit j counts as dead when σ_j ≤ ``rtol``·max(σ_max, |μ_j|), i.e. when its
    spread is below what statistics of that dtype resolve (a ReLU that never fires, a constant input);
    its 1/σ_j would be infinite and its column of Ĥ is zero (Theorem 4 assumes full column rank).

    Args:
        var: σ² per input feature/channel (raw: not floored).
        mu: μ per feature (only used to tell a constant input from a live one); ``None``: 0.
        bias_entry: include D's leading 1 (the bias); ``False`` for a layer without a centring block.
        rtol: the dead-unit threshold; default the machine epsilon of ``var``'s dtype.

    Returns:
        κ(D), or NaN when no unit is live (nothing to condition).
    """
    tol = torch.finfo(var.dtype).eps if rtol is None else rtol
    sigma = var.detach().double().clamp_min(0.0).sqrt()
    scale = torch.maximum(sigma.max(), mu.detach().double().abs()) if mu is not None else sigma.max()
    live = sigma > tol * scale
    if not bool(live.any()):
        return math.nan
    d = sigma[live].reciprocal()
    if bias_entry:
        d = torch.cat([d.new_ones(1), d])
    return float(d.max() / d.min())


def sigma_ratio(var: Tensor) -> float:
    """max σ / min σ for σ² = ``var`` (float64). With BNP's floored σ̃² this is κ(D̃) = κ(diag(1/σ̃)),
    bounded by √((1 + ε1)/ε1) ≈ 10.05 at ε1 = 1e-2 by construction."""
    sigma = var.detach().double().sqrt()
    return float(sigma.max() / sigma.min())


@dataclass
class Spectrum:
    """Eigenvalue summary of a symmetric matrix.

    Attributes:
        lambda_min: the smallest (signed) eigenvalue.
        lambda_max: the largest (signed) eigenvalue.
        kappa: max|λ| / min{|λ| : |λ| > tol·max|λ|}, the 2-norm condition number restricted to the
            numerically nonzero eigenvalues (the paper's κ* of Theorem 1 for a PSD matrix). ``inf`` for
            the zero matrix.
        rank: how many |λ| exceed tol·max|λ|.
    """

    lambda_min: float
    lambda_max: float
    kappa: float
    rank: int


def spectrum(matrix: Tensor, rtol: float | None = None) -> Spectrum:
    """:class:`Spectrum` of a symmetric matrix, with ``eigvalsh`` in float64.

    Args:
        matrix: a square matrix; it is symmetrized as (A + Aᵀ)/2 first.
        rtol: relative threshold below which |λ| counts as zero; default ``n·eps`` of ``matrix.dtype``
            (NumPy's ``matrix_rank`` rule), the round-off level of a Hessian computed in that dtype.
    """
    n = matrix.shape[0]
    tol = n * torch.finfo(matrix.dtype).eps if rtol is None else rtol
    m = matrix.detach().double()
    eig = torch.linalg.eigvalsh((m + m.T) / 2)
    scale = float(eig.abs().max())
    nonzero = eig.abs()[eig.abs() > tol * scale]
    kappa = scale / float(nonzero.min()) if scale > 0 else math.inf
    return Spectrum(float(eig[0]), float(eig[-1]), kappa, int(nonzero.numel()))


def matrix_kappa(weight: Tensor) -> float:
    """κ = σ_max / σ_min of the 2-D view (out, in·k…) of a weight, in float64 (``inf`` if σ_min = 0)."""
    s = torch.linalg.svdvals(weight.detach().reshape(weight.shape[0], -1).double())
    return float(s[0] / s[-1]) if s[-1] > 0 else math.inf


@dataclass
class NeuronBlock:
    """One output neuron's parameters ŵ = [b_i; w_i.flatten()] (no b_i when ``bias`` is ``None``).

    ``weight_key``/``bias_key`` name the tensors in the dictionary passed to the loss function.
    """

    weight_key: str
    weight: Tensor
    bias_key: str | None
    bias: Tensor | None
    index: int

    def initial(self) -> Tensor:
        row = self.weight.detach()[self.index].reshape(-1)
        return row if self.bias is None else torch.cat([self.bias.detach()[self.index : self.index + 1], row])

    def substitute(self, w_hat: Tensor) -> dict[str, Tensor]:
        """Full weight (and bias) tensors with row/entry ``index`` replaced by ``w_hat`` (differentiably)."""
        w0, i = self.weight.detach(), self.index
        row = (w_hat if self.bias is None else w_hat[1:]).view(1, *w0.shape[1:])
        out = {self.weight_key: torch.cat([w0[:i], row, w0[i + 1 :]])}
        if self.bias is not None and self.bias_key is not None:
            b0 = self.bias.detach()
            out[self.bias_key] = torch.cat([b0[:i], w_hat[:1], b0[i + 1 :]])
        return out


def neuron_hessians(loss_of: LossOf, blocks: Sequence[NeuronBlock]) -> list[Tensor]:
    """Exact Hessians ∇²_ŵ L of the loss with respect to each block's ŵ (diagonal blocks of the joint Hessian).

    One forward pass and one backward pass with ``create_graph`` serve every block; each block's
    Hessian is then one batched second backward (``is_grads_batched``, a loop if vmap cannot run it).

    Args:
        loss_of: the loss given tensors that replace the named ones (keys of the blocks).
        blocks: the neurons.
    """
    if not blocks:  # nothing to differentiate (``autograd.grad`` refuses an empty list of inputs)
        return []
    thetas = [b.initial().clone().requires_grad_(True) for b in blocks]
    with torch.enable_grad():
        replaced: dict[str, Tensor] = {}
        for block, theta in zip(blocks, thetas):
            replaced.update(block.substitute(theta))
        loss = loss_of(replaced)
        grads = torch.autograd.grad(loss, thetas, create_graph=True, allow_unused=True)
        hessians = []
        for theta, grad in zip(thetas, grads):
            n = theta.numel()
            if grad is None or not grad.requires_grad:  # the loss is (locally) linear in ŵ
                hessians.append(torch.zeros(n, n, dtype=theta.dtype, device=theta.device))
                continue
            eye = torch.eye(n, dtype=theta.dtype, device=theta.device)
            try:
                (h,) = torch.autograd.grad(
                    grad, theta, eye, retain_graph=True, is_grads_batched=True, allow_unused=True
                )
            except RuntimeError:  # an op without a vmap rule: one row at a time
                rows = [torch.autograd.grad(grad, theta, e, retain_graph=True, allow_unused=True)[0] for e in eye]
                h = torch.stack([torch.zeros_like(theta) if r is None else r for r in rows])
            hessians.append(torch.zeros(n, n, dtype=theta.dtype, device=theta.device) if h is None else h.detach())
    return hessians


def neuron_preconditioner(mu: Tensor | None, var_t: Tensor, kernel_volume: int = 1) -> Tensor:
    """BNP's P for one neuron (eq. 12, §4) in float64: U·diag(1, 1/σ̃) with U = [[1, −μᵀ], [0, I]].

    Args:
        mu: μ of the input channels the neuron sees, or ``None`` (no bias: P = diag(1/σ̃)).
        var_t: σ̃² of those channels.
        kernel_volume: kernel positions per input channel (1 for Linear); μ and σ̃ are repeated over them.
    """
    inv_sigma = var_t.detach().double().rsqrt().repeat_interleave(kernel_volume)
    if mu is None:
        return torch.diag(inv_sigma)
    n = inv_sigma.numel() + 1
    u = torch.eye(n, dtype=torch.float64, device=inv_sigma.device)
    u[0, 1:] = -mu.detach().double().repeat_interleave(kernel_volume)
    return u * torch.cat([inv_sigma.new_ones(1), inv_sigma])  # U·D: scales U's columns


def lanczos_extremes(
    matvec: Callable[[Tensor], Tensor], dim: int, iters: int, *, device: torch.device, seed: int = 0
) -> tuple[float, float]:
    """(λ_min, λ_max) Ritz values of a symmetric operator after ``iters`` Lanczos steps.

    The basis is kept in float64 and fully reorthogonalized; the start vector comes from a private
    generator (the global RNG is not touched). λ_min is signed: a negative value is a direction of
    negative curvature. Stops early on breakdown (an invariant subspace was found).

    Args:
        matvec: v ↦ A·v on flat vectors (any floating dtype; results are cast to float64).
        dim: length of the vectors.
        iters: Lanczos steps (≥ 1); the extremes converge first, typically in 10–30 steps.
        device: where the vectors live.
        seed: seed of the start vector.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(dim, generator=gen, dtype=torch.float64).to(device)
    basis = [q / q.norm()]
    alphas: list[float] = []
    betas: list[float] = []
    for k in range(min(iters, dim)):
        w = matvec(basis[k]).double()
        alphas.append(float(w @ basis[k]))
        stacked = torch.stack(basis)
        for _ in range(2):  # full reorthogonalization, twice is enough
            w = w - stacked.T @ (stacked @ w)
        beta = float(w.norm())
        if k == min(iters, dim) - 1 or beta <= 1e-10 * max(abs(a) for a in alphas):
            break
        betas.append(beta)
        basis.append(w / beta)
    t = torch.diag(torch.tensor(alphas, dtype=torch.float64))
    if betas:
        off = torch.tensor(betas, dtype=torch.float64)
        t = t + torch.diag(off, 1) + torch.diag(off, -1)
    ritz = torch.linalg.eigvalsh(t)
    return float(ritz[0]), float(ritz[-1])


@dataclass
class LandscapeResult:
    """Paper 003's measurements along one direction (App. A.2.2).

    Attributes:
        loss_range: max − min of L(θ − k·d) over the step multiples k.
        grad_change: max over k of ‖∇L(θ − k·d) − ∇L(θ)‖.
        beta_smoothness: max over k of ‖∇L(θ − k·d) − ∇L(θ)‖ / ‖k·d‖ ("effective" β-smoothness).
    """

    loss_range: float
    grad_change: float
    beta_smoothness: float


def _loss_and_grad(loss_of: LossOf, params: dict[str, Tensor]) -> tuple[float, dict[str, Tensor]]:
    """L and ∇L at ``params`` (detached leaves: nothing accumulates into any ``.grad``)."""
    leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    with torch.enable_grad():
        loss = loss_of(leaves)
        grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    return float(loss.detach()), {
        k: torch.zeros_like(v) if g is None else g for (k, v), g in zip(leaves.items(), grads)
    }


def landscape_probe(
    loss_of: LossOf,
    params: dict[str, Tensor],
    direction_of: Callable[[dict[str, Tensor]], dict[str, Tensor]],
    steps: Sequence[float],
) -> LandscapeResult:
    """Move to θ − k·d for every k in ``steps`` and compare loss and gradient with those at θ (paper 003).

    Args:
        loss_of: the loss given tensors that replace the named ones; must not modify its inputs.
        params: θ, by name.
        direction_of: ∇L(θ) ↦ d, the step of the optimizer (paper 003: η·∇L), by name.
        steps: the multiples k (paper 003, App. A.2.2: [1/2, 4] × step size for VGG).
    """
    _, g0 = _loss_and_grad(loss_of, params)
    direction = direction_of({k: g.clone() for k, g in g0.items()})
    d_norm = math.sqrt(sum(float(d.double().square().sum()) for d in direction.values()))
    losses, changes, betas = [], [], []
    for k in steps:
        moved = {name: p.detach() - k * direction[name] if name in direction else p for name, p in params.items()}
        loss, grads = _loss_and_grad(loss_of, moved)
        change = math.sqrt(sum(float((grads[n] - g0[n]).double().square().sum()) for n in g0))
        losses.append(loss)
        changes.append(change)
        betas.append(change / (abs(k) * d_norm) if k != 0 and d_norm > 0 else math.nan)
    return LandscapeResult(max(losses) - min(losses), max(changes), max(betas))


def hessian_extremes(loss_of: LossOf, params: dict[str, Tensor], iters: int, seed: int = 0) -> tuple[float, float]:
    """(λ_min, λ_max) of the Hessian of ``loss_of`` with respect to all of ``params`` by :func:`lanczos_extremes`,
    with Hessian-vector products by double backpropagation through one retained graph."""
    leaves = [p.detach().clone().requires_grad_(True) for p in params.values()]
    with torch.enable_grad():
        loss = loss_of(dict(zip(params, leaves)))
        grads = torch.autograd.grad(loss, leaves, create_graph=True, allow_unused=True)
    live = [i for i, g in enumerate(grads) if g is not None and g.requires_grad]  # others: zero Hessian rows
    sizes = [leaf.numel() for leaf in leaves]

    def matvec(v: Tensor) -> Tensor:
        parts = [p.view_as(leaf).to(leaf.dtype) for p, leaf in zip(v.split(sizes), leaves)]
        outputs, vectors = [grads[i] for i in live], [parts[i] for i in live]
        hv = torch.autograd.grad(outputs, leaves, vectors, retain_graph=True, allow_unused=True)
        return torch.cat([(torch.zeros_like(leaf) if h is None else h).reshape(-1) for h, leaf in zip(hv, leaves)])

    return lanczos_extremes(matvec, sum(sizes), iters, device=leaves[0].device, seed=seed)


# ------------------------------------------------------------------ scale invariance (paper 002)
_LAYER_TYPES = (nn.Linear, nn.modules.conv._ConvNd)
_PER_CHANNEL_NORMS = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)
_PASS_THROUGH = (
    nn.ReLU,
    nn.LeakyReLU,
    nn.Identity,
    nn.modules.dropout._DropoutNd,
    nn.modules.pooling._MaxPoolNd,
    nn.modules.pooling._AvgPoolNd,
    nn.modules.pooling._AdaptiveAvgPoolNd,
    nn.modules.pooling._AdaptiveMaxPoolNd,
    nn.Flatten,
)


def scale_invariant_layers(model: nn.Module) -> dict[str, int]:
    """``{layer name: number of scale-invariant units}`` for the Linear/ConvNd layers the rule applies to.

    Rule: inside an ``nn.Sequential``, the layer is followed by zero or more positively homogeneous,
    channel-preserving modules (ReLU, LeakyReLU, Identity, Dropout, max/average pooling, Flatten)
    and then by a normalization layer in its training-mode form. Then the training loss is invariant
    to scaling these groups of parameters by any c > 0 (paper 002, Definition 2.1):

    * BatchNorm/InstanceNorm: each output unit's (w_i, b_i) — ``out`` units;
    * LayerNorm: the whole layer's (W, b) — 1 unit;
    * GroupNorm(G, C) (no Flatten in between): the G groups of C/G output channels with their biases.
    """
    found: dict[str, int] = {}
    for prefix, seq in model.named_modules():
        if not isinstance(seq, nn.Sequential):
            continue
        children = list(seq.named_children())
        for i, (name, layer) in enumerate(children):
            if not isinstance(layer, _LAYER_TYPES):
                continue
            flattened = False
            for _, follower in children[i + 1 :]:
                if isinstance(follower, _PASS_THROUGH):
                    flattened |= isinstance(follower, nn.Flatten)
                    continue
                units = None
                out = layer.weight.shape[0]
                if isinstance(follower, _PER_CHANNEL_NORMS):
                    units = out
                elif isinstance(follower, nn.LayerNorm):
                    units = 1
                elif isinstance(follower, nn.GroupNorm) and not flattened and follower.num_channels == out:
                    units = follower.num_groups
                if units is not None:
                    found[f"{prefix}.{name}" if prefix else name] = units
                break
    return found


def effective_learning_rate(weight: Tensor, bias: Tensor | None, lr: float, units: int) -> float:
    """η / ‖w‖² with ‖w‖² the mean over the layer's scale-invariant units of ‖(W_u, b_u)‖² (paper 002).

    Args:
        weight: the trainable weight (out, ...).
        bias: its bias or ``None``.
        lr: the SGD step size η of the weight's parameter group.
        units: how many contiguous, equal blocks of output rows form the scale-invariant units.
    """
    rows = weight.detach().reshape(weight.shape[0], -1).double().square().sum(1)
    if bias is not None:
        rows = rows + bias.detach().double().square()
    per_unit = rows.view(units, -1).sum(1)
    return lr / float(per_unit.mean())
