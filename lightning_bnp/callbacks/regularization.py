"""Regularization in BNP's preconditioned variable z as a Lightning callback (paper 001, eqs. 9–12).

With p = P·z and M = (1/q²)·P·Pᵀ from BNP (identity for parameters BNP does not manage):

.. math::
    g \\leftarrow M∇L + 2λ_{wd}\\,p \\quad (\\text{decay in } z) \\qquad
    g \\leftarrow M(∇L + 2λ_{wd}\\,p) \\quad (\\text{L2 in } p)

    g \\leftarrow M∇L + 2λ_{gr}\\,M∇^2L\\,M∇L \\quad (\\text{gradient regularization in } z,\\ \\text{eq. 12}) \\qquad
    g \\leftarrow M(∇L + 2λ_{gr}\\,∇^2L\\,∇L) \\quad (\\text{in } p,\\ \\text{eq. 11})

With ``exclude_bias_and_norm=True`` decay in z is the gradient in z of λ‖z_w‖², z's weight coordinates
only: for a layer whose P has the centring block that is g_w += 2λw, g_b += −2λ·Σ_j μ_j w_j (per output
neuron), i.e. λ·q²·Σ_j σ̃²_j w_j² in p. (Adding 2λw alone, with nothing on the bias, is no gradient in z:
in z it is the field 2λ·[[0, μᵀσ̃⁻¹], [0, I]]·z, which is not symmetric.)

Cooperation with :class:`~lightning_bnp.BatchNormPreconditioning`: the terms need this step's M,
so when both callbacks are on the Trainer (in any order) this callback registers itself with BNP at
setup and BNP calls it right after its own transform, inside one ``on_before_optimizer_step``.
Without BNP, M = I and the callback acts on its own in that hook. Either way it runs once per
optimizer step on unscaled gradients (after accumulation and AMP unscaling, before clipping).

Gradient regularization re-runs ``training_step`` on the step's batches (every accumulated
micro-batch, with the RNG state each had, the loss divided as Lightning divides it; a micro-batch
whose ``training_step`` returns ``None`` is skipped, as Lightning skips its backward, and a step
without any gradient gets no term) to form ∇²L·v:
BNP statistics are paused and ``self.log`` is silenced meanwhile, so nothing is recorded twice;
under DDP the product is averaged over ranks. Metric objects updated inside ``training_step`` are
updated again by that re-run.
"""

from __future__ import annotations

from contextlib import ExitStack, nullcontext
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.seed import isolate_rng
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_bnp.callbacks._probes import Captured, silenced_logging
from lightning_bnp.callbacks._strategy import shards_rows
from lightning_bnp.callbacks.bnp import BatchNormPreconditioning
from lightning_bnp.core.arguments_repr import ArgumentsRepr
from lightning_bnp.core.preconditioner import BNPPreconditioner
from lightning_bnp.core.regularization import HVPMethod, all_reduce_mean_, hessian_vector_product, z_weight_decay_
from lightning_bnp.core.validation import check_bool, check_choice, check_float

__all__ = ["ZSpaceRegularization"]

_NORM_TYPES = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm)


