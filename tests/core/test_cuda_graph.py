"""A training step with BNP captured once in a CUDA graph and replayed (``GraphedTrainingStep``, the recipe of the
docs' "CUDA graphs" guide) equals the eager run step for step: parameters and running statistics after each of 53
steps (3 eager warm-up steps, then 50 replays), for running statistics with and without bias correction, batch
statistics, token masks, and channel and column statistics of convolutions. Non-finite statistics in a replayed
step leave the statistics as they were and are warned about by ``flush_warnings()``.

Each test runs on a CUDA device (skipped without one) and on the CPU with the suite's stand-in for CUDA graphs
(``tests/recorded_graphs.py``: the step's operations recorded at capture, with a CUDA graph's rules, and replayed);
Adam's ``capturable=True`` runs only on CUDA."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_bnp.core import BNPPreconditioner, BNPWarning, GraphedTrainingStep
from tests.recorded_graphs import RecordedGraph, RecordedGraphs

NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = pytest.param("cuda", marks=NO_CUDA)


@pytest.fixture(params=[CUDA, "cpu"])
def device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "cpu":
        monkeypatch.setattr(GraphedTrainingStep, "runtime", RecordedGraphs())
    return str(request.param)


STEPS = 53  # 3 warm-up steps and 50 replays


class TokenNet(nn.Module):
    """Per-token Linears on (B, T, F) and a mean over the real tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.hidden, self.out = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 3)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        h = self.hidden(torch.relu(self.inp(x))).relu()
        w = mask.unsqueeze(-1).to(h.dtype)
        return self.out((h * w).sum(1) / w.sum(1).clamp_min(1.0))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3, bias=False))


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, groups=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 3 * 3, 3),
    )


def _batches(kind: str, device: str, n: int = STEPS, batch: int = 16) -> list[tuple[Tensor, ...]]:
    g = torch.Generator().manual_seed(7)
    out: list[tuple[Tensor, ...]] = []
    for _ in range(n):
        y = torch.randint(0, 3, (batch,), generator=g)
        if kind == "cnn":
            x = torch.randn(batch, 2, 8, 8, generator=g) * torch.tensor([0.3, 3.0]).view(1, 2, 1, 1) + 0.5
            out.append((x.to(device), y.to(device)))
        elif kind == "tokens":
            x = torch.randn(batch, 5, 6, generator=g) * torch.logspace(-1, 1, 6) + 0.5
            mask = torch.arange(5).expand(batch, 5) < torch.randint(1, 6, (batch, 1), generator=g)
            out.append((x.to(device), y.to(device), mask.to(device)))
        else:
            x = torch.randn(batch, 6, generator=g) * torch.logspace(-1, 1, 6) + 0.5
            out.append((x.to(device), y.to(device)))
    return out


CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "running": ("mlp", {}),
    "running, bias correction": ("mlp", {"bias_correction": True}),
    "batch statistics": ("mlp", {"statistics": "batch"}),
    "token masks": ("tokens", {}),
    "conv channel statistics": ("cnn", {"conv_statistics": "channel"}),
    "conv column statistics": ("cnn", {"conv_statistics": "column", "bias_correction": True}),
}


def _make(
    kind: str, options: dict[str, Any], adam: bool, device: str
) -> tuple[nn.Module, BNPPreconditioner, Any, Callable]:
    torch.manual_seed(0)
    model = {"mlp": _mlp, "cnn": _cnn, "tokens": TokenNet}[kind]().to(device)
    pre = BNPPreconditioner(model, **options)
    if adam:
        opt: Any = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def loss_of(x: Tensor, y: Tensor, mask: Tensor | None = None) -> Tensor:
        if mask is None:
            return nn.functional.cross_entropy(model(x), y)
        pre.set_token_mask(mask, layers=["inp", "hidden"])  # the captured hooks read this mask on every replay
        return nn.functional.cross_entropy(model(x, mask), y)

    return model, pre, opt, loss_of


def _state(model: nn.Module, pre: BNPPreconditioner) -> dict[str, Tensor]:
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    for name, layer in pre.layers.items():
        r = layer.running
        state[f"{name}.m"], state[f"{name}.v"] = r.mean_acc.clone(), r.var_acc.clone()
        state[f"{name}.d"] = r.decay.clone()
        state[f"{name}.t"] = torch.as_tensor(r._steps).clone()
    return state


def _eager_states(
    kind: str, options: dict[str, Any], adam: bool, device: str, data: list[tuple[Tensor, ...]]
) -> list[dict]:
    model, pre, opt, loss_of = _make(kind, options, adam, device)
    states = []
    for batch in data:
        opt.zero_grad(set_to_none=True)
        loss_of(*batch).backward()
        pre.step(opt)
        opt.step()
        states.append(_state(model, pre))
    return states


