"""Issue 24 item 3 through Lightning: ``BatchNormPreconditioning(token_mask="attention_mask")`` reads each training
batch's mask (Hugging Face's convention, 1 = real token) and BNP counts the real tokens only: with gradient
accumulation, a fit ends where BNP fed each real sequence alone, unpadded, ends (plain torch, no mask code)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

from lightning_bnp import BatchNormPreconditioning, BNPPreconditioner
from tests.helpers import _fit

LENGTHS = (6, 2, 4, 1, 3, 6, 5, 2)


class Pooled(pl.LightningModule):
    """Token encoder, mean over the real tokens, classifier head (one pooled row per sequence)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 3)

    @override
    def forward(self, tokens: Tensor, mask: Tensor) -> Tensor:
        real = mask[..., None].to(tokens.dtype)
        return self.head((self.encoder(tokens) * real).sum(1) / real.sum(1))

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return F.cross_entropy(self(batch["tokens"], batch["attention_mask"]), batch["label"])

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def data() -> list[dict[str, Tensor]]:
    g = torch.Generator().manual_seed(1)
    items = []
    for n in LENGTHS:
        tokens = torch.randn(6, 5, generator=g) * 2 + 1
        tokens[n:] = 100.0  # padding
        mask = (torch.arange(6) < n).long()
        items.append({"tokens": tokens, "attention_mask": mask, "label": torch.tensor(n % 3)})
    return items


def reference(model: Pooled, items: list[dict[str, Tensor]], micro: int, accumulate: int) -> BNPPreconditioner:
    """Plain torch: each sequence alone without its padding; loss scaled as Lightning's (mean over the
    micro-batch, divided by the accumulation)."""
    pre = BNPPreconditioner(model, rho=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    per_step = micro * accumulate
    for start in range(0, len(items), per_step):
        for item in items[start : start + per_step]:
            n = int(item["attention_mask"].sum())
            logits = model.head(model.encoder(item["tokens"][:n][None]).mean(1))
            (F.cross_entropy(logits, item["label"][None]) / per_step).backward()
        pre.step(opt)
        opt.step()
        opt.zero_grad()
    return pre


@pytest.mark.parametrize("key", ["attention_mask", "function"])
def test_the_callback_counts_the_real_tokens_of_each_batch(tmp_path: Path, key: str) -> None:
    items = data()
    model, twin = Pooled(), Pooled()
    token_mask: Any = key if key == "attention_mask" else (lambda batch: batch["attention_mask"] != 0)
    callback = BatchNormPreconditioning(rho=0.5, token_mask=token_mask, token_mask_layers="encoder.*")
    _fit(tmp_path, model, items, batch_size=2, callbacks=[callback], max_epochs=1, accumulate_grad_batches=2)  # type: ignore[arg-type]
    ref = reference(twin, items, micro=2, accumulate=2)
    pre = callback.preconditioner
    assert pre is not None and pre._masks.mask is None  # cleared after the last batch
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    for name, layer in pre.layers.items():
        assert layer.running.steps == ref.layers[name].running.steps == 2
        want = ref.layers[name].running
        torch.testing.assert_close(layer.running.mean_acc.cpu(), want.mean_acc, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(layer.running.var_acc.cpu(), want.var_acc, rtol=1e-6, atol=1e-6)


def test_a_missing_batch_key_is_named(tmp_path: Path) -> None:
    callback = BatchNormPreconditioning(token_mask="mask")
    with pytest.raises(ValueError, match=r"`token_mask`='mask': the training batch has no such key; its keys are "
                                         r"\['tokens', 'attention_mask', 'label'\]"):  # fmt: skip
        _fit(tmp_path, Pooled(), data(), batch_size=2, callbacks=[callback], max_epochs=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`token_mask` must be a batch key"):
        BatchNormPreconditioning(token_mask=3)  # type: ignore[arg-type]
    assert "token_mask='m'" in repr(BatchNormPreconditioning(token_mask="m"))
    assert "token_mask" not in repr(copy.copy(BatchNormPreconditioning()))


class Checkpointed(Pooled):
    """:class:`Pooled` with its encoder under activation checkpointing; ``own``: the training step sets the mask
    itself (``with preconditioner.token_mask(...)`` around the forward; Lightning runs the backward after it)."""

    def __init__(self, use_reentrant: bool, own: BatchNormPreconditioning | None) -> None:
        super().__init__()
        self.use_reentrant, self.own = use_reentrant, own

    @override
    def forward(self, tokens: Tensor, mask: Tensor) -> Tensor:
        real = mask[..., None].to(tokens.dtype)
        # (reentrant checkpointing back-propagates only if an input requires grad)
        tokens = tokens.detach().requires_grad_(self.use_reentrant)
        encoded = torch.utils.checkpoint.checkpoint(self.encoder, tokens, use_reentrant=self.use_reentrant)
        return self.head((encoded * real).sum(1) / real.sum(1))

    @override
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        if self.own is None:
            return super().training_step(batch, batch_idx)
        assert self.own.preconditioner is not None
        with self.own.preconditioner.token_mask(batch["attention_mask"], layers="encoder.*"):
            return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("how", ["token_mask=", "context in training_step"])
def test_masks_are_exact_under_activation_checkpointing(tmp_path: Path, use_reentrant: bool, how: str) -> None:
    """The callback's ``token_mask=`` and a ``with preconditioner.token_mask(...)`` in ``training_step`` (whose
    backward, and so reentrant checkpointing's recomputation, runs after the context): both end where BNP fed each
    real sequence alone ends."""
    items = data()
    if how == "token_mask=":
        callback = BatchNormPreconditioning(rho=0.5, token_mask="attention_mask", token_mask_layers="encoder.*")
        model = Checkpointed(use_reentrant, None)
    else:
        callback = BatchNormPreconditioning(rho=0.5)
        model = Checkpointed(use_reentrant, callback)
    twin = Pooled()
    _fit(tmp_path, model, items, batch_size=2, callbacks=[callback], max_epochs=1, accumulate_grad_batches=2)  # type: ignore[arg-type]
    ref = reference(twin, items, micro=2, accumulate=2)
    pre = callback.preconditioner
    assert pre is not None
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    for name, layer in pre.layers.items():
        assert layer.running.steps == ref.layers[name].running.steps == 2
        want = ref.layers[name].running
        torch.testing.assert_close(layer.running.mean_acc.cpu(), want.mean_acc, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(layer.running.var_acc.cpu(), want.var_acc, rtol=1e-6, atol=1e-6)
