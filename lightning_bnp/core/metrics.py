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
* The effective learning rate η/‖w‖² of scale-invariant weights (paper 002, Lemma 2.4 and §2.2), which
  :func:`scale_invariant_units` finds numerically, and their ‖w‖² and cos∠(w, ∇w) (≈ 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "LandscapeResult",
    "LossOf",
    "NeuronBlock",
    "Spectrum",
    "common_rank",
    "effective_learning_rate",
    "hessian_extremes",
    "kappa_d",
    "lanczos_extremes",
    "landscape_probe",
    "loss_and_grad",
    "matrix_kappa",
    "neuron_hessians",
    "neuron_preconditioner",
    "scale_invariant_units",
    "sigma_ratio",
    "spectrum",
    "weight_norm_and_grad_cosine",
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
        nonzero: those |λ| (float64, ascending): the spectrum whose spread κ measures.
    """

    lambda_min: float
    lambda_max: float
    kappa: float
    rank: int
    nonzero: Tensor

    def counting(self, rank: int) -> Spectrum:
        """The same spectrum counting only its ``rank`` largest |λ| (κ = max|λ| / the ``rank``-th largest |λ|).

        Two congruent matrices (H and Pᵀ H P, P invertible) have one rank (Sylvester's law of inertia): where
        their counts differ, the eigenvalue counted in one only sits at the threshold, so both are compared over
        ``min`` of the two ranks (:func:`common_rank`).
        """
        if rank >= self.rank:
            return self
        nonzero = self.nonzero[self.nonzero.numel() - rank :]
        kappa = float(nonzero[-1] / nonzero[0]) if rank > 0 else math.inf
        return Spectrum(self.lambda_min, self.lambda_max, kappa, rank, nonzero)


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
    nonzero = eig.abs()[eig.abs() > tol * scale].sort().values
    kappa = scale / float(nonzero.min()) if scale > 0 else math.inf
    return Spectrum(float(eig[0]), float(eig[-1]), kappa, int(nonzero.numel()), nonzero)


def common_rank(a: Spectrum, b: Spectrum) -> tuple[Spectrum, Spectrum]:
    """``a`` and ``b`` counting the same number of eigenvalues, the smaller of their ranks
    (:meth:`Spectrum.counting`): the spectra of two congruent matrices, so that κ(a) / κ(b) compares one set of
    eigenvalues, not a near-null one counted on one side only."""
    rank = min(a.rank, b.rank)
    return a.counting(rank), b.counting(rank)


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
    # Kept rather than ``torch.func.hessian`` (+ ``vmap`` over blocks): the same Hessian to 5e-16 relative, but
    # forward-over-reverse re-runs the whole forward/backward per direction, here one shared first backward is
    # differentiated once, batched. Digits FC (batch 60, float64, 1 thread): last layer (101 parameters) 7.0 ms vs
    # 9.4 ms, a hidden layer 47 ms vs 67 ms (``torch.autograd.functional.hessian(vectorize=True)``: 8.9 ms).
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
    # Kept rather than a library: ``torch.lobpcg`` takes an explicit matrix (no operator v ↦ A·v) and finds only
    # one end of a positive definite spectrum (no signed λ_min); SciPy's ``eigsh`` on a ``LinearOperator`` (not a
    # core dependency) gives the same extremes when converged but runs ARPACK's restarts to a tolerance, not a
    # fixed budget of products: 184 ms vs 42 ms here for the two ends of a 2000×2000 test matrix (both exact).
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
        beta_smoothness: max over k ≠ 0 of ‖∇L(θ − k·d) − ∇L(θ)‖ / ‖k·d‖ ("effective" β-smoothness); NaN
            when d = 0 or every k is 0 (no ratio is defined).
    """

    loss_range: float
    grad_change: float
    beta_smoothness: float


def loss_and_grad(loss_of: LossOf, params: dict[str, Tensor]) -> tuple[float, dict[str, Tensor]]:
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
    _, g0 = loss_and_grad(loss_of, params)
    direction = direction_of({k: g.clone() for k, g in g0.items()})
    d_norm = math.sqrt(sum(float(d.double().square().sum()) for d in direction.values()))
    losses, changes, betas = [], [], []
    for k in steps:
        moved = {name: p.detach() - k * direction[name] if name in direction else p for name, p in params.items()}
        loss, grads = loss_and_grad(loss_of, moved)
        change = math.sqrt(sum(float((grads[n] - g0[n]).double().square().sum()) for n in g0))
        losses.append(loss)
        changes.append(change)
        betas.append(change / (abs(k) * d_norm) if k != 0 and d_norm > 0 else math.nan)
    # the undefined ratios (k = 0, d = 0) are left out: ``max`` of a list with a NaN depends on where the NaN is
    beta = max((b for b in betas if not math.isnan(b)), default=math.nan)
    return LandscapeResult(max(losses) - min(losses), max(changes), beta)


def hessian_extremes(loss_of: LossOf, params: dict[str, Tensor], iters: int, seed: int = 0) -> tuple[float, float]:
    """(λ_min, λ_max) of the Hessian of ``loss_of`` with respect to all of ``params`` by :func:`lanczos_extremes`,
    with Hessian-vector products by double backpropagation through one retained graph."""
    # One retained double-backward graph rather than ``torch.func.jvp(torch.func.grad(loss_of), ...)`` or
    # ``torch.autograd.functional.hvp``, which rebuild forward and backward for every product: equal to 2e-15,
    # 1.3 ms vs 5.0 / 4.4 ms per product for the 27.7k parameters of the digits FC network (float64).
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
SCALE_INVARIANCE_RTOL = 1e-3
"""Default tolerance of :func:`scale_invariant_units`: a normalization's ε makes it only nearly invariant,
BN((c·x)) − BN(x) ≈ (1 − 1/c²)·ε/(2σ²) relative, ≲ 4e-4 for c ∈ [1/2, 2], ε = 1e-5 and σ² ≥ 1e-2; scaling
a layer that is not invariant changes the outputs by O(|c − 1|) = O(1)."""


def scale_invariant_units(
    outputs_of: Callable[[dict[str, Tensor]], Tensor],
    layers: dict[str, tuple[str, Tensor, str | None, Tensor | None]],
    *,
    rtol: float = SCALE_INVARIANCE_RTOL,
    seed: int = 0,
    agree: Callable[[bool], bool] | None = None,
) -> dict[str, int]:
    """``{layer: units}`` for the layers whose parameters are scale-invariant on this batch (paper 002,
    Definition 2.1), checked numerically, so any architecture is covered (residual blocks, custom
    ``forward`` methods, normalization anywhere downstream).

    A layer's output rows (conv: output channels) with their bias entries are split into ``units``
    contiguous equal groups; the split is scale-invariant when multiplying each group by its own random
    c_u ∈ [1/2, 2) leaves ``outputs_of`` unchanged, max|Δo| ≤ ``rtol``·max|o|. Layers are scaled
    together and the failing sets bisected (adaptive group testing: a set passes only if each of its layers
    is invariant, random factors do not conspire), so a deep normalized network costs O(log L) evaluations,
    not O(L): (1) each layer as one unit — the invariant layers; (2) among those, each output unit on its
    own (BatchNorm, InstanceNorm); (3) for the rest, the other divisors of ``out`` from large to small, one
    layer at a time (GroupNorm(G): G units; none passes: 1 unit, e.g. LayerNorm). A network without any
    invariant layer costs up to 2L − 1 evaluations.

    Args:
        outputs_of: what training computes given tensors that replace the named ones (e.g. the loss and
            the model's outputs on the step's batch, flattened); called without gradients.
        layers: ``{layer: (weight key, weight, bias key or None, bias or None)}`` (weight: (out, ...)).
        rtol: the relative tolerance (default :data:`SCALE_INVARIANCE_RTOL`).
        seed: seed of the factors c_u (a private generator; the global RNG is not touched).
        agree: maps each local verdict to the one every process uses (under DDP: passed only if it
            passed on every rank, so that all ranks run the same evaluations); default: identity.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        reference = outputs_of({}).double()
        bound = rtol * float(reference.abs().max())

        def unchanged(split: dict[str, int]) -> bool:
            """Whether scaling the ``split[layer]`` units of every listed layer leaves the outputs unchanged."""
            replaced: dict[str, Tensor] = {}
            for name, units in split.items():
                key_w, w, key_b, b = layers[name]
                c = torch.rand(units, generator=gen, dtype=torch.float64) * 1.5 + 0.5
                c = c.repeat_interleave(w.shape[0] // units).to(w.device)
                replaced[key_w] = w * c.view(-1, *[1] * (w.dim() - 1)).to(w.dtype)
                if b is not None and key_b is not None:
                    replaced[key_b] = b * c.to(b.dtype)
            ok = float((outputs_of(replaced).double() - reference).abs().max()) <= bound
            return agree(ok) if agree is not None else ok

        def passing(names: list[str], units: Callable[[str], int]) -> list[str]:
            """The layers of ``names`` whose split ``units(layer)`` is invariant, by bisection."""
            if not names or unchanged({n: units(n) for n in names}):
                return names
            if len(names) == 1:
                return []
            half = len(names) // 2
            return passing(names[:half], units) + passing(names[half:], units)

        def out(name: str) -> int:
            return int(layers[name][1].shape[0])

        invariant = passing(list(layers), lambda name: 1)
        per_unit = set(passing(invariant, out))
        found: dict[str, int] = {}
        for name in invariant:
            if name in per_unit:
                found[name] = out(name)
                continue
            divisors = [d for d in range(out(name) - 1, 1, -1) if out(name) % d == 0]
            found[name] = next((d for d in divisors if unchanged({name: d})), 1)
    return found


def weight_norm_and_grad_cosine(
    weight: Tensor, bias: Tensor | None, grad_w: Tensor, grad_b: Tensor | None
) -> tuple[float, float]:
    """(‖θ‖², cos∠(θ, ∇_θ L)) of a layer's θ = (W, b), in float64 (paper 002: for scale-invariant θ,
    ⟨θ, ∇_θ L⟩ = 0 (Lemma 2.4), so SGD's ‖θ‖² only grows, ‖θ_{t+1}‖² = ‖θ_t‖² + η²‖∇L‖²). The cosine is
    NaN when θ or the gradient is zero."""
    theta = [weight.detach().double().reshape(-1)] + ([bias.detach().double()] if bias is not None else [])
    grads = [grad_w.detach().double().reshape(-1)] + ([grad_b.detach().double()] if grad_b is not None else [])
    t, g = torch.cat(theta), torch.cat(grads)
    norms = float(t.norm() * g.norm())
    return float(t @ t), float(t @ g) / norms if norms > 0 else math.nan


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