@pytest.mark.parametrize(
    ("device", "adam"),
    [  # (torch's Adam steps with capturable=True only on CUDA)
        pytest.param("cuda", False, marks=NO_CUDA, id="cuda-sgd-momentum"),
        pytest.param("cuda", True, marks=NO_CUDA, id="cuda-adam-capturable"),
        pytest.param("cpu", False, id="cpu-sgd-momentum"),
    ],
    indirect=["device"],
)
@pytest.mark.parametrize("case", list(CASES))
def test_a_replayed_step_equals_the_eager_step_for_step(case: str, adam: bool, device: str) -> None:
    kind, options = CASES[case]
    data = _batches(kind, device)
    expected = _eager_states(kind, options, adam, device, data)
    model, pre, opt, loss_of = _make(kind, options, adam, device)
    graphed = GraphedTrainingStep(loss_of, opt, pre, warmup_steps=3)
    worst = 0.0
    for step, (batch, want) in enumerate(zip(data, expected)):
        graphed(*batch)
        assert graphed.captured == (step >= 3)
        got = _state(model, pre)
        for name, value in want.items():
            diff = (got[name].double() - value.double()).abs().max().item() if value.numel() else 0.0
            worst = max(worst, diff)
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=f"step {step}: {name}")
    if options.get("statistics") != "batch":
        assert all(layer.running.steps == STEPS for layer in pre.layers.values())
    if isinstance(graphed.graph, RecordedGraph):  # (every step after the warm-up was a replay)
        assert graphed.graph.replays == STEPS - 3
    print(f"{case}, {'adam' if adam else 'sgd'}: largest difference {worst:.2e}")


def test_a_non_finite_replayed_step_keeps_the_statistics_and_flush_warnings_names_the_layer(device: str) -> None:
    data = _batches("mlp", device, n=6)
    model, pre, opt, loss_of = _make("mlp", {}, adam=False, device=device)
    graphed = GraphedTrainingStep(loss_of, opt, pre, warmup_steps=3)
    for batch in data[:4]:
        graphed(*batch)
    first = pre.layers["0"].running
    kept = (first.mean_acc.clone(), first.var_acc.clone(), first.steps)
    x, y = data[4]
    bad = x.clone()
    bad[0, 2] = float("nan")
    graphed(bad, y)  # replayed: the first layer's statistics are not finite
    torch.testing.assert_close(first.mean_acc, kept[0], rtol=0, atol=0)
    torch.testing.assert_close(first.var_acc, kept[1], rtol=0, atol=0)
    assert first.steps == kept[2]
    with torch.no_grad():  # (the NaN reached the loss: clear it from the weights and momenta, in place)
        for p in model.parameters():
            p.nan_to_num_(0.0)
        for state in opt.state.values():
            state["momentum_buffer"].nan_to_num_(0.0)
    with pytest.warns(BNPWarning, match=r"'0'.*not finite"):
        pre.flush_warnings()
    graphed(*data[5])  # a finite replay counts again, and the cleared vector has nothing more to say
    assert first.steps == kept[2] + 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", BNPWarning)
        pre.flush_warnings()


def test_by_default_three_steps_warm_up_and_one_is_enough(device: str) -> None:
    data = _batches("mlp", device, n=5)
    for warmup, captured_from in ((None, 3), (1, 1)):
        _, pre, opt, loss_of = _make("mlp", {}, adam=False, device=device)
        graphed = (
            GraphedTrainingStep(loss_of, opt, pre)
            if warmup is None
            else GraphedTrainingStep(loss_of, opt, pre, warmup_steps=warmup)
        )
        for step, batch in enumerate(data):
            graphed(*batch)
            assert graphed.captured == (step >= captured_from)


def test_a_batch_of_other_shapes_is_refused_by_name(device: str) -> None:
    (x, y), _ = _batches("mlp", device, n=2)
    _, pre, opt, loss_of = _make("mlp", {}, adam=False, device=device)
    graphed = GraphedTrainingStep(loss_of, opt, pre, warmup_steps=1)
    graphed(x, y)
    graphed(x, y)
    with pytest.raises(ValueError) as raised:
        graphed(x[:10], y[:10])
    assert str(raised.value) == (
        "`batch` has shapes [(10, 6), (10,)] but the graph was captured for [(16, 6), (16,)]: a replay takes batches "
        "of the captured shapes (the last, smaller batch of an epoch: DataLoader(..., drop_last=True))"
    )
    with pytest.raises(ValueError, match=r"^`batch` has shapes \[\(16, 6\)\] but the graph was captured for"):
        graphed(x)


def test_only_the_layers_of_the_stepped_optimizer_take_bnps_step(device: str) -> None:
    """A layer that another optimizer owns (here: none) keeps its statistics (``pre.step(optimizer)``, not all)."""
    data = _batches("mlp", device, n=6)
    model, pre, _, loss_of = _make("mlp", {}, adam=False, device=device)
    opt = torch.optim.SGD(model[2:].parameters(), lr=0.05, momentum=0.9)  # not the first layer
    graphed = GraphedTrainingStep(loss_of, opt, pre, warmup_steps=2)
    for batch in data:
        graphed(*batch)
    assert pre.layers["0"].running.steps == 0 and pre.layers["2"].running.steps == 6
