"""Weight Conditioning as a Lightning callback (paper 004, §4, §5.1 eq. 16, §6.1).

A thin adapter over :func:`lightning_bnp.core.conditioning.apply_weight_conditioning`: at ``setup``
(every stage) it registers an :class:`~lightning_bnp.core.conditioning.Equilibration`
parametrization on the ``weight`` of the selected layers, so the forward pass uses the equilibrated
weight while the free parameter ``parametrizations.weight.original`` is what the optimizer updates.

When. Lightning calls ``Callback.setup`` before ``LightningModule.setup``, before restoring a
checkpoint into the model and before the strategy wraps the model (DDP) and builds the optimizers
(``Trainer._run``). The optimizer therefore holds ``original``, and a checkpoint saved with the
callback (keys ``….parametrizations.weight.original``) loads back into the same callback setup.
Layers created later, in ``configure_model``, are refused at ``on_fit_start`` with that reason (there is no
callback hook between ``configure_model``, the checkpoint load and the optimizer).

Idempotent. Applying the same setup again (a second ``fit``, ``validate``/``test`` after ``fit``) is
a no-op; a selected layer already equilibrated with another ``mode``/``eps`` is refused.

.. math::
    W_{\\text{row}} = E_r W,\\qquad W_{\\text{col}} = W E_c,\\qquad
    W_{\\text{row-col}} = (E_r W)\\, E_c(E_r W),\\qquad E = \\operatorname{diag}(1/\\|\\cdot\\|_2)

(a factor is 1 for a vector of norm ≤ ε)

with the paper's W = ``weight.T`` (n_in, n_out): paper rows are PyTorch columns.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any, Literal, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from typing_extensions import override

from lightning_bnp.callbacks._strategy import holds_full_replica, spawns_workers
from lightning_bnp.core.arguments_repr import ArgumentsRepr
from lightning_bnp.core.conditioning import (
    DEFAULT_EPS,
    DEFAULT_LAYER_TYPES,
    apply_weight_conditioning,
    bake_weight_conditioning,
    conditioned_layers,
    validate_conditioning_arguments,
    zero_norm_count,
)
from lightning_bnp.core.validation import check_bool

__all__ = ["WeightConditioning"]

_CONFIGURE_MODEL = (
    "Lightning calls `configure_model` after every callback's `setup` and then, with no callback hook in "
    "between, loads the checkpoint into the model and builds the optimizer; the parametrization must exist "
    "before both (checkpoint keys `….parametrizations.weight.original`), so WeightConditioning cannot "
    "condition layers built there. Build them in `__init__`, or call "
    "`lightning_bnp.core.conditioning.apply_weight_conditioning(self, ...)` at the end of `configure_model` "
    "instead of using this callback"
)


class WeightConditioning(ArgumentsRepr, Callback):
    """Equilibrate the weights of Linear/ConvNd layers (Saratchandran, Wang & Lucey, paper 004).

    Args:
        mode: ``"row"`` (paper E·W, the paper's choice: unit 2-norm per *input* feature = per
            column of PyTorch's (out, in·k) weight), ``"column"`` (paper W·E: unit norm per output
            neuron = per PyTorch row) or ``"row_column"`` (row, then column of the result).
        layers: ``"all"`` selected layers, or ``"first_and_last"``: the first and the last of them in
            ``named_modules()`` order (the paper's CNN recipe, §6.1: first convolution and last dense
            layer).
        layer_types: layer classes to consider, from ``Linear``, ``Conv1d``, ``Conv2d``, ``Conv3d``
            (default: all four; ``None`` means the same).
        include: glob patterns of module names to consider (default: every layer of those types); a
            bare string is one pattern (``include: net.0`` in YAML means ``["net.0"]``).
        exclude: glob patterns of module names to leave alone (a bare string is one pattern).
        eps: ε > 0: vectors of norm ≤ ε (all-zero ones) are left as they are, with an identity
            Jacobian, so their gradient is unscaled; all others get unit norm.
        verbose: at setup, say on rank zero which layers are conditioned (one line).

    Raises:
        TypeError: an argument of the wrong type (e.g. ``eps="1e-12"``, ``include=3``).
        ValueError: an argument is invalid or not finite; (at setup) a pattern matches no layer, nothing is selected,
            or a layer is already equilibrated differently; (on checkpoint load) the checkpoint was
            written with another ``mode`` or other layers.
        RuntimeError: (at setup) an unsupported strategy or launcher.

    Example::

        trainer = Trainer(callbacks=[WeightConditioning(layers="first_and_last")])
        trainer.fit(model)
        WeightConditioning.bake(model)  # plain modules for inference, same outputs
    """

    def __init__(
        self,
        *,
        mode: Literal["row", "column", "row_column"] = "row",
        layers: Literal["all", "first_and_last"] = "all",
        layer_types: Union[list[str], str, None] = list(DEFAULT_LAYER_TYPES),  # noqa: B006  # shown by --print_config
        include: Union[list[str], str, None] = None,
        exclude: Union[list[str], str, None] = None,
        eps: float = DEFAULT_EPS,
        verbose: bool = True,
    ) -> None:
        self.layer_types, include, exclude = validate_conditioning_arguments(
            mode, layers, eps, DEFAULT_LAYER_TYPES if layer_types is None else layer_types, include, exclude
        )
        self.mode: Literal["row", "column", "row_column"] = mode
        self.layers: Literal["all", "first_and_last"] = layers
        self.include, self.exclude = include, exclude
        self.eps = eps
        self.verbose = check_bool("verbose", verbose)
        self.conditioned: list[str] = []  # names of the layers this callback conditions
        self._loaded_state: dict[str, Any] | None = None
        self._modules_at_setup: set[int] = set()

    @staticmethod
    def bake(model: torch.nn.Module) -> list[str]:
        """Bake the conditioned weights into plain parameters for inference (after ``fit``).

        Same as :func:`lightning_bnp.core.conditioning.bake_weight_conditioning`: afterwards no layer
        of ``model`` is parametrized, its outputs are unchanged and its ``state_dict`` has plain
        ``weight`` keys. Do not ``fit`` the baked model again with this callback expecting a resume:
        the callback would condition the (already equilibrated) weights afresh.

        Returns:
            the names of the baked modules.

        Example::

            trainer.fit(model)
            WeightConditioning.bake(model)
            torch.save(model.state_dict(), "plain.pt")
        """
        return bake_weight_conditioning(model)

    def __getstate__(self) -> dict[str, Any]:
        # pickle / deepcopy: not the model's `log`/`log_dict` that Lightning attaches to every callback at fit
        # (a parametrized model pickles only through its state_dict); Lightning attaches them again at each fit
        return {k: v for k, v in self.__dict__.items() if k not in ("log", "log_dict")}

    @property
    @override
    def state_key(self) -> str:
        # several instances (e.g. rows on convolutions, columns on dense layers) may coexist; the mode
        # is left out so that a checkpoint written with another mode is found, and refused, on load
        return self._generate_state_key(
            layers=self.layers, layer_types=self.layer_types, include=self.include, exclude=self.exclude
        )

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._check_strategy(trainer)
        before = set(conditioned_layers(pl_module))
        # layers that `configure_model` builds later (Lightning calls it after every callback's `setup`) are
        # refused at `on_fit_start`: the modules that exist now are the ones this callback can condition
        self._modules_at_setup = {id(m) for m in pl_module.modules()}
        try:
            selected = apply_weight_conditioning(
                pl_module,
                mode=self.mode,
                layers=self.layers,
                layer_types=self.layer_types,
                include=self.include,
                exclude=self.exclude,
                eps=self.eps,
            )
        except ValueError as err:
            if not is_overridden("configure_model", pl_module):
                raise
            raise ValueError(f"{err}. {_CONFIGURE_MODEL}") from None
        self.conditioned = list(selected)
        if self._loaded_state is not None:
            state, self._loaded_state = self._loaded_state, None
            self._check_loaded(state)
        new = [name for name in selected if name not in before]
        if not new:
            return  # already conditioned: a second fit, or validate/test after fit
        if self.verbose:
            rank_zero_info(f"WeightConditioning: {self.mode} equilibration of {len(new)} layers: {new}")
        for name in new:
            original = selected[name].parametrizations.weight.original  # type: ignore[union-attr]
            zeros = zero_norm_count(original, self.mode, self.eps)  # type: ignore[arg-type]
            if zeros:
                rank_zero_warn(
                    f"WeightConditioning: layer {name!r} has {zeros} all-zero weight vectors (e.g. zero "
                    "initialisation); they output 0 until an optimizer step gives them a nonzero gradient, "
                    "which they receive unscaled, and are unit vectors from then on."
                )

    @staticmethod
    def _check_strategy(trainer: pl.Trainer) -> None:
        strategy = trainer.strategy
        if not holds_full_replica(strategy):
            raise RuntimeError(
                f"WeightConditioning does not support the {type(strategy).__name__} strategy (untested with "
                "sharded or XLA parameters; under ModelParallelStrategy the layers are built in `configure_model`, "
                "after this callback's setup). Supported: a single device, and DDP with strategy='ddp'."
            )
        if spawns_workers(strategy):
            raise RuntimeError(
                "WeightConditioning does not support spawn/fork launchers ('ddp_spawn', 'ddp_fork', "
                "'ddp_notebook'): the parametrization is registered in the worker processes, so the main "
                "process's model cannot load the trained state back. Use strategy='ddp'."
            )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        later = [
            name
            for name, m in pl_module.named_modules()
            if isinstance(m, (torch.nn.Linear, torch.nn.modules.conv._ConvNd))
            and id(m) not in self._modules_at_setup
            and (self.include is None or any(fnmatchcase(name, p) for p in self.include))
            and not any(fnmatchcase(name, p) for p in self.exclude or ())
        ]
        if later:
            message = f"WeightConditioning: layers {later} were built in `configure_model`. {_CONFIGURE_MODEL}"
            raise RuntimeError(message)
        optimized = {id(p) for opt in trainer.optimizers for group in opt.param_groups for p in group["params"]}
        modules = dict(pl_module.named_modules())
        for name in self.conditioned:
            original: torch.Tensor = modules[name].parametrizations.weight.original
            if original.requires_grad and id(original) not in optimized:
                rank_zero_warn(
                    f"WeightConditioning: {name}.parametrizations.weight.original is trainable but in no "
                    "optimizer; build optimizers from `self.parameters()` (`module.weight` is now computed)."
                )

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        # the weights live in the model's state_dict; this is what must match when it is loaded
        return {"mode": self.mode, "eps": self.eps, "layers": list(self.conditioned)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning restores callbacks after `setup` (and after the model, whose keys then already
        # match); loaded earlier, the check waits for setup
        if self.conditioned:
            self._check_loaded(state_dict)
        else:
            self._loaded_state = state_dict

    def _check_loaded(self, state: dict[str, Any]) -> None:
        # row and column conditioning have the same state_dict keys: a silent mismatch would load
        # the weights into another function
        if state["mode"] != self.mode or state["layers"] != self.conditioned:
            raise ValueError(
                f"checkpoint was written with WeightConditioning(mode={state['mode']!r}) on layers "
                f"{state['layers']}, but this one uses mode={self.mode!r} on {self.conditioned}"
            )
        if state["eps"] != self.eps:
            rank_zero_warn(f"WeightConditioning: checkpoint used eps={state['eps']:g}, now eps={self.eps:g}")
