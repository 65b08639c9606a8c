"""Token masks and pauses under activation checkpointing (issue 45, item 2): reentrant checkpointing recomputes the
forward during the backward, after ``with pre.token_mask(mask):`` / ``with pre.paused():`` has exited; that
recomputation is counted under the mask and pause of the forward it recomputes. Non-reentrant checkpointing is
exact as it was. References: the rows reduced by torch directly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_bnp import BNPPreconditioner
from lightning_bnp.core import collection, recompute
from lightning_bnp.core.recompute import replayed
from tests.core.test_token_masks import Block, check_moments, padded
from tests.helpers import spy_moments


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("how", ["context", "set_token_mask"])
def test_a_mask_set_for_a_checkpointed_forward_holds_for_its_recomputation(use_reentrant: bool, how: str) -> None:
    """The mask is gone when the backward recomputes the forward (the pattern the docs show): padding rows stay out
    of μ, σ² and N (before the fix, reentrant checkpointing counted every padded row)."""
    net = _mlp()
    pre = BNPPreconditioner(net, statistics="batch")
    seen = spy_moments(pre)
    x, mask = padded()
    x.requires_grad_(use_reentrant)  # reentrant checkpointing needs an input that requires grad
    if how == "context":
        with pre.token_mask(mask):
            out = checkpoint(net, x, use_reentrant=use_reentrant)
    else:
        pre.set_token_mask(mask)
        out = checkpoint(net, x, use_reentrant=use_reentrant)
        pre.set_token_mask(None)
    out.masked_fill(~mask[..., None], 0.0).sum().backward()
    pre.step()
    check_moments(seen["0"], x.detach()[mask])
    check_moments(seen["2"], torch.tanh(net[0](x.detach()))[mask].detach())


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_a_paused_checkpointed_forward_adds_nothing_when_recomputed(use_reentrant: bool) -> None:
    """A second, paused forward through the checkpointed model (e.g. a consistency term) in the same loss: only
    the unpaused one counts."""
    net = _mlp()
    pre = BNPPreconditioner(net, statistics="batch")
    seen = spy_moments(pre)
    x, _ = padded()
    other = torch.randn_like(x) * 5 - 3
    x.requires_grad_(use_reentrant)
    other.requires_grad_(use_reentrant)
    with pre.paused():
        extra = checkpoint(net, other, use_reentrant=use_reentrant)
    out = checkpoint(net, x, use_reentrant=use_reentrant)
    (out.sum() + extra.square().sum()).backward()
    pre.step()
    check_moments(seen["0"], x.detach().flatten(0, 1))


def test_multihead_attention_in_a_reentrant_checkpoint_reads_its_mask() -> None:
    """nn.MultiheadAttention (its q/k/v calls and out_proj's captured F.linear): the masked statistics of the
    recomputation are those of the forward without checkpointing."""

    def moments(checkpointed: bool) -> dict[str, tuple[Tensor, Tensor, float]]:
        torch.manual_seed(0)
        block = Block(batch_first=True)
        pre = BNPPreconditioner(block, statistics="batch")
        seen = spy_moments(pre)
        x, mask = padded()
        memory, memory_mask = padded((4, 9, 2, 5), features=6, seed=3)
        x.requires_grad_(checkpointed)
        with pre.token_mask(mask):
            if checkpointed:
                out = checkpoint(block, x, ~mask, memory, ~memory_mask, use_reentrant=True)
            else:
                out = block(x, ~mask, memory, ~memory_mask)
        out.masked_fill(~mask[..., None], 0.0).sum().backward()
        pre.step()
        return {name: (m.mean, m.var, float(m.rows)) for name, m in seen.items()}

    plain, recomputed = moments(False), moments(True)
    assert sorted(plain) == sorted(recomputed) and len(plain) == 8
    for name, (mean, var, rows) in plain.items():
        assert recomputed[name][2] == rows, name
        torch.testing.assert_close(recomputed[name][0], mean, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(recomputed[name][1], var, rtol=1e-6, atol=1e-6)


def test_a_nested_reentrant_checkpoint_keeps_the_outer_forwards_mask() -> None:
    """A checkpoint inside a checkpointed function: its first run happens during the outer recomputation, whose
    context (the original forward's mask) it keeps."""
    net = _mlp()
    pre = BNPPreconditioner(net, statistics="batch")
    seen = spy_moments(pre)
    x, mask = padded()
    x.requires_grad_()

    def outer(h: Tensor) -> Tensor:
        return net[2](checkpoint(lambda t: net[1](net[0](t)), h, use_reentrant=True))

    with pre.token_mask(mask):
        out = checkpoint(outer, x, use_reentrant=True)
    out.masked_fill(~mask[..., None], 0.0).sum().backward()
    pre.step()
    check_moments(seen["0"], x.detach()[mask])
    check_moments(seen["2"], torch.tanh(net[0](x.detach()))[mask].detach())


def test_reentrant_checkpointing_in_training_steps_equals_the_plain_model() -> None:
    """Masked training steps through a reentrant checkpoint equal those of the same model without one."""

    def train(checkpointed: bool) -> list[Tensor]:
        net = _mlp()
        pre = BNPPreconditioner(net)
        for seed in range(3):
            x, mask = padded(seed=seed)
            x.requires_grad_(checkpointed)
            with pre.token_mask(mask):
                out = checkpoint(net, x, use_reentrant=True) if checkpointed else net(x)
            F.mse_loss(out[mask], torch.zeros_like(out[mask])).backward()
            pre.step()
            with torch.no_grad():
                for p in net.parameters():
                    p -= 0.1 * p.grad  # type: ignore[operator]
                    p.grad = None
        return [p.detach() for p in net.parameters()]

    for p, q in zip(train(True), train(False)):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_a_mask_and_a_pause_set_inside_the_checkpointed_function_hold_for_each_call() -> None:
    """The checkpointed function masks its encoder's call, pauses a second one, and its head sees one pooled row
    per sequence: each module call of the recomputation counts under the context of the same call of the first
    run (not, e.g., under the first call's mask for all)."""
    net, head = _mlp(), nn.Linear(4, 3)
    pre = BNPPreconditioner(nn.ModuleDict({"encoder": net, "head": head}), statistics="batch")
    seen = spy_moments(pre)
    x, mask = padded()
    x.requires_grad_()
    real = mask[..., None].float()

    def fn(t: Tensor) -> Tensor:
        with pre.token_mask(mask):
            h = net(t)
        with pre.paused():
            h = h + 0.1 * net(t * 2)
        return head((h * real).sum(1) / real.sum(1))

    checkpoint(fn, x, use_reentrant=True).sum().backward()
    pre.step()
    check_moments(seen["encoder.0"], x.detach()[mask])
    with torch.no_grad():
        h = net(x) + 0.1 * net(x * 2)
        check_moments(seen["head"], (h * real).sum(1) / real.sum(1))


def test_a_reentrant_and_a_non_reentrant_checkpoint_in_one_model_each_count_the_real_tokens() -> None:
    """The non-reentrant checkpoint recomputes its forward during the backward too, under an autograd node that is
    no reentrant checkpoint's (it kept no contexts), after a reentrant checkpoint ran: that recomputation counts
    as a plain forward call (its outputs are never reached), not as a replay."""
    first, second = _mlp(), nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    pre = BNPPreconditioner(nn.ModuleDict({"first": first, "second": second}), statistics="batch")
    seen = spy_moments(pre)
    x, mask = padded()
    x.requires_grad_()
    with pre.token_mask(mask):
        out = checkpoint(second, checkpoint(first, x, use_reentrant=True), use_reentrant=False)
    out.masked_fill(~mask[..., None], 0.0).sum().backward()
    pre.step()
    with torch.no_grad():
        h = first(x)
        check_moments(seen["first.0"], x.detach()[mask])
        check_moments(seen["first.2"], torch.tanh(first[0](x))[mask])
        check_moments(seen["second.0"], h[mask])
        check_moments(seen["second.2"], torch.tanh(second[0](h))[mask])


ROOT = Path(__file__).resolve().parents[2]
FIRST_BACKWARD = """
import torch
from torch.utils.checkpoint import checkpoint
from lightning_bnp import BNPPreconditioner
from tests.core.test_reentrant_checkpoint import _mlp
from tests.core.test_token_masks import check_moments, padded
from tests.helpers import spy_moments

net = _mlp()
pre = BNPPreconditioner(net, statistics="batch")
seen = spy_moments(pre)
x, mask = padded()
x.requires_grad_()
with pre.token_mask(mask):
    out = checkpoint(net, x, use_reentrant=True)
tasks = []
out.register_hook(lambda grad: tasks.append(torch._C._current_graph_task_id()))
out.masked_fill(~mask[..., None], 0.0).sum().backward()
pre.step()
assert tasks == [0], tasks
check_moments(seen["0"], x.detach()[mask])
check_moments(seen["2"], torch.tanh(net[0](x.detach()))[mask].detach())
"""


def test_a_reentrant_recomputation_in_the_first_backward_of_a_process_counts_under_its_mask() -> None:
    """Autograd numbers its graph tasks from 0: the first backward of a process (a fresh interpreter here) is task
    0, a backward like any other, whose recomputation replays the forward's mask (padding rows hold a NaN)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", FIRST_BACKWARD], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_backward_forwards_look_for_a_replayed_context_only_once_a_reentrant_checkpoint_ran(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Until a reentrant checkpoint's first run met a managed module, a training forward (with or without
    gradients: a teacher pass under ``no_grad``) does not look up the autograd node it runs under."""
    looked: list[object] = []

    def counting(owner: object) -> object:
        looked.append(owner)
        return replayed(owner)

    monkeypatch.setattr(collection, "replayed", counting)
    net = _mlp()
    pre = BNPPreconditioner(net, statistics="batch")
    x, _ = padded()
    with torch.no_grad():
        net(x)  # a training forward without gradients, outside any checkpoint
    net(x).sum().backward()
    pre.step()
    assert looked == []
    x.requires_grad_()
    checkpoint(net, x, use_reentrant=True).sum().backward()
    pre.step()
    assert len(looked) == 3  # from then on: the first run's second Linear call, the recomputation's two


@pytest.mark.stack  # counts frames: outside `make mutate` (its trampolines are frames)
def test_the_checkpoints_forward_is_looked_for_in_the_max_depth_frames_above_the_hooks_caller() -> None:
    """``_outermost_checkpoint`` skips its own frame and its caller's (``remember``) and reads the next
    ``_MAX_DEPTH`` frames: a checkpointed function that calls through k nested frames is found up to the limit,
    and not one frame past it (the cost of the walk stays bounded)."""
    found: list[object] = []

    def remember() -> None:  # stands for recompute.remember: the caller _outermost_checkpoint skips
        found.append(recompute._outermost_checkpoint())

    def nested(levels: int, x: Tensor) -> Tensor:
        if levels:
            return nested(levels - 1, x)
        remember()
        return x * 2

    # frames above _outermost_checkpoint: remember, nested × (k + 1), the lambda, CheckpointFunction.forward
    deepest = recompute._MAX_DEPTH - 3  # CheckpointFunction.forward is then frame 2 + _MAX_DEPTH − 1, the last read
    x = torch.ones(2, requires_grad=True)
    for levels in (0, deepest, deepest + 1):
        checkpoint(lambda t, k=levels: nested(k, t), x, use_reentrant=True)
    assert [ctx is not None for ctx in found] == [True, True, False]


def test_two_checkpointed_forwards_under_two_integer_masks_each_count_their_own_real_tokens() -> None:
    """An integer mask (Hugging Face's ``attention_mask``) is made boolean when a forward reads it: the recomputation
    of the first forward, which runs after the second's, reads its own mask, not the second's boolean copy."""
    net = _mlp()
    pre = BNPPreconditioner(net, statistics="batch")
    seen = spy_moments(pre)
    (x1, mask1), (x2, mask2) = padded(seed=1), padded(lengths=(2, 9, 4, 6), seed=2)
    outs = []
    for x, mask in ((x1, mask1), (x2, mask2)):
        x.requires_grad_()
        with pre.token_mask(mask.long()):
            outs.append(checkpoint(net, x, use_reentrant=True).masked_fill(~mask[..., None], 0.0))
    (outs[0].sum() + outs[1].sum()).backward()  # (recomputes the second forward, then the first)
    pre.step()
    check_moments(seen["0"], torch.cat([x1.detach()[mask1], x2.detach()[mask2]]))
