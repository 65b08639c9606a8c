"""``benchmarks.reproduce``: the ``--quick`` run end to end, and the pieces its verdicts rest on."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from benchmarks.reproduce import convergence, cost
from benchmarks.reproduce.hessian import hessian_kappa
from benchmarks.reproduce.runs import CHANCE, Job, Run, train
from benchmarks.reproduce.selection import Choice, choose, score
from benchmarks.reproduce.settings import CONVERGENCE, WC, Setting, quick
from example_projects.models import fc_network
from lightning_bnp.core import BNPPreconditioner
from tests.warm_python import run_python

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ("convergence.png", "kappa.png", "cost.png", "weight_conditioning.png")


@pytest.mark.slow
def test_quick_run_writes_report_and_figures(tmp_path: Path) -> None:
    proc = run_python(
        # one seed: this checks the report end to end, not the numbers (halves the suite's longest test); one torch
        # thread for the timings: with 2 on a machine whose cores the other test workers keep busy, each timed step
        # waits on a thread that is not running (the quick timings took longer than all the training)
        "-m",
        "benchmarks.reproduce",
        "--quick",
        "--seeds",
        "1",
        "--out",
        str(tmp_path),
        "--workers",
        "2",
        "--threads",
        "1",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (tmp_path / "RESULTS.md").read_text()
    assert "QUICK MODE" in text
    for heading in (
        "## 1. Convergence",
        "## 2. Hessian-block",
        "## 3. Cost",
        "## 4. BN vs BN + Weight",
        "## 5. The default start",
    ):
        assert heading in text
    assert text.count("reproduced**") >= 9  # every claim gets a verdict
    for name in FIGURES:
        png = tmp_path / "results" / name
        assert png.stat().st_size < 150_000, name
        assert f"results/{name}" in text


def test_bad_arguments_name_the_option() -> None:
    proc = run_python("-m", "benchmarks.reproduce", "--seeds", "0")
    assert proc.returncode == 2
    assert "--seeds must be a positive integer, got 0" in proc.stderr


def _run(val: float, test: float, diverged: bool = False) -> Run:
    return Run(steps=[0, 10, 20], val=[0.1, val, val], test=[0.1, test, test], loss=[2.3, 1.0, 0.5], diverged=diverged)


def test_learning_rate_is_chosen_on_validation_not_test() -> None:
    s = Setting("FC", 60, 1, (0.1, 1.0), ("BNP",), "test", 0.9, seeds=1)
    results = {
        Job.of(s, "BNP", 0.1, 0): _run(val=0.9, test=0.5),
        Job.of(s, "BNP", 1.0, 0): _run(val=0.8, test=0.99),
    }
    choice = choose(s, "BNP", results)
    assert choice.lr == 0.1
    assert choice.final == [0.5]
    assert choice.edge
    assert choice.reached() == []  # 0.5 never reaches the 0.9 target
    assert choice.speed() == 20  # counted as the whole run


def test_diverged_runs_score_as_chance() -> None:
    assert score([_run(val=0.9, test=0.9, diverged=True)]) == CHANCE


def test_runs_of_different_lengths_do_not_share_a_result() -> None:
    # the CNN batch-128 convergence runs and the Weight Conditioning sweep both train BN at lr 0.1 and 0.5: the
    # same configuration is one run (one key), a different length is another
    cnn128 = next(s for s in CONVERGENCE if s.model == "CNN" and s.batch == WC.batch)
    longer = replace(WC, epochs=cnn128.epochs + 1)
    assert cnn128.steps != longer.steps
    assert Job.of(cnn128, "BN", 0.1, 0) != Job.of(longer, "BN", 0.1, 0)
    assert Job.of(cnn128, "BN", 0.1, 0) == Job.of(replace(WC, epochs=cnn128.epochs), "BN", 0.1, 0)
    # the optimizer's settings are part of the key too
    assert Job.of(cnn128, "BN", 0.1, 0) != Job.of(replace(cnn128, momentum=0.9), "BN", 0.1, 0)


def test_ahead_compares_accuracy_first_then_steps_to_target() -> None:
    s = Setting("FC", 60, 1, (0.1,), ("a",), "test", 0.9)

    def choice(final: float, reach_at: int) -> Choice:
        steps = [0, 10, 20, 30, 40]
        test = [0.1 if st < reach_at else final for st in steps]
        return Choice(s, "a", 0.1, [Run(steps=steps, val=test, test=test, loss=[1.0] * 5)], {}, {})

    assert convergence.ahead(choice(0.95, 10), choice(0.93, 10)) == 1  # 2 points more
    assert convergence.ahead(choice(0.935, 40), choice(0.93, 10)) == -1  # within 1 point, 4× slower
    assert convergence.ahead(choice(0.935, 20), choice(0.93, 20)) == 0


def test_cnn_q2_follows_algorithm_3() -> None:
    # the paper's 'valid' CNN on 28×28: conv outputs 26×26, 11×11, 3×3; dense fan-ins 3·3·32 = 288 and 64
    # conv: max(c_in·k²/N, √(r·s)); dense: max(n/N, 1)
    assert convergence.cnn_q2(1, 28, 128) == [26.0, 11.0, 64 * 9 / 128, 288 / 128, 1.0]
    assert convergence.cnn_q2(1, 28, 2) == [26.0, 32 * 9 / 2, 64 * 9 / 2, 288 / 2, 64 / 2]
    # on CIFAR-10 (3×32×32): outputs 30×30, 13×13, 4×4; first dense fan-in 4·4·32 = 512
    assert convergence.cnn_q2(3, 32, 128) == [30.0, 13.0, 64 * 9 / 128, 512 / 128, 1.0]


def test_flop_model_crossover_matches_prop6() -> None:
    # Prop. 6 vs the BN count: ignoring first-order terms, BNP is cheaper iff 28·N > 6·n (per hidden layer)
    width = 1000
    assert cost.extra_flops_ratio(width, 16) > 1
    assert cost.extra_flops_ratio(width, 1024) < 1
    # the N-dependent terms, by hand
    assert cost.flops_bnp(width, 1) - cost.flops_bnp(width, 0) == 4 * (784 + 3 * width)
    assert cost.flops_bn(width, 2) - cost.flops_bn(width, 1) == 3 * 32 * width


def _wide_rows(extra_ratios: list[float]) -> list[cost.CostRow]:
    """Width-1000 FC rows whose (BNP − vanilla)/(BN − vanilla) are the given ratios (BN extra = 100 µs)."""
    batches = (16, 64, 256, 1024)
    return [
        cost.CostRow("FC", 1000, b, {"vanilla": 1000.0, "BN": 1100.0, "BNP": 1000.0 + 100.0 * q})
        for b, q in zip(batches, extra_ratios)
    ]


def test_prop6_claim_states_what_was_measured() -> None:
    batch1 = cost.CostRow("FC", 100, 1, {"vanilla": 300.0, "BNP": 900.0})  # BN cannot run on one row
    table = "\n".join(cost.section([batch1, *_wide_rows([3.0, 2.0, 1.5, 0.8])], "test"))
    assert "| FC | 100 | 1 | 300 | n/a | 900 | 3.00 | n/a | n/a |" in table
    assert "**partly reproduced** at width 1000" in table and "ends below it." in table
    above = "\n".join(cost.section(_wide_rows([3.0, 2.0, 1.5, 1.2]), "test"))
    assert "**not reproduced** at width 1000" in above and "ends above it." in above
    assert "ends below it" not in above
    # a FLOP model whose crossover (N ≈ 214) falls between 64 and 256 is met exactly
    exact = "\n".join(cost.section(_wide_rows([3.0, 2.0, 0.6, 0.3]), "test"))
    assert "**reproduced** at width 1000" in exact


def _explicit_kappa(m: torch.Tensor) -> float:
    eig = torch.linalg.eigvalsh(m).abs()
    nonzero = eig[eig > m.shape[0] * torch.finfo(torch.float64).eps * eig.max()]
    return float(eig.max() / nonzero.min())


def test_hessian_kappa_against_the_softmax_formula() -> None:
    # ∇²_ŵ L for output neuron 0 of softmax cross-entropy: (1/N) Σ_i p_i0 (1 − p_i0) ĥ_i ĥ_iᵀ, ĥ_i = [1, h_i]
    torch.manual_seed(0)
    net = fc_network(in_features=5, hidden=7, depth=2, num_classes=3)
    pre = BNPPreconditioner(net, bias_correction=True)  # the first step's running statistics are the batch's
    x, y = torch.randn(12, 5), torch.randint(0, 3, (12,))
    loss_fn = nn.CrossEntropyLoss()
    loss_fn(net(x), y).backward()
    pre.step()
    got = hessian_kappa(net, pre, loss_fn, x, y)

    x64, net64 = x.double(), fc_network(in_features=5, hidden=7, depth=2, num_classes=3).double()
    net64.load_state_dict(net.state_dict())
    with torch.no_grad():
        h = net64[:-1](x64)
        p0 = net64(x64).softmax(1)[:, 0]
    h_hat = torch.cat([torch.ones(12, 1, dtype=torch.float64), h], 1)
    hess = (h_hat.T * (p0 * (1 - p0))) @ h_hat / 12
    assert got["original"] == pytest.approx(_explicit_kappa(hess), rel=1e-6)
    # the theory's P₀ standardizes the live inputs: P₀ᵀ∇²L P₀ = (1/N) Σ_i p_i0 (1 − p_i0) z_i z_iᵀ
    live = h.var(0, unbiased=False) > 1e-12
    z = (h[:, live] - h[:, live].mean(0)) / h[:, live].std(0, unbiased=False)
    z_hat = torch.cat([torch.ones(12, 1, dtype=torch.float64), z], 1)
    assert got["batch_preconditioned"] == pytest.approx(
        _explicit_kappa((z_hat.T * (p0 * (1 - p0))) @ z_hat / 12), rel=1e-6
    )
    sigma = h[:, live].std(0, unbiased=False)
    assert got["kappa_D_raw"] == pytest.approx(float(sigma.max() / sigma.min()), rel=1e-9)
    assert got["dead"] == float((~live).sum())
    # BNP's P: running μ and σ̃² of the step (first step, bias-corrected: the batch's, plus the ε floors)
    var = h.var(0, unbiased=False)
    var_t = var + 1e-2 * var.max() + 1e-4
    u = torch.eye(8, dtype=torch.float64)
    u[0, 1:] = -h.mean(0)
    p = u @ torch.diag(torch.cat([torch.ones(1, dtype=torch.float64), var_t.rsqrt()]))
    assert got["preconditioned"] == pytest.approx(_explicit_kappa(p.T @ hess @ p), rel=1e-5)
    assert got["kappa_D_floored"] == pytest.approx(float((var_t.max() / var_t.min()).sqrt()), rel=1e-5)


def test_training_run_records_every_evaluation_and_kappa() -> None:
    s = quick(Setting("FC2", 6, 1, (0.01, 0.05, 0.1), ("BNP",), "test", 0.9, kappa=True))  # 40 of 200 steps
    run = train(Job.of(s, "BNP", 0.05, 0))
    assert run.steps == [0, 10, 20, 30, 40]
    assert len(run.test) == len(run.val) == 5
    assert len(run.kappa["original"]) == 4  # steps 0, 10, 20, 30, before their updates
    assert all(math.isfinite(k) for k in run.kappa["preconditioned"])
    assert not run.diverged
