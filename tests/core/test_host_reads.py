"""Issue 28 item 1: a training step with BNP reads nothing back from the device — forward, backward and
``pre.step()`` / ``pre.step(optimizer)``, for Linear and Conv layers with per-channel and per-column
statistics, including steps whose statistics are not finite or overflow (the guard decides on the device;
its warning comes from the next step). Under DDP pooling: ``tests/ddp/test_host_reads_ddp.py``."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_bnp.core import BNPPreconditioner, BNPWarning
from tests.host_reads import HostReads


def make(kind: str) -> tuple[nn.Module, dict[str, str]]:
    torch.manual_seed(0)
    if kind == "linear":
        return nn.Sequential(nn.Linear(6, 8), nn.LeakyReLU(), nn.Linear(8, 8, bias=False), nn.Linear(8, 3)), {}
    net = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.LeakyReLU(), nn.Conv2d(4, 4, 3, stride=2, bias=False), nn.Flatten(),
        nn.Linear(4 * 3 * 3, 3),
    )  # fmt: skip
    return net, {"conv_statistics": kind.removeprefix("conv-")}


def inputs(kind: str, step: int) -> Tensor:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(5, 6, generator=g) if kind == "linear" else torch.randn(5, 2, 8, 8, generator=g)
    if step == 3:
        x[1].flatten()[0] = float("nan")  # a NaN sample
    if step == 4:
        x = x * 1e20  # finite, but the squares overflow float32
    return x + 1.0


@pytest.mark.parametrize("give_optimizer", [False, True], ids=["step()", "step(opt)"])
@pytest.mark.parametrize("kind", ["linear", "conv-channel", "conv-column"])
def test_a_training_step_reads_nothing_back_from_the_device(kind: str, give_optimizer: bool) -> None:
    net, options = make(kind)
    pre = BNPPreconditioner(net, **options)  # type: ignore[arg-type]
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    reads_per_step = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(6):
            x = inputs(kind, step)
            y = torch.arange(5) % 3
            with HostReads() as reads:
                opt.zero_grad()
                F.cross_entropy(net(x), y).backward()
                pre.step(opt) if give_optimizer else pre.step()
                opt.step()
            reads_per_step.append(dict(reads.reads))
    assert reads_per_step == [{}] * 6
    messages = [str(w.message) for w in caught if issubclass(w.category, BNPWarning)]
    assert any("'0'" in m and "NaN or Inf" in m for m in messages), messages  # the NaN step, reported later
    assert any("'0'" in m and "overflows float32" in m for m in messages), messages


@pytest.mark.parametrize("bias_correction", [False, True])
def test_batch_size_one_reads_nothing_back(bias_correction: bool) -> None:
    """N = 1: σ²_H = (h − μ)² uses the running μ, which the step takes on the device (ρ^t, not t)."""
    net, _ = make("linear")
    pre = BNPPreconditioner(net, bias_correction=bias_correction)
    for step in range(3):
        with HostReads() as reads:
            F.cross_entropy(net(inputs("linear", step)[:1]), torch.tensor([1])).backward()
            pre.step()
        assert reads.reads == {}, step
        net.zero_grad()
    assert pre.layers["0"].running.steps == 3


@pytest.mark.parametrize("padding_idx", [None, 0])
def test_embeddings_read_nothing_back(padding_idx: int | None) -> None:
    """Issue 24 item 4: the token counts are one ``index_add_`` (``bincount`` sizes its output from the largest
    index, a read on CUDA); with ``padding_idx`` the count of real tokens stays on the device, and the step
    builds q² there."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(10, 4, padding_idx=padding_idx), nn.Flatten(), nn.Linear(12, 3))
    pre = BNPPreconditioner(net, embeddings=True)
    for step in range(3):
        x = torch.randint(0, 10, (5, 3), generator=torch.Generator().manual_seed(step))
        with HostReads() as reads:
            F.cross_entropy(net(x), torch.arange(5) % 3).backward()
            pre.step()
        assert reads.reads == {}, step
        net.zero_grad()
    assert pre.layers["0"].running.steps == 3