class ZSpaceRegularization(ArgumentsRepr, Callback):
    """Weight decay and gradient regularization in BNP's preconditioned variable z.

    Args:
        weight_decay: λ_wd ≥ 0 of the decay term (0 turns it off).
        decay_space: ``"z"`` (the paper's recommendation: g = M∇L + 2λp) or ``"p"`` (L2 on the
            original parameters, for comparison: g = M(∇L + 2λp)).
        gradient_penalty: λ_gr ≥ 0 of the gradient regularization (0 turns it off).
        gradient_penalty_space: ``"z"`` (paper 001 eq. 12, R(z) = ‖∇_z L‖²: g = M∇L + 2λM∇²L·M∇L) or
            ``"p"`` (eq. 11 on the original parameters, R(p) = ‖∇_p L‖², preconditioned by M for comparison:
            g = M(∇L + 2λ∇²L·∇L)).
        hvp: how ∇²L·v is formed: ``"double_backprop"`` (exact; about two extra passes) or
            ``"finite_difference"`` (one extra forward/backward, reusing the step's gradient). The
            difference is only trustworthy for smooth activations: with ReLU, units that cross zero
            inside the perturbation dominate it (on the digits FC network its error against the exact
            product was 1.7× at ``fd_step=0.1`` and 22× at 1e-3, vs 0.1% with tanh).
        fd_step: norm of the parameter perturbation of the finite difference.
        exclude_bias_and_norm: do not decay biases or the parameters of normalization layers
            (BatchNorm/LayerNorm/GroupNorm), as is usual for weight decay. In z this decays z's weight
            coordinates only (λ‖z_w‖², see the module docstring: the bias gradient of a centred BNP layer
            then receives −2λ·Σ_j μ_j w_j); in p it is L2 on the weights, M(∇L + 2λw).

    Raises:
        TypeError: an argument of the wrong type (e.g. a string for a float, a non-bool flag).
        ValueError: an argument is out of range or not finite (``weight_decay=inf``), or both terms are off.
        RuntimeError: (at fit start) gradient regularization with manual optimization, or an
            optimizer that unscales AMP gradients inside ``step`` (decay would see scaled gradients).

    Example::

        Trainer(callbacks=[BatchNormPreconditioning(), ZSpaceRegularization(weight_decay=5e-4)])
    """

    def __init__(
        self,
        *,
        weight_decay: float = 0.0,
        decay_space: Literal["z", "p"] = "z",
        gradient_penalty: float = 0.0,
        gradient_penalty_space: Literal["z", "p"] = "z",
        hvp: Literal["finite_difference", "double_backprop"] = "double_backprop",
        fd_step: float = 1e-3,
        exclude_bias_and_norm: bool = True,
    ) -> None:
        weight_decay = check_float("weight_decay", weight_decay, low=0.0)
        gradient_penalty = check_float("gradient_penalty", gradient_penalty, low=0.0)
        if weight_decay == 0.0 and gradient_penalty == 0.0:
            raise ValueError("`weight_decay` and `gradient_penalty` are both 0: the callback would do nothing")
        check_choice("decay_space", decay_space, ("z", "p"))
        check_choice("gradient_penalty_space", gradient_penalty_space, ("z", "p"))
        check_choice("hvp", hvp, ("finite_difference", "double_backprop"))
        fd_step = check_float("fd_step", fd_step, low=0.0, low_open=True)
        check_bool("exclude_bias_and_norm", exclude_bias_and_norm)
        self.weight_decay, self.decay_space = weight_decay, decay_space
        self.gradient_penalty, self.fd_step = gradient_penalty, fd_step
        self.gradient_penalty_space = gradient_penalty_space
        self.hvp: HVPMethod = hvp
        self.exclude_bias_and_norm = exclude_bias_and_norm
        self._bnp: BatchNormPreconditioning | None = None
        self._no_decay: set[int] = set()
        self._batches: list[Captured] = []
        self._raw_grads: dict[int, Tensor] = {}

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.gradient_penalty > 0 and shards_rows(trainer.strategy):
            raise RuntimeError(
                "ZSpaceRegularization(gradient_penalty>0) is not supported under FSDP2 (ModelParallelStrategy): its "
                "Hessian-vector product re-runs `training_step` and differentiates through the sharded parameters, "
                "which is untested there. The weight decay (`weight_decay`) works; use gradient_penalty=0, or DDP."
            )
        bnps = [cb for cb in trainer.callbacks if isinstance(cb, BatchNormPreconditioning)]  # type: ignore[attr-defined]
        self._bnp = bnps[0] if bnps else None
        if self._bnp is not None:
            self._bnp.regularizer = self  # BNP calls `after_precondition` right after its transform

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # here, not at `setup`: layers built in `configure_model` (called after every callback's `setup`) exist now
        self._no_decay = set()
        if self.exclude_bias_and_norm:
            for module in pl_module.modules():
                for name, param in module.named_parameters(recurse=False):
                    # `in_proj_bias` of nn.MultiheadAttention is the q, k, v projections' bias (issue 24)
                    if name == "bias" or name.endswith("_bias") or isinstance(module, _NORM_TYPES):
                        self._no_decay.add(id(param))
        if self.gradient_penalty > 0 and not pl_module.automatic_optimization:
            raise RuntimeError(
                "ZSpaceRegularization(gradient_penalty>0) re-runs `training_step` to form the Hessian-vector "
                "product, which manual optimization (it steps inside `training_step`) does not allow. Use "
                "automatic optimization or set gradient_penalty=0."
            )
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        for optimizer in trainer.optimizers:
            if scaler is not None and getattr(optimizer, "_step_supports_amp_scaling", False):
                raise RuntimeError(
                    f"{type(optimizer).__name__} unscales AMP gradients inside `step`, so the regularization "
                    "would act on scaled gradients. Use a non-fused optimizer or bf16 precision."
                )
            decays = [group.get("weight_decay", 0.0) for group in optimizer.param_groups]
            if self.weight_decay > 0 and any(d > 0 for d in decays):
                rank_zero_warn(
                    f"{type(optimizer).__name__} has weight_decay={max(decays)} and ZSpaceRegularization has "
                    f"weight_decay={self.weight_decay}: parameters are decayed twice. Set one of them to 0."
                )

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self._bnp is not None:
            self._bnp.regularizer = None
        self._batches.clear()

    # ------------------------------------------------------------- the batch
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.gradient_penalty > 0:  # the RNG state the step's forward starts from (dropout masks)
            cuda = torch.cuda.get_rng_state(pl_module.device) if pl_module.device.type == "cuda" else None
            self._batches.append(Captured(batch, batch_idx, torch.get_rng_state(), cuda))

    # ------------------------------------------------------------------- step
    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if self._bnp is None:  # no BNP: M = I, act alone
            self.before_precondition(optimizer)
            self.after_precondition(trainer, pl_module, optimizer, None)

    def before_precondition(self, optimizer: Optimizer) -> None:
        """Keep ∇L(θ) before BNP overwrites it: the p-space penalty's vector and the finite difference's base."""
        if self.gradient_penalty > 0 and (self.hvp == "finite_difference" or self.gradient_penalty_space == "p"):
            self._raw_grads = {
                id(p): p.grad.detach().clone()
                for group in optimizer.param_groups
                for p in group["params"]
                if p.grad is not None
            }

    def after_precondition(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer, pre: BNPPreconditioner | None
    ) -> None:
        """Add the regularization terms to the gradients, which already hold M·∇L."""
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not params:  # e.g. `training_step` returned None: Lightning ran no backward, nothing to add to
            self._batches.clear()
            self._raw_grads = {}
            return
        transforms = pre.step_transforms(params) if pre is not None else {}

        def apply_m_(terms: dict[int, Tensor]) -> None:
            """terms ← M·terms, layer by layer (M = I elsewhere)."""
            for layer, transform in transforms.values():  # each on its rows (q, k, v blocks of one weight)
                vec_b = terms.get(id(layer.bias)) if layer.bias is not None else None
                transform.apply_(terms[id(layer.weight)], vec_b)

        extra: dict[int, Tensor] = {}
        if self.gradient_penalty > 0:
            # term = 2λ·M·∇²L·v with v = M∇L (in z, eq. 12) or v = ∇L (in p, eq. 11)
            raw = [self._raw_grads[id(p)] for p in params] if self._raw_grads else None
            self._raw_grads = {}
            vectors = raw if self.gradient_penalty_space == "p" and raw is not None else [p.grad for p in params]
            hv = self._hessian_vector_product(trainer, pl_module, params, vectors, raw, pre)
            extra = {id(p): h.mul_(2 * self.gradient_penalty) for p, h in zip(params, hv)}
            apply_m_(extra)
        self._batches.clear()
        if self.weight_decay > 0:
            # on the rows this rank holds (FSDP2 shards them: DTensor); M is row-local
            decay = {id(p): _local(p.detach()) * (2 * self.weight_decay) for p in params if id(p) not in self._no_decay}
            if self.decay_space == "z" and self.exclude_bias_and_norm:
                # ∇_z λ‖z_w‖² mapped to p: the undecayed bias coordinate of z still moves b by −2λ·μᵀw
                bias_terms: dict[int, Tensor] = {}
                for layer, transform in transforms.values():
                    bias, weight_id = layer.bias, id(layer.weight)
                    if weight_id in decay and transform.mu is not None and bias is not None and id(bias) not in decay:
                        # in the layer's (out, …) rows (a weight stored transposed, or a row block of a packed
                        # q/k/v weight: its kind's view), written to the matching rows of the bias
                        term = bias_terms.setdefault(id(bias), torch.zeros_like(_local(bias)))
                        transform.bias_rows(term).copy_(
                            z_weight_decay_(transform.rows(decay[weight_id]), transform.mu, transform.groups)
                        )
                decay.update(bias_terms)
            elif self.decay_space == "p":
                for layer, _ in transforms.values():  # an excluded bias still receives M's mixing of w
                    if layer.bias is not None and id(layer.bias) not in decay and layer.bias.grad is not None:
                        decay[id(layer.bias)] = torch.zeros_like(_local(layer.bias))
                apply_m_(decay)
            for key, term in decay.items():
                extra[key] = extra[key].add_(term) if key in extra else term
        for p in params:
            if id(p) in extra:
                _local(p.grad).add_(extra[id(p)])

    def _hessian_vector_product(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        params: list[Tensor],
        vectors: list[Tensor],
        raw: list[Tensor] | None,
        pre: BNPPreconditioner | None,
    ) -> list[Tensor]:
        batches = list(self._batches)
        accumulate = trainer.accumulate_grad_batches

        def loss_fn() -> Tensor:
            total = torch.zeros((), device=params[0].device)
            for captured in batches:
                torch.set_rng_state(captured.cpu_rng)  # same dropout masks as the step's forward
                if captured.cuda_rng is not None:
                    torch.cuda.set_rng_state(captured.cuda_rng, pl_module.device)
                with trainer.precision_plugin.train_step_context():
                    out = pl_module.training_step(captured.batch, captured.batch_idx)
                loss = out["loss"] if isinstance(out, dict) else out
                if loss is None:  # a skipped micro-batch: Lightning ran no backward for it, so it adds nothing
                    continue
                if not isinstance(loss, Tensor):
                    raise RuntimeError(
                        "ZSpaceRegularization(gradient_penalty>0) needs `training_step` to return the loss or None"
                    )
                total = total + loss / accumulate
            return total

        # ∇L(θ) of the training step (saved before M was applied) spares the finite difference a pass
        with ExitStack() as stack:
            stack.enter_context(pre.paused() if pre is not None else nullcontext())
            stack.enter_context(silenced_logging(pl_module))
            stack.enter_context(isolate_rng())  # the run's random streams (torch, CUDA, NumPy, Python) go on untouched
            return hessian_vector_product(
                loss_fn,
                params,
                [v.detach().clone() for v in vectors],
                method=self.hvp,
                grads_at_params=raw if self.hvp == "finite_difference" else None,
                fd_step=self.fd_step,
                reduce_=all_reduce_mean_,
            )


def _local(tensor: Tensor) -> Tensor:
    """The part of a tensor this rank holds: its local shard for a DTensor (FSDP2's ``fully_shard``: rows), else it."""
    to_local = getattr(tensor, "to_local", None)
    return tensor if to_local is None else to_local()
