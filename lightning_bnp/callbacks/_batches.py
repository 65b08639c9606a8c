"""What BatchNormPreconditioning reads of the data: the rows of a step, a batch's token mask, an example input.

BNP's statistics are those of "the batch" of a step, N rows (paper 000, §3.3, Alg. 2/3); these helpers decide
what the rows are and whether a step has enough of them:

* :func:`check_last_step_has_rows` — ``statistics="batch"`` needs N > 1 rows in a dense layer, which a last
  batch of one sample breaks only at the end of the first epoch: refused at the start instead;
* :func:`token_mask_of` — the mask of a batch's real tokens (its padding is no row of the statistics);
* :func:`materialize_lazy_layers` — a model's lazy layers get their shapes (BNP sizes its statistics at
  setup) from the LightningModule's ``example_input_array``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import move_data_to_device
from torch import Tensor

from lightning_bnp.core.preconditioner import BNPPreconditioner
from lightning_bnp.core.reparametrization import lazy_names

__all__ = ["check_last_step_has_rows", "materialize_lazy_layers", "token_mask_of"]


def check_last_step_has_rows(trainer: pl.Trainer, pre: BNPPreconditioner) -> None:
    """``statistics="batch"`` refuses a step in which a dense layer sees one row; a last batch of one
    sample would hit that only at the end of the first epoch, so it is refused here, at the start.
    Checked for a map-style ``DataLoader`` with a batch sampler (others are only checked per step).

    Raises:
        ValueError: the last optimizer step of every epoch has one sample.
    """
    loader = trainer.train_dataloader
    batch_sampler = getattr(loader, "batch_sampler", None)
    batch_size, sampler = getattr(batch_sampler, "batch_size", None), getattr(batch_sampler, "sampler", None)
    if not isinstance(batch_size, int) or getattr(batch_sampler, "drop_last", True) or sampler is None:
        return
    if pre.pools_over_ranks or not any(layer.kind.dense for layer in pre.layers.values()):
        return  # pooled over ranks, or conv layers only (rows = batch × positions)
    samples, batches = len(sampler), trainer.num_training_batches
    if batches != -(-samples // batch_size):
        return  # limit_train_batches: the short batch is never reached
    last_step = (
        trainer.accumulate_grad_batches
        if batches % trainer.accumulate_grad_batches == 0
        else (batches % trainer.accumulate_grad_batches)
    )
    rows = (samples - (batches - 1) * batch_size) + (last_step - 1) * batch_size
    if rows == 1:
        raise ValueError(
            f"statistics='batch' needs more than one row per step, but the last step of every epoch has "
            f"one sample ({samples} samples, batch_size={batch_size}, drop_last=False): use "
            "DataLoader(..., drop_last=True), another batch size, or statistics='running'."
        )


def token_mask_of(key: Union[str, Callable[[Any], Optional[Tensor]], None], batch: Any) -> Tensor | None:
    """The token mask of a training ``batch``: ``key(batch)``, or its item or attribute ``key``.

    Raises:
        ValueError: the batch has no such key or attribute.
    """
    if callable(key):
        return key(batch)
    assert isinstance(key, str)
    if isinstance(batch, Mapping):
        if key not in batch:
            raise ValueError(f"`token_mask`={key!r}: the training batch has no such key; its keys are {list(batch)}")
        return batch[key]
    if not hasattr(batch, key):
        raise ValueError(
            f"`token_mask`={key!r}: the training batch ({type(batch).__name__}) has no such key or attribute; "
            "pass a function of the batch that returns the mask"
        )
    return getattr(batch, key)


def materialize_lazy_layers(pl_module: pl.LightningModule) -> None:
    """Run ``example_input_array`` through a model with uninitialised lazy layers (in eval mode, without a
    graph, as Lightning's ``ModelSummary`` does), so that BNP can size their statistics.

    Raises:
        ValueError: lazy layers and no ``example_input_array``, naming the layers.
    """
    lazy = lazy_names(dict(pl_module.named_modules()))
    if not lazy:
        return
    example = pl_module.example_input_array
    if example is None:
        raise ValueError(
            f"BatchNormPreconditioning: layers {lazy} are uninitialised lazy modules (e.g. nn.LazyLinear), whose "
            "shapes BNP needs at setup. Set `self.example_input_array` in the LightningModule (BNP then runs it "
            "through the model once at setup, as ModelSummary does), or run one forward pass before `fit`."
        )
    # at `setup` Lightning's `pl_module.device` already names the strategy's device, but the parameters are
    # still where they were built (the strategy moves them later): the example goes where they are
    held = next(pl_module.parameters(), None)
    example = move_data_to_device(example, held.device if held is not None else pl_module.device)
    mode = pl_module.training
    pl_module.eval()
    try:
        with torch.no_grad():
            if isinstance(example, (list, tuple)):
                pl_module(*example)
            elif isinstance(example, dict):
                pl_module(**example)
            else:
                pl_module(example)
    finally:
        pl_module.train(mode)
