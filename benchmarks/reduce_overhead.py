"""BNP under ``torch.compile(mode="reduce-overhead")`` (CUDA graphs made by Inductor): does it replay, and what does
it cost, side by side with the same network without BNP and with the whole step in one CUDA graph.

The network is compiled with BNP's hooks traced into it, and BNP's step with ``pre.compile_step(mode=...)``. Inductor
skips a graph it cannot replay ("skipping cudagraphs due to …", e.g. an input mutated in place that is not a
static address); this script collects those messages and Inductor's skip counter, checks the compiled run against
the eager run step for step (largest difference of weights and running statistics), and times per step: vanilla
eager, vanilla reduce-overhead, BNP eager, BNP reduce-overhead, vanilla and BNP graphed (``GraphedTrainingStep``).

Run (CUDA only): ``python -m benchmarks.reduce_overhead [--batch 60] [--steps 30]``; writes
``benchmarks/out/reduce_overhead.md``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch._dynamo
from torch import Tensor, nn

from example_projects.models import fc_network
from lightning_bnp.core import BNPPreconditioner, GraphedTrainingStep

OUT = Path(__file__).parent / "out"


class SkipMessages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "cudagraph" in message.lower() and "skip" in message.lower():
            self.messages.append(message)


def make(bnp: bool, mode: str) -> tuple[nn.Module, BNPPreconditioner | None, torch.optim.Optimizer, Callable]:
    torch.manual_seed(0)
    model = fc_network(784, hidden=100, norm="none").cuda().train()
    pre = BNPPreconditioner(model) if bnp else None
    forward: Callable[[Tensor], Tensor] = model
    if mode == "reduce-overhead":
        forward = torch.compile(model, mode="reduce-overhead")
        if pre is not None:
            pre.compile_step(mode="reduce-overhead")
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def loss_of(x: Tensor, y: Tensor) -> Tensor:
        return nn.functional.cross_entropy(forward(x), y)

    return model, pre, opt, loss_of


def stepper(bnp: bool, mode: str) -> tuple[Callable[[Tensor, Tensor], None], nn.Module, BNPPreconditioner | None]:
    model, pre, opt, loss_of = make(bnp, "eager" if mode == "graphed" else mode)
    if mode == "graphed":
        graphed = GraphedTrainingStep(loss_of, opt, pre)

        def replay(x: Tensor, y: Tensor) -> None:
            graphed(x, y)

        return replay, model, pre

    def step(x: Tensor, y: Tensor) -> None:
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad(set_to_none=True)
        loss_of(x, y).backward()
        if pre is not None:
            pre.step(opt)
        opt.step()

    return step, model, pre


def state(model: nn.Module, pre: BNPPreconditioner | None) -> list[Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    if pre is not None:
        out += [t.clone() for layer in pre.layers.values() for t in (layer.running.mean_acc, layer.running.var_acc)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=60)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch._dynamo.config.skip_nnmodule_hook_guards = False
    torch._dynamo.config.recompile_limit = 64
    handler = SkipMessages()
    for name in ("torch._inductor", "torch._dynamo"):
        logging.getLogger(name).addHandler(handler)
        logging.getLogger(name).setLevel(logging.DEBUG)
    torch._logging.set_logs(perf_hints=True)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(args.batch, 784, generator=g).cuda(), torch.randint(10, (args.batch,), generator=g).cuda())
            for _ in range(args.steps)]  # fmt: skip

    device = torch.cuda.get_device_name()
    lines = [f"# BNP under torch.compile(mode='reduce-overhead') ({device}, batch {args.batch})\n"]
    # 1. does it replay, and is it right: the compiled run against the eager one, step for step
    from torch._dynamo.utils import counters

    counters.clear()
    eager, eager_model, eager_pre = stepper(True, "eager")
    compiled, model, pre = stepper(True, "reduce-overhead")
    worst = 0.0
    for x, y in data:
        eager(x, y)
        compiled(x, y)
        for a, b in zip(state(eager_model, eager_pre), state(model, pre)):
            worst = max(worst, (a.double() - b.double()).abs().max().item())
    skips = dict(counters["inductor"])
    lines += [
        f"- largest difference to the eager run over {args.steps} steps (weights, running m and v): {worst:.2e}",
        f"- Inductor counters: {skips}",
        f"- cudagraph skip messages: {len(handler.messages)}",
        *[f"  - {message.splitlines()[0][:300]}" for message in dict.fromkeys(handler.messages)],
        "",
    ]
    # 2. cost per step, side by side
    variants = {
        (bnp, mode): stepper(bnp, mode)[0] for mode in ("eager", "reduce-overhead", "graphed") for bnp in (False, True)
    }
    times: dict[tuple[bool, str], list[float]] = {key: [] for key in variants}
    for step in variants.values():  # warm up: compile, capture
        for x, y in data[:6]:
            step(x, y)
    torch.cuda.synchronize()
    for r in range(args.repeats):
        keys = list(variants)
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for x, y in data:
                variants[key](x, y)
            torch.cuda.synchronize()
            times[key].append((time.perf_counter() - t0) / len(data))
    med = {key: statistics.median(t) for key, t in times.items()}
    lines += ["| mode | vanilla ms | BNP ms | BNP/vanilla | BNP/vanilla eager |", "|---|---|---|---|---|"]
    for mode in ("eager", "reduce-overhead", "graphed"):
        plain_s, bnp_s = med[(False, mode)], med[(True, mode)]
        ratios = f"{bnp_s / plain_s:.2f} | {bnp_s / med[(False, 'eager')]:.2f}"
        lines.append(f"| {mode} | {plain_s * 1e3:.3f} | {bnp_s * 1e3:.3f} | {ratios} |")
    print("\n".join(lines))
    OUT.mkdir(exist_ok=True)
    (OUT / "reduce_overhead.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
