"""The Hessian-block measurement of experiment 2 (paper 000 §5.1, Fig. 8), taken inside a training step."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.func import functional_call

from lightning_bnp.core import BNPPreconditioner
from lightning_bnp.core import metrics as M

DEAD = 1e-12  # a unit whose batch variance is at most this is dead (ReLU off on every row)


def hessian_kappa(net: nn.Module, pre: BNPPreconditioner, loss_fn: nn.Module, x: Tensor, y: Tensor) -> dict[str, float]:
    """κ of ∇²L with respect to the last layer's first neuron ŵ = [b₀, w₀] on the batch (x, y), in float64.

    Call it after ``pre.step()`` (so that BNP's μ and σ̃² of this step are known) and before the update.

    Returns:
        original: κ(∇²L).
        preconditioned: κ(Pᵀ∇²L P) with the P BNP applied in this step (running μ, σ̃² with ε floors).
        batch_preconditioned: κ(P₀ᵀ∇²L P₀) with the theory's P₀ (§3, eq. 12): the batch's own μ and σ of
            the layer's input, no ε floors, over the live units (dead units' rows and columns of ∇²L are
            zero and drop out).
        kappa_D_floored: κ(D̃) = max σ̃ / min σ̃, what BNP divides by (``ConditionNumberMonitor``'s
            ``bnp/kappa_D_floored``).
        kappa_D_raw: max σ_H / min σ_H of the batch over the live units (the monitor's ``bnp/kappa_D`` is
            the paper's D with its bias entry and BNP's running σ, so it can differ).
        dead: how many of the layer's input units are dead on this batch.
    """
    assert isinstance(net, nn.Sequential)
    name, layer = list(pre.layers.items())[-1]
    transform = layer.transform
    assert transform is not None and transform.mu is not None
    params = {k: v.detach().double() for k, v in net.named_parameters()}
    x64 = x.double()

    def loss_of(replaced: dict[str, Tensor]) -> Tensor:
        return loss_fn(functional_call(net, {**params, **replaced}, (x64,)), y)

    block = M.NeuronBlock(f"{name}.weight", params[f"{name}.weight"], f"{name}.bias", params[f"{name}.bias"], 0)
    with pre.paused():
        (h,) = M.neuron_hessians(loss_of, [block])
        with torch.no_grad():  # the layer's input on this batch, in float64: everything before it
            front = net[: int(name)]
            inputs = functional_call(front, {k: params[k] for k, _ in front.named_parameters()}, (x64,))
    p = M.neuron_preconditioner(transform.mu, transform.var_t)
    var_h = inputs.var(0, unbiased=False)
    live = var_h > DEAD
    keep = torch.cat([live.new_ones(1), live])  # the bias and the live units
    h_live = h[keep][:, keep]
    p0 = M.neuron_preconditioner(inputs[:, live].mean(0), var_h[live])
    return {
        "original": M.spectrum(h).kappa,
        "preconditioned": M.spectrum(p.T @ h @ p).kappa,
        "batch_preconditioned": M.spectrum(p0.T @ h_live @ p0).kappa if live.any() else math.nan,
        "kappa_D_floored": M.sigma_ratio(transform.var_t),
        "kappa_D_raw": M.sigma_ratio(var_h[live]) if live.any() else math.nan,
        "dead": float((~live).sum()),
    }
