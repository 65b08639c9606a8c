"""Count the kernel-launching aten ops a training step dispatches, and how many BNP adds.

Host overhead on a GPU is one kernel launch and its Python per aten op (issue 16); a count is
deterministic, so the test suite asserts it while timings live in ``benchmarks/overhead.py``.

An op is counted unless it only creates a view or alias of its input (``view``, ``t``, ``detach``,
``split`` …: no kernel runs); in-place ops and host reads such as ``.item()`` count. What BNP adds
is the count of a BNP step minus that of the same step without BNP — forward, backward,
``pre.step()`` and the optimizer step — at steady state (after ``warmup`` steps, once cached
index tensors exist).

Run: ``python -m benchmarks.op_count`` prints the counts for the issue's two models.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from example_projects.models import cifar_resnet, fc_network
from example_projects.transformers import VOCAB, CharLM, ViT
from lightning_bnp.core import BNPPreconditioner

__all__ = ["AtenOpCounter", "added_ops", "count_step_ops", "standard_models"]


class AtenOpCounter(TorchDispatchMode):
    """Counts every dispatched aten op that is not a pure view or alias (in-place ops count)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not func.is_view:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def count_step_ops(
    model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *, bnp: bool, warmup: int = 2
) -> AtenOpCounter:
    """Ops of one SGD step (zero_grad, forward, cross-entropy backward, [``pre.step()``], ``opt.step()``)."""
    pre = BNPPreconditioner(model) if bnp else None
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        out = model(inputs)  # (N, classes), or (N, T, vocab) for a language model with (N, T) targets
        nn.functional.cross_entropy(out.flatten(0, -2), targets.flatten()).backward()
        if pre is not None:
            pre.step()
        opt.step()

    for _ in range(warmup):
        step()
    with AtenOpCounter() as counter:
        step()
    if pre is not None:
        pre.detach()
    return counter


def added_ops(make_model: Callable[[], nn.Module], inputs: torch.Tensor, targets: torch.Tensor) -> tuple[int, int]:
    """(ops BNP adds per step, managed layers L)."""
    torch.manual_seed(0)
    vanilla = count_step_ops(make_model().train(), inputs, targets, bnp=False)
    torch.manual_seed(0)
    model = make_model().train()
    with_bnp = count_step_ops(model, inputs, targets, bnp=True)
    layers = sum(isinstance(m, (nn.Linear, nn.modules.conv._ConvNd)) for m in model.modules())
    layers += 3 * sum(isinstance(m, nn.MultiheadAttention) for m in model.modules())  # its q, k, v blocks
    return with_bnp.total - vanilla.total, layers


def standard_models() -> dict[str, tuple[Callable[[], nn.Module], torch.Tensor, torch.Tensor]]:
    """The issue's two models, a small Transformer encoder and issue 24's two benchmark Transformers (rows ``vit``
    and ``charlm`` of ``benchmarks.overhead``) on small inputs (the count does not depend on the batch or image
    size)."""
    g = torch.Generator().manual_seed(0)
    return {
        "FC 784-100×3": (
            lambda: fc_network(28 * 28, hidden=100, norm="none"),
            torch.randn(8, 28 * 28, generator=g),
            torch.randint(10, (8,), generator=g),
        ),
        "Transformer encoder 2×(MHA + MLP)": (
            lambda: nn.Sequential(
                nn.TransformerEncoder(
                    nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2, enable_nested_tensor=False
                ),
                nn.Flatten(),
                nn.Linear(5 * 16, 10),
            ),
            torch.randn(4, 5, 16, generator=g),
            torch.randint(10, (4,), generator=g),
        ),
        "ViT d=64 ×2, no norm": (
            lambda: ViT(norm="none"),
            torch.randn(2, 1, 28, 28, generator=g),
            torch.randint(10, (2,), generator=g),
        ),
        "char-LM d=128 ×2 + LN": (
            CharLM,
            torch.randint(VOCAB, (2, 64), generator=g),
            torch.randint(VOCAB, (2, 64), generator=g),
        ),
        "ResNet-20 GN": (
            lambda: cifar_resnet(20, in_channels=3, norm="gn"),
            torch.randn(2, 3, 16, 16, generator=g),
            torch.randint(10, (2,), generator=g),
        ),
    }


def main() -> None:
    for name, (make, x, y) in standard_models().items():
        added, layers = added_ops(make, x, y)
        print(f"{name}: BNP adds {added} aten ops per step for L = {layers} layers (bound 2L + 20 = {2 * layers + 20})")


if __name__ == "__main__":
    main()
