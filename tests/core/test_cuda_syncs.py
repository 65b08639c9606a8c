"""A training step with BNP never makes the host wait for the GPU: under ``torch.cuda.set_sync_debug_mode("error")``
(which raises at any synchronising call: a read of a value, a blocking copy, a copy of pageable host memory to the
GPU) steps after the first run through, for every kind of statistics the step gathers. CUDA only. (The first step
of a set of layers gathers their state and may copy host step counts once: it is left out.)"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_bnp.core import BNPPreconditioner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@contextmanager
def no_syncs() -> Iterator[None]:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


class Twice(nn.Module):
    """A Linear called twice per forward (its calls' moments are merged), and per-token Linears."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.shared, self.out = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.shared(torch.relu(self.shared(torch.relu(self.inp(x)))))
        return self.out(h.mean(1))


CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "running": ("mlp", {}),
    "bias correction": ("mlp", {"bias_correction": True}),
    "batch statistics": ("mlp", {"statistics": "batch"}),
    "batch size 1": ("one-row", {}),
    "a layer called twice, token masks": ("tokens", {}),
    "conv channel": ("cnn", {}),
    "conv column": ("cnn", {"conv_statistics": "column"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_no_step_after_the_first_waits_for_the_device(case: str) -> None:
    kind, options = CASES[case]
    torch.manual_seed(0)
    if kind == "cnn":
        model: nn.Module = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(256, 3))
        x = torch.randn(8, 2, 8, 8)
    elif kind == "tokens":
        model, x = Twice(), torch.randn(8, 5, 6)
    else:
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
        x = torch.randn(1 if kind == "one-row" else 8, 6)
    model.cuda()
    x, y = x.cuda(), torch.randint(0, 3, (x.shape[0],)).cuda()
    mask = (torch.arange(5).expand(8, 5) < torch.tensor([5, 4, 3, 2, 1, 5, 4, 3]).view(8, 1)).cuda()
    pre = BNPPreconditioner(model, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        if kind == "tokens":
            pre.set_token_mask(mask, layers=["inp", "shared"])
        nn.functional.cross_entropy(model(x), y).backward()
        pre.step(opt)
        opt.step()

    step()  # the first step gathers the layers' state (and their host step counts)
    with no_syncs():
        for _ in range(3):
            step()
    if options.get("statistics") != "batch":
        assert all(layer.running.steps == 4 for layer in pre.layers.values())
