"""A model moved to the GPU after BNP was attached (the Lightning order: callbacks attach, then the strategy
moves the model). Both bugs here were found by the first run of the suite on a GPU (stop 31, an H200): the
running μ of a one-row step was read on the CPU before the statistics followed the model, and lazy layers were
materialized with ``example_input_array`` on the strategy's device while their parameters were still on the
CPU. CUDA only: a CPU-only machine has one device, so neither can happen there."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_bnp import BatchNormPreconditioning
from lightning_bnp.core import BNPPreconditioner
from tests.helpers import BoringClassifier, _fit, make_data, make_mlp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _online(device: str) -> tuple[nn.Module, BNPPreconditioner]:
    """Batch size 1 (N = 1: σ²_H = (h − μ)² with the running μ), attached on the CPU, then moved."""
    model = make_mlp()
    pre = BNPPreconditioner(model, bias_correction=False)
    model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = make_data(n=5)
    for x, y in zip(*data.tensors):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[None].to(device)), y[None].to(device)).backward()
        pre.step(opt)
        opt.step()
    return model, pre


def test_one_row_steps_follow_a_model_moved_after_attaching() -> None:
    cpu_model, cpu_pre = _online("cpu")
    gpu_model, gpu_pre = _online("cuda")
    for (name, p), q in zip(cpu_model.named_parameters(), gpu_model.parameters()):
        torch.testing.assert_close(q.cpu(), p, rtol=1e-5, atol=1e-6, msg=name)
    for name, layer in cpu_pre.layers.items():
        assert layer.running.steps == 5
        torch.testing.assert_close(gpu_pre.layers[name].running.mu.cpu(), layer.running.mu, rtol=1e-5, atol=1e-6)


class LazyClassifier(BoringClassifier):
    def __init__(self) -> None:
        super().__init__(nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, 3)))
        self.example_input_array = torch.zeros(2, 6)


def test_lazy_layers_are_materialized_on_the_cpu_before_a_gpu_fit(tmp_path: Path) -> None:
    bnp = BatchNormPreconditioning(verbose=False)
    _fit(tmp_path, LazyClassifier(), make_data(), batch_size=8, callbacks=[bnp], max_steps=2, accelerator="cuda")
    assert bnp.preconditioner is not None
    assert [layer.running.steps for layer in bnp.preconditioner.layers.values()] == [2, 2]
