"""``example_projects.transformers`` (issue 24's ViT and character-level LM) and the ``transformer`` project's data,
against independent references: patches by ``F.unfold``, causality by perturbation, windows by slicing."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from example_projects.transformer.model import CharLMModule, CorpusDataModule, ViTClassifier
from example_projects.transformers import CharLM, ViT, corpus_splits
from lightning_bnp.core import BNPPreconditioner


def test_vit_tokens_are_the_images_7x7_patches() -> None:
    torch.manual_seed(0)
    net = ViT(norm="none")
    seen = []
    net.embed.register_forward_hook(lambda m, args, out: seen.append(args[0]))
    x = torch.rand(3, 1, 28, 28)
    assert net(x).shape == (3, 10)
    patches = nn.functional.unfold(x, kernel_size=7, stride=7).transpose(1, 2)  # (3, 16, 49), row-major patches
    torch.testing.assert_close(seen[0], patches, rtol=0, atol=0)


def test_charlm_is_causal() -> None:
    torch.manual_seed(0)
    net = CharLM(context=16).eval()
    idx = torch.randint(256, (2, 16))
    changed = idx.clone()
    changed[:, 9] = (idx[:, 9] + 1) % 256
    with torch.no_grad():
        a, b = net(idx), net(changed)
    assert a.shape == (2, 16, 256)
    torch.testing.assert_close(a[:, :9], b[:, :9])  # positions before 9 never see it
    assert not torch.allclose(a[:, 9:], b[:, 9:])
    with pytest.raises(ValueError, match="sequence length must be <= context 16, got 17"):
        net(torch.randint(256, (1, 17)))


def test_norm_choice_and_argument_errors() -> None:
    assert sum(isinstance(m, nn.LayerNorm) for m in ViT(norm="ln").modules()) == 5  # 2 per block, 1 before the head
    assert not any(isinstance(m, nn.LayerNorm) for m in ViT(norm="none").modules())
    with pytest.raises(ValueError, match="`norm` must be 'ln' or 'none', got 'bn'"):
        CharLM(norm="bn")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`patch` must divide the image's height and width 28×28, got 5"):
        ViT(patch=5)


def test_bnp_transforms_every_projection() -> None:
    """Issue 24: q, k, v and out_proj of every attention, both MLP layers, the head (and the ViT's patch embedding);
    no warning that a forward never ran."""
    blocks = [f"blocks.{i}.{p}" for i in range(2) for p in ("attn.q", "attn.k", "attn.v", "attn.out_proj", "mlp.0")]
    blocks += [f"blocks.{i}.mlp.2" for i in range(2)]
    for net, x, extra in (
        (ViT(norm="none"), torch.rand(4, 1, 28, 28), ["embed", "head"]),
        (CharLM(), torch.randint(256, (4, 64)), ["head"]),
    ):
        pre = BNPPreconditioner(net)
        assert sorted(pre.layers) == sorted(blocks + extra)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            net(x).sum().backward()
            pre.step()
        assert all(layer.transform is not None for layer in pre.layers.values())


def test_corpus_windows_are_consecutive_with_next_byte_targets() -> None:
    data = CorpusDataModule(context=8, batch_size=4, eval_batch_size=2, max_bytes=2000)
    data.setup("fit")
    train = data.splits["train"]
    assert torch.equal(torch.cat(list(corpus_splits(bytes(range(10)) * 100).values())), torch.arange(1000) % 10)
    x, y = next(iter(data.val_dataloader()))
    val = data.splits["val"]
    assert torch.equal(x[1], val[8:16]) and torch.equal(y[1], val[9:17])
    assert len(data.train_dataloader().dataset) == (len(train) - 1) // 8  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`max_bytes` must be an integer >= 161, got 100"):
        CorpusDataModule(context=8, max_bytes=100)


def test_modules_train_a_step() -> None:
    torch.manual_seed(0)
    lm = CharLMModule(optimizer="adam", lr=1e-3)
    assert lm(torch.randint(256, (2, 64))).shape == (2, 64, 256)
    vit = ViTClassifier(norm="none")
    assert vit.network(torch.rand(2, 1, 28, 28)).shape == (2, 10)
    with pytest.raises(ValueError, match="`optimizer` must be 'sgd' or 'adam', got 'lbfgs'"):
        CharLMModule(optimizer="lbfgs")  # type: ignore[arg-type]
