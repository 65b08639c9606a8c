"""Runs BNP's Triton kernels under Triton's CPU interpreter, for ``test_triton_kernels.py`` (one process for all
cases: the interpreter must be on before the kernels are defined, so it cannot run in the test process).

``python -m tests.core.triton_interpreted CASES OUT``: CASES is a ``torch.save``d list of cases; OUT receives one
result per case. A case is

- ``("transform", arguments)``: :class:`GroupedTransform` applied to the gradients given (views and strides as
  saved); the result is the gradients after it;
- ``("moments", x, channel_dim)``: :func:`triton_statistics.feature_moments`; the result is (mean, var);
- ``("steps", name, options, steps)``: the model ``name`` of :data:`MODELS` trained for ``steps`` steps twice from
  one seed, with the grouped kernels (``grouped_kernels=True``) and with the default pure-torch step; the result is,
  per path and step, the gradients before and after the step, the running state, the per-layer (μ, σ̃², q²) of
  the step and how many times the step launched each grouped kernel, and the warnings raised;
- ``("compiled transform", arguments)``: the transform inside ``torch.compile(fullgraph=True, backend="aot_eager")``.
"""

from __future__ import annotations

import copy
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is defined

import torch
from torch import nn

from lightning_bnp.core import step_path

step_path.KERNEL_DEVICES.add("cpu")  # the grouped path for CPU tensors, in this process only

from lightning_bnp.core import BNPPreconditioner  # noqa: E402
from lightning_bnp.core.triton_statistics import _state_kernel, feature_moments  # noqa: E402
from lightning_bnp.core.triton_transform import GroupedTransform, _transform_kernel  # noqa: E402

LAUNCHES: list[str] = []  # the grouped kernels launched since it was cleared, by name
_state_kernel.add_pre_run_hook(lambda *args, **kwargs: LAUNCHES.append("state"))
_transform_kernel.add_pre_run_hook(lambda *args, **kwargs: LAUNCHES.append("transform"))


class ConvAttention(nn.Module):
    """A conv, a grouped conv without bias (channels_last), the q, k, v row blocks of an attention, a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.gconv = nn.Conv2d(4, 4, 3, groups=2, bias=False)
        self.attn = nn.MultiheadAttention(8, 2)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gconv(torch.relu(self.conv(x)))  # (B, 4, 4, 4)
        t = h.flatten(2).transpose(1, 2).reshape(-1, 2, 8)  # (sequence, batch 2, 8)
        a, _ = self.attn(t, t, t)
        return self.fc(a)


def _conv_attention() -> tuple[nn.Module, Callable[[int], torch.Tensor]]:
    return ConvAttention().to(memory_format=torch.channels_last), lambda b: torch.randn(b, 3, 6, 6)


def _mlp(dtype: torch.dtype, bias: bool = True) -> Callable[[], tuple[nn.Module, Callable[[int], torch.Tensor]]]:
    def make() -> tuple[nn.Module, Callable[[int], torch.Tensor]]:
        model = nn.Sequential(nn.Linear(6, 20, bias=bias), nn.Tanh(), nn.Linear(20, 3)).to(dtype)
        return model, lambda b: (3.0 + torch.randn(b, 6)).to(dtype)

    return make


def _conv3d() -> tuple[nn.Module, Callable[[int], torch.Tensor]]:
    model = nn.Sequential(nn.Conv3d(2, 3, (2, 2, 2)), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 8, 2))
    return model, lambda b: torch.randn(b, 2, 3, 3, 3)


class Tokens(nn.Module):
    """A Linear over (B, T, F) tokens, for token masks."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


MODELS: dict[str, Callable[[], tuple[nn.Module, Callable[[int], torch.Tensor]]]] = {
    "conv_attention": _conv_attention,
    "mlp": _mlp(torch.float32),
    "mlp_no_bias": _mlp(torch.float32, bias=False),
    "mlp_half": _mlp(torch.float16),
    "mlp_bfloat16": _mlp(torch.bfloat16),
    "conv3d": _conv3d,
    "tokens": lambda: (Tokens(), lambda b: torch.randn(b, 5, 4)),
}


def _steps(name: str, options: dict[str, Any], steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model, batch = MODELS[name]()
    batch_size = options.pop("batch_size", 4)
    inputs = [batch(batch_size) for _ in range(steps)]
    for k, poison in options.pop("poison", {}).items():  # a non-finite or huge first value in step k
        inputs[int(k)].view(-1)[0] = poison
    mask = options.pop("mask", None)
    results: dict[str, Any] = {}
    for path, reference in (("grouped", False), ("reference", True)):
        net = copy.deepcopy(model)
        pre = BNPPreconditioner(net, grouped_kernels=not reference, **options)
        record: list[dict[str, Any]] = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for x in inputs:
                net.zero_grad()
                if mask is not None:
                    with pre.token_mask(mask):
                        out = net(x)
                else:
                    out = net(x)
                out.float().sin().sum().backward()
                raw = {n: p.grad.clone() for n, p in net.named_parameters()}
                LAUNCHES.clear()
                pre.step()
                record.append(
                    {
                        "raw": raw,
                        "grads": {n: p.grad.clone() for n, p in net.named_parameters()},
                        "launches": {kernel: LAUNCHES.count(kernel) for kernel in ("state", "transform")},
                        "state": {
                            n: (
                                layer.running.mean_acc.clone(), layer.running.var_acc.clone(),
                                layer.running.decay.clone(), layer.running.steps,
                            )
                            for n, layer in pre.layers.items()
                        },
                        "transform": {
                            n: (None if t.mu is None else t.mu.clone(), t.var_t.clone(), float(t.q2))
                            for n, layer in pre.layers.items()
                            if (t := layer.transform) is not None
                        },
                    }
                )  # fmt: skip
            pre.flush_warnings()
        plans = list(pre._step.plans.values())
        record.append(
            {
                "grouped plans": [plan.grouped is not None for plan in plans],
                "transform kernels": [
                    kernels.transform is not None
                    for plan in plans
                    if plan.grouped
                    for kernels in plan.grouped._made.values()
                ],
                "warnings": sorted(str(w.message) for w in caught),
            }
        )
        results[path] = record
    return results


def _transform(arguments: dict[str, Any], compiled: bool) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    grads_w, grads_b = arguments["grads_w"], arguments["grads_b"]
    transform = GroupedTransform(
        grads_w, grads_b, arguments["spans"], arguments["groups"], arguments["sizes"], arguments["offsets"]
    )

    def run(mu: torch.Tensor, scale: torch.Tensor, q2: torch.Tensor) -> None:
        transform(grads_w, grads_b, mu, scale, q2)

    (torch.compile(run, fullgraph=True, backend="aot_eager") if compiled else run)(
        arguments["mu"], arguments["scale"], arguments["q2"]
    )
    return grads_w, grads_b


def run_case(case: tuple[Any, ...]) -> Any:
    kind = case[0]
    if kind in ("transform", "compiled transform"):
        return _transform(case[1], compiled=kind == "compiled transform")
    if kind == "moments":
        return feature_moments(case[1], case[2])
    if kind == "steps":
        return _steps(case[1], dict(case[2]), case[3])
    raise ValueError(f"unknown case {kind!r}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    cases = torch.load(sys.argv[1], weights_only=False)
    torch.save([run_case(case) for case in cases], sys.argv[2])
