"""BNP's grouped Triton kernels launched on a CUDA device (skipped without one): the grouped step against the pure-torch
step for every gradient dtype, in a CUDA graph against eager steps, the ops under ``torch.compile`` and graph capture,
and the launch count of a step. Their CPU tests (the interpreter) are ``test_triton_kernels.py``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_bnp.core import BNPPreconditioner

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
EPS32 = torch.finfo(torch.float32).eps

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="launches the kernels on a CUDA device")


def _fc(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, 100), nn.ReLU(), nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 10)).to(device)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_on_cuda_the_grouped_step_is_the_pure_torch_step(dtype: torch.dtype) -> None:
    model = _fc("cuda").to(dtype)
    ref = copy.deepcopy(model)
    pre, pre_ref = BNPPreconditioner(model, grouped_kernels=True), BNPPreconditioner(ref)
    for _ in range(3):
        x = torch.randn(60, 784, device="cuda", dtype=dtype)
        for net, p in ((model, pre), (ref, pre_ref)):
            net.zero_grad()
            net(x).float().square().mean().backward()
            p.step()
        eps = 64 * EPS32 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
        for a, b in zip(model.parameters(), ref.parameters()):
            assert a.grad is not None and b.grad is not None
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=eps * float(b.grad.abs().max()))
    assert all(p.grouped is not None for p in pre._step.plans.values())


def test_on_cuda_a_graphed_grouped_step_replays_the_eager_steps() -> None:
    from lightning_bnp.core import GraphedTrainingStep

    model = _fc("cuda")
    ref = copy.deepcopy(model)
    pre, pre_ref = BNPPreconditioner(model, grouped_kernels=True), BNPPreconditioner(ref)
    opt, opt_ref = torch.optim.SGD(model.parameters(), lr=0.05), torch.optim.SGD(ref.parameters(), lr=0.05)
    step = GraphedTrainingStep(lambda x, y: nn.functional.cross_entropy(model(x), y), opt, pre, warmup_steps=2)
    for _ in range(6):
        x, y = torch.randn(60, 784, device="cuda"), torch.randint(10, (60,), device="cuda")
        step(x, y)
        opt_ref.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        pre_ref.step(opt_ref)
        opt_ref.step()
    assert step.captured
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for name, layer in pre.layers.items():
        torch.testing.assert_close(layer.running.mean_acc, pre_ref.layers[name].running.mean_acc, rtol=1e-5, atol=1e-6)


def test_on_cuda_the_kernels_compile_and_are_captured() -> None:
    """``torch.compile`` traces the statistics op (a ``triton_op``) and takes the transform op as it is; a CUDA graph
    replays both with new inputs, allocating nothing."""
    from torch.library import opcheck

    from lightning_bnp.core.triton_statistics import feature_moments

    x = 1e4 + torch.randn(64, 3, 8, 8, device="cuda").to(memory_format=torch.channels_last)
    opcheck(torch.ops.lightning_bnp.feature_moments.default, (x, 1))
    compiled = torch.compile(lambda t: feature_moments(t, 1), fullgraph=True)
    for got, want in zip(compiled(x), feature_moments(x, 1)):
        torch.testing.assert_close(got, want)
    static = x.clone()
    graph = torch.cuda.CUDAGraph()
    feature_moments(static, 1)  # warm-up (compilation) outside the capture
    with torch.cuda.graph(graph):
        mean, var = feature_moments(static, 1)
    static.copy_(2 * x)
    graph.replay()
    h = (2 * x).double().transpose(0, 1).reshape(3, -1)
    torch.testing.assert_close(mean.double(), h.mean(1), rtol=1e-6, atol=0)
    torch.testing.assert_close(var.double(), h.var(1, unbiased=False), rtol=1e-3, atol=0)


def test_on_cuda_the_grouped_step_adds_few_kernel_launches() -> None:
    """The grouped path's count (at most 8): the step of the FC 784-100×3 launches the concatenation of the moments,
    the state kernel, the transform kernel, the host copy of the warnings' maxima and the commit's copy and add — not
    a few per layer."""
    from torch.profiler import ProfilerActivity, profile

    model = _fc("cuda")
    pre = BNPPreconditioner(model, grouped_kernels=True)
    for _ in range(3):  # plans and tables built
        model.zero_grad()
        model(torch.randn(60, 784, device="cuda")).sum().backward()
        pre.step()
    model.zero_grad()
    model(torch.randn(60, 784, device="cuda")).sum().backward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        pre.step()
        torch.cuda.synchronize()
    launches = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(launches) <= 8, [e.name for e in launches]
