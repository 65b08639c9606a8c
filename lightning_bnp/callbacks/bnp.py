"""Batch Normalization Preconditioning as a Lightning callback (paper 000, §3.3 eq. 15, §4 eq. 23).

A thin adapter over :class:`lightning_bnp.core.BNPPreconditioner`: it decides *when* the core runs.

When. Lightning calls ``on_after_backward`` after every backward (once per micro-batch under
``accumulate_grad_batches``, and under 16-bit AMP before the gradients are unscaled), whereas
``on_before_optimizer_step`` runs exactly once per optimizer step, after gradient accumulation,
after DDP's all-reduce and after AMP unscaling, and before gradient clipping. The transform
therefore runs in ``on_before_optimizer_step``, on the layers the stepping optimizer owns
(several optimizers and manual optimization work the same way). Clipping then acts on the
preconditioned gradient, which is the one the optimizer uses; in manual optimization, where the
``training_step`` clips before ``opt.step()``, ``self.clip_gradients(opt, …)`` runs BNP's step for
``opt`` first (``callbacks/_manual.py``). A fit that raises detaches BNP (``on_exception``).

Where. The callback builds the preconditioner at ``on_fit_start``: Lightning calls every callback's ``setup``
before the LightningModule's own ``setup`` (where adapters such as LoRA may be injected) and ``configure_model``,
then the strategy's setup (which builds the optimizers); at ``on_fit_start`` every layer the user builds exists,
and no forward has run. A layer made later (given to an optimizer with ``add_param_group``) is named in a warning
at the first step of that optimizer (``core/late_layers.py``).

Skipped steps. The running statistics computed in a step are committed from the optimizer's
step post-hook (``BNPPreconditioner.step(optimizer)``), which PyTorch runs only when
``optimizer.step`` really happens: a step the ``GradScaler`` skips for non-finite gradients leaves
the statistics untouched. A micro-batch whose ``training_step`` returns ``None`` after its forward
adds no statistics (they count once a backward reaches the layer's output and accumulates its weight's
gradient), and a NaN/Inf sample never enters the running statistics (the core's module docstring).

Helpers: which strategies are supported in :mod:`._strategy`; what BNP reads of the data (the last step's
rows, token masks, the example input of lazy layers) in :mod:`._batches`.

.. math::
    G_w[i, j] \\leftarrow \\frac{G_w[i, j] - μ_j G_b[i]}{q^2 \\tilde σ_j^2}, \\qquad
    G_b[i] \\leftarrow \\frac{G_b[i]}{q^2} - \\sum_j μ_j G_w[i, j]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Optional, Protocol, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_bnp.callbacks._batches import check_last_step_has_rows, materialize_lazy_layers, token_mask_of
from lightning_bnp.callbacks._manual import PreconditionBeforeClipping
from lightning_bnp.callbacks._strategy import check_strategy
from lightning_bnp.core.arguments_repr import ArgumentsRepr
from lightning_bnp.core.preconditioner import (
    DEFAULT_LAYER_TYPES,
    BNPPreconditioner,
    BNPWarning,
    validate_bnp_arguments,
)
from lightning_bnp.core.validation import check_bool, check_patterns

__all__ = ["BatchNormPreconditioning", "StepRegularizer"]


class StepRegularizer(Protocol):
    """What BNP calls around its transform (``ZSpaceRegularization`` registers itself at setup)."""

    def before_precondition(self, optimizer: Optimizer) -> None: ...

    def after_precondition(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer, pre: BNPPreconditioner
    ) -> None: ...


class BatchNormPreconditioning(ArgumentsRepr, Callback):
    """Precondition the gradients of Linear/ConvNd layers with BNP (Lange, Helfrich & Ye, 2022).

    Args:
        rho: running-average factor ρ ∈ [0, 1) (paper: 0.99).
        eps1: ε1 > 0 in σ̃² = σ² + ε1·max(σ²) + ε2 (paper: 1e-2).
        eps2: ε2 > 0 (paper: 1e-4).
        statistics: ``"running"`` (the paper's Alg. 2/3) or ``"batch"`` (this step's statistics;
            an error for a dense layer that sees one sample).
        bias_correction: ``False`` (default) starts the running averages from the paper's μ = 0,
            σ² = 1, exactly Alg. 2/3; ``True`` divides them by 1 − ρ^t (Adam-style) so that P uses the
            data's statistics from the first step (see the README and ``benchmarks/RESULTS.md`` §5 for
            the evidence behind the default).
        layer_types: layer kinds to manage, from ``Linear`` (with its family: GPT-2's ``transformers.Conv1D``),
            ``Conv1d``, ``Conv2d``, ``Conv3d`` (each with its family: ``ConvTranspose{1,2,3}d``; default: all four;
            ``None`` means the same) and any name registered
            with ``lightning_bnp.register_layer_kind``.
        include: glob patterns of module names to manage (default: every layer of those types); a
            bare string is one pattern (``include: net.0`` in YAML means ``["net.0"]``).
        exclude: glob patterns of module names to leave alone (a bare string is one pattern).
        sync_statistics: under DDP, pool each step's statistics over all ranks (one collective)
            so that every rank applies the same preconditioner to the all-reduced gradient.
        verbose: at fit start, say on rank zero which layers BNP manages (one line), and, when it leaves some of
            the model's weight matrices alone, how many it transforms and which it does not, with the reason
            (``BNPPreconditioner.report()``, ``.skipped``).
        conv_statistics: a convolution's μ, σ² per input channel (``"channel"``, the default: eqs. 21–22,
            the paper's implementation of Alg. 3, one value per channel repeated over the kernel offsets) or
            exactly per im2col column (``"column"``: eqs. 19–20, one value per input channel and kernel
            offset over the patches that offset sees, padding zeros included; Alg. 2 applied to the unfolded
            input, with Alg. 3's q²). ``"column"`` matters where feature maps are small next to the kernel
            (Prop. 10); README "What it computes" and ``benchmarks/RESULTS.md`` §6 give its accuracy and cost.
        token_mask: where a training batch carries its token mask (True or nonzero = a real token, as Hugging
            Face's ``attention_mask``): a key of a dict batch (or an attribute of the batch), or a function of the
            batch that returns the mask (or ``None``). The callback sets it on the preconditioner for that batch's
            forward (:meth:`BNPPreconditioner.set_token_mask`): μ, σ² and N of the managed layers are then those
            of the real tokens only (README "Transformers").
        token_mask_layers: glob patterns of the layers the token mask applies to (default: all), e.g.
            ``"encoder.*"`` to leave out a head that sees one pooled row per sequence.
        compile_step: run the tensor work of every step (statistics update and gradient transform) as one
            ``torch.compile(fullgraph=True)`` graph (:meth:`BNPPreconditioner.compile_step`); for models that
            are compiled themselves (the example projects turn it on with ``--model.compile=true``).
        embeddings: also precondition every ``nn.Embedding`` (a bias-free Linear on one-hot inputs: σ² each
            token's frequency, q² = max(V/N, 1); ``padding_idx`` positions not counted). Off by default; in
            YAML ``embeddings: true``. README "Embeddings".

    Raises:
        TypeError: an argument of the wrong type (e.g. ``rho="0.9"``, ``sync_statistics="false"``).
        ValueError: an argument is out of range or not finite, or (at fit start) a pattern matches no layer, or
            the model has uninitialised lazy layers and no ``example_input_array`` to materialize them.
        RuntimeError: (at setup) an unsupported strategy; (at fit start) LBFGS, or a layer whose weight
            and bias are in different optimizers. Lightning itself refuses a second instance on one
            Trainer (one ``state_key``), which would transform the gradients twice.

    Example::

        trainer = Trainer(callbacks=[BatchNormPreconditioning()])
    """

    _repr_if_set = ("conv_statistics", "compile_step", "embeddings", "token_mask", "token_mask_layers")

    def __init__(
        self,
        *,
        rho: float = 0.99,
        eps1: float = 1e-2,
        eps2: float = 1e-4,
        statistics: Literal["running", "batch"] = "running",
        bias_correction: bool = False,
        layer_types: Union[list[str], str, None] = list(DEFAULT_LAYER_TYPES),  # noqa: B006  # shown by --print_config
        include: Union[list[str], str, None] = None,
        exclude: Union[list[str], str, None] = None,
        sync_statistics: bool = True,
        verbose: bool = True,
        conv_statistics: Literal["channel", "column"] = "channel",
        compile_step: bool = False,
        embeddings: bool = False,
        token_mask: Union[str, Callable[[Any], Optional[Tensor]], None] = None,
        token_mask_layers: Union[list[str], str, None] = None,
    ) -> None:
        self.compile_step = check_bool("compile_step", compile_step)
        if token_mask is not None and not isinstance(token_mask, str) and not callable(token_mask):
            raise TypeError(
                f"`token_mask` must be a batch key (str), a function of the batch, or None, got {token_mask!r}"
            )
        self.token_mask = token_mask
        self.token_mask_layers = check_patterns("token_mask_layers", token_mask_layers)
        self.layer_types, include, exclude = validate_bnp_arguments(
            rho,
            eps1,
            eps2,
            statistics,
            bias_correction=bias_correction,
            layer_types=DEFAULT_LAYER_TYPES if layer_types is None else layer_types,
            include=include,
            exclude=exclude,
            sync_statistics=sync_statistics,
            conv_statistics=conv_statistics,
            embeddings=embeddings,
        )
        self.embeddings = embeddings
        self.rho, self.eps1, self.eps2 = rho, eps1, eps2
        self.conv_statistics: Literal["channel", "column"] = conv_statistics
        self.statistics: Literal["running", "batch"] = statistics
        self.bias_correction = bias_correction
        self.include, self.exclude = include, exclude
        self.sync_statistics = sync_statistics
        self.verbose = check_bool("verbose", verbose)
        self.preconditioner: BNPPreconditioner | None = None
        self._model: torch.nn.Module | None = None
        self._loaded_state: dict[str, Any] | None = None
        self._state_restored = False  # whether this fit's checkpoint held BNP state
        self._attached_this_fit = False  # `_attach` ran since this fit's `setup`
        self.regularizer: StepRegularizer | None = None  # set by ZSpaceRegularization.setup
        self._clipping = PreconditionBeforeClipping(self._precondition)  # manual optimization (callbacks/_manual.py)

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._check_strategy(trainer)
        self._state_restored = False
        self._attached_this_fit = False
        if not is_overridden("configure_model", pl_module):
            materialize_lazy_layers(pl_module)  # before the strategy wraps the model (DDP refuses lazy parameters)
        # BNP attaches at `on_fit_start`: Lightning calls the LightningModule's own `setup` (adapters injected
        # there) and `configure_model` after every callback's `setup` (Trainer._run), then the strategy's setup,
        # which builds the optimizers; every layer the user builds exists then, before the first forward

    def _attach(self, pl_module: pl.LightningModule) -> BNPPreconditioner:
        """Build the preconditioner on the model's layers (once per model) and attach it, once per fit; the
        callbacks that need it (monitors) call this from their own ``on_fit_start``, whatever the order."""
        if self.preconditioner is not None and self._model is pl_module and self._attached_this_fit:
            return self.preconditioner
        if self.preconditioner is None or self._model is not pl_module:
            materialize_lazy_layers(pl_module)
            self.preconditioner = BNPPreconditioner(
                pl_module,
                rho=self.rho,
                eps1=self.eps1,
                eps2=self.eps2,
                statistics=self.statistics,
                bias_correction=self.bias_correction,
                layer_types=self.layer_types,
                include=self.include,
                exclude=self.exclude,
                sync_statistics=self.sync_statistics,
                conv_statistics=self.conv_statistics,
                embeddings=self.embeddings,
            )
            self._model = pl_module
            if self.verbose:
                names = list(self.preconditioner.layers)
                report = "" if not self.preconditioner.skipped else f"; {self.preconditioner.report()}"
                rank_zero_info(f"BatchNormPreconditioning: BNP manages {len(names)} layers: {names}{report}")
        self.preconditioner.attach()
        self._attached_this_fit = True
        if self._loaded_state is not None:
            state, self._loaded_state = self._loaded_state, None  # (a state refused once is not tried again)
            self._load(state)
        return self.preconditioner

    def _load(self, state: dict[str, Any]) -> None:
        """Load a checkpoint's BNP state into the preconditioner; an error also says how to resume without it."""
        assert self.preconditioner is not None
        try:
            self.preconditioner.load_state_dict(state)
        except ValueError as err:
            raise ValueError(
                f"{err} Under the Trainer, the BNP state is the checkpoint's `['callbacks'][{self.state_key!r}]`: "
                "delete that entry (torch.load, del, torch.save) to resume without it; the statistics then start "
                "fresh (μ = 0, σ² = 1, step 0), with a warning."
            ) from None

    @staticmethod
    def _check_strategy(trainer: pl.Trainer) -> None:
        check_strategy(trainer.strategy)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._attach(pl_module)
        assert self.preconditioner is not None
        self._clipping.install(pl_module)
        owners: dict[int, int] = {}
        for index, optimizer in enumerate(trainer.optimizers):
            if isinstance(optimizer, torch.optim.LBFGS):
                raise RuntimeError(
                    "BatchNormPreconditioning cannot be used with LBFGS: LBFGS evaluates the closure "
                    "several times per step and its line search assumes unmodified gradients."
                )
            for group in optimizer.param_groups:
                owners.update({id(p): index for p in group["params"]})
        for name, layer in self.preconditioner.layers.items():
            weight, bias = layer.weight, layer.bias
            if id(weight) not in owners:
                if weight.requires_grad:
                    rank_zero_warn(
                        f"BNP layer {name!r} is trainable but in no optimizer; its statistics are "
                        "computed and never used. Exclude it with `exclude`."
                    )
                continue
            if bias is not None and owners.get(id(bias)) != owners[id(weight)]:
                raise RuntimeError(
                    f"layer {name!r} has its weight and bias in different optimizers; BNP couples them "
                    "(eq. 15). Put both in one optimizer or exclude the layer with `exclude`."
                )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # here, not at `on_fit_start`: some strategies (ModelParallelStrategy) restore callbacks after it
        if trainer.ckpt_path is not None and not self._state_restored:
            # Lightning calls `load_state_dict` only for a callback whose state the checkpoint holds
            rank_zero_warn(
                f"BatchNormPreconditioning: the checkpoint {str(trainer.ckpt_path)!r} holds no BNP state (written "
                "without this callback, or with `save_weights_only`), so the running statistics start fresh "
                "(μ = 0, σ² = 1, step 0) in the middle of training.",
                category=BNPWarning,
            )
        if self.statistics == "batch":
            assert self.preconditioner is not None
            check_last_step_has_rows(trainer, self.preconditioner)

    # ------------------------------------------------------------------ token masks
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._clipping.new_batch()
        if self.token_mask is None or self.preconditioner is None:
            return
        self.preconditioner.set_token_mask(token_mask_of(self.token_mask, batch), layers=self.token_mask_layers)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.token_mask is not None and self.preconditioner is not None:
            self.preconditioner.set_token_mask(None)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning calls no `teardown` after an exception: detach here, so that the crashed fit's statistics are
        # dropped and the next fit (with this callback or another) attaches afresh
        if self.preconditioner is not None:
            self.preconditioner.set_token_mask(None)
        self.teardown(trainer, pl_module, "fit")

    # ------------------------------------------------------------------- step
    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if not self._clipping.ran_early(optimizer):  # (manual optimization: at `self.clip_gradients`)
            self._precondition(trainer, pl_module, optimizer)

    def _precondition(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer) -> None:
        """BNP's step for the layers ``optimizer`` owns, with the regularizer's terms around it."""
        assert self.preconditioner is not None
        if self.compile_step and not self.preconditioner.step_compiled:
            self.preconditioner.compile_step()
        if self.regularizer is not None:
            self.regularizer.before_precondition(optimizer)
        self.preconditioner.step(optimizer)  # commits when optimizer.step() really runs
        if self.regularizer is not None:  # z-space terms need this step's M
            self.regularizer.after_precondition(trainer, pl_module, optimizer, self.preconditioner)

    # --------------------------------------------------------------- teardown
    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self.preconditioner is not None:
            self.preconditioner.detach()
        self._clipping.remove()
        self._attached_this_fit = False

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        if self.preconditioner is not None and self._loaded_state is None:
            return self.preconditioner.state_dict()
        return dict(self._loaded_state or {})  # loaded, not applied yet

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning restores callbacks after `setup` (and after `on_fit_start` under ModelParallelStrategy); kept
        # for `_attach` when the layers may not exist yet (built in `configure_model`, or a new model)
        if self.preconditioner is not None and self._attached_this_fit:
            self._load(state_dict)
        else:
            self._loaded_state = state_dict
        self._state_restored = True
