"""Issue 18 §1 through Lightning: ``BatchNormPreconditioning(conv_statistics="column")`` with gradient
accumulation, checkpoints, and the ConditionNumberMonitor's κ(D) and Hessian-block P."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor, nn

from lightning_bnp import BatchNormPreconditioning, ConditionNumberMonitor
from lightning_bnp.core import BNPPreconditioner, BNPWarning
from tests.callbacks.test_monitors import kappa, scalars, var_tilde_ref
from tests.helpers import BoringClassifier, _fit, make_cnn, make_data


def explicit_column_p(mu: Tensor, var_t: Tensor) -> Tensor:
    """P = [[1, −μᵀ], [0, I]]·diag(1, 1/σ̃) over im2col columns: one entry per (channel, offset), no ⊗e."""
    u = torch.eye(mu.numel() + 1, dtype=torch.float64)
    u[0, 1:] = -mu.double().cpu()
    return u @ torch.diag(torch.cat([torch.ones(1, dtype=torch.float64), var_t.double().cpu().rsqrt()]))


def test_accumulated_micro_batches_equal_one_batch(tmp_path: Path) -> None:
    """Two micro-batches of 4 pool their unfolded rows into one step of 8 (Chan merge of per-column moments)."""
    data = make_data(n=32, shape=(2, 6, 6))
    runs = []
    for batch, accumulate in ((8, 1), (4, 2)):
        model = BoringClassifier(make_cnn())
        bnp = BatchNormPreconditioning(conv_statistics="column")
        _fit(tmp_path, model, data, batch_size=batch, callbacks=[bnp], max_steps=4, accumulate_grad_batches=accumulate)
        runs.append((model, bnp))
    (full, bnp_full), (micro, bnp_micro) = runs
    for (name, p), q in zip(full.named_parameters(), micro.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
    for name, layer in bnp_full.preconditioner.layers.items():  # type: ignore[union-attr]
        other = bnp_micro.preconditioner.layers[name].running  # type: ignore[union-attr]
        assert layer.running.mean_acc.shape == (layer.features,)
        torch.testing.assert_close(other.var_acc, layer.running.var_acc, rtol=1e-5, atol=1e-7)


def test_resume_is_exact_and_the_other_mode_is_refused(tmp_path: Path) -> None:
    data = make_data(n=32, shape=(2, 6, 6))

    def fit(
        steps: int, mode: str = "column", ckpt: str | None = None
    ) -> tuple[BoringClassifier, BatchNormPreconditioning]:
        model = BoringClassifier(make_cnn(), momentum=0.9)
        bnp = BatchNormPreconditioning(conv_statistics=mode)  # type: ignore[arg-type]
        trainer = _fit(tmp_path, model, data, batch_size=8, callbacks=[bnp], max_epochs=steps // 4, ckpt_path=ckpt)
        if ckpt is None:
            trainer.save_checkpoint(tmp_path / f"{steps}.ckpt")
        return model, bnp

    whole, bnp_whole = fit(8)
    fit(4)
    resumed, bnp_resumed = fit(8, ckpt=str(tmp_path / "4.ckpt"))
    for p, q in zip(whole.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    state, again = bnp_whole.state_dict(), bnp_resumed.state_dict()
    assert state["hyperparameters"]["conv_statistics"] == "column"
    for name, layer in state["layers"].items():
        assert torch.equal(layer["var_acc"], again["layers"][name]["var_acc"])
    with pytest.raises(ValueError, match=r"conv_statistics='channel' \(saved with conv_statistics='column'\)"):
        fit(8, mode="channel", ckpt=str(tmp_path / "4.ckpt"))


def test_loading_the_other_mode_loads_nothing_and_1x1_kernels_load_with_a_warning() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 3, 1), nn.ReLU(), nn.Conv2d(3, 2, 3))
    column = BNPPreconditioner(net, conv_statistics="column")
    net(torch.randn(2, 2, 5, 5)).sum().backward()
    column.step()
    saved = column.state_dict()
    fresh = BNPPreconditioner(copy.deepcopy(net), conv_statistics="channel")
    with pytest.raises(ValueError, match=r"layer '2' have 27 entries, but it has 3 with conv_statistics='channel'"):
        fresh.load_state_dict(saved)
    assert all(layer.running.steps == 0 for layer in fresh.layers.values())  # nothing half-loaded
    only_1x1 = {"layers": {"0": saved["layers"]["0"]}, "hyperparameters": saved["hyperparameters"]}
    pointwise = BNPPreconditioner(nn.Sequential(nn.Conv2d(2, 3, 1)), conv_statistics="channel")
    with pytest.warns(BNPWarning, match=r"conv_statistics: saved 'column', now 'channel'"):
        pointwise.load_state_dict(only_1x1)
    assert pointwise.layers["0"].running.steps == 1


def one_monitored_step(
    tmp_path: Path, monitor: ConditionNumberMonitor
) -> tuple[nn.Module, BatchNormPreconditioning, dict]:
    """One step of column-mode BNP on the test CNN at batch 8, logged to TensorBoard: (network, callback, scalars)."""
    bnp = BatchNormPreconditioning(conv_statistics="column")
    model = BoringClassifier(make_cnn())
    trainer = _fit(tmp_path, model, DATA, batch_size=8, callbacks=[bnp, monitor], max_steps=1,
                   logger=TensorBoardLogger(tmp_path))  # fmt: skip
    return model.network, bnp, scalars(trainer)


DATA = make_data(shape=(2, 6, 6))


def test_kappa_d_is_over_the_columns(tmp_path: Path) -> None:
    """After one step the raw statistics are the batch's column σ²_H of the first conv's unfolded input."""
    monitor = ConditionNumberMonitor(every_n_steps=1, hessian_block=False, weight_kappa=False, effective_lr=False)
    _, bnp, logged = one_monitored_step(tmp_path, monitor)
    x = DATA.tensors[0][:8].double()
    cols = F.unfold(x, 3, padding=1).transpose(1, 2).reshape(-1, 18)
    sigma = cols.var(0, correction=0).sqrt()
    d = torch.diag(torch.cat([torch.ones(1, dtype=torch.float64), sigma]).reciprocal())
    assert logged["bnp/kappa_D/network.0"][0][1] == pytest.approx(float(torch.linalg.cond(d)), rel=1e-4)
    var_t = bnp.preconditioner.layers["network.0"].transform.var_t  # type: ignore[union-attr]
    assert var_t.shape == (18,)
    expected = float((var_t.max() / var_t.min()).sqrt())
    assert logged["bnp/kappa_D_floored/network.0"][0][1] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("neuron", [1, 2])
def test_hessian_block_uses_the_columns_of_the_neurons_group(tmp_path: Path, neuron: int) -> None:
    """Conv2d(4, 4, 3, groups=2): output i sees the 2·9 columns of group i // 2, each with its own μ, σ̃."""
    monitor = ConditionNumberMonitor(every_n_steps=1, neuron=neuron, hessian_layers=["network.2"])
    network, bnp, logged = one_monitored_step(tmp_path, monitor)
    net = copy.deepcopy(network).double()
    x, y = DATA.tensors[0][:8].double(), DATA.tensors[1][:8]
    i, fixed = neuron, {name: p.detach() for name, p in net.named_parameters()}

    def loss_of(w_hat: Tensor) -> Tensor:  # the loss as a function of neuron i's [b_i; w_i] alone
        weight, bias = fixed["2.weight"].clone(), fixed["2.bias"].clone()
        weight[i], bias[i] = w_hat[1:].view_as(weight[i]), w_hat[0]
        out = torch.func.functional_call(net, {**fixed, "2.weight": weight, "2.bias": bias}, (x,))
        return F.cross_entropy(out, y)

    w_hat0 = torch.cat([fixed["2.bias"][i : i + 1], fixed["2.weight"][i].reshape(-1)])
    hessian = torch.autograd.functional.hessian(loss_of, w_hat0)
    running = bnp.preconditioner.layers["network.2"].running  # type: ignore[union-attr]
    assert running.mu.shape == (36,)
    seen = slice(18 * (i // 2), 18 * (i // 2) + 18)  # σ̃'s floor: the max over all 36 columns
    pmat = explicit_column_p(running.mu[seen], var_tilde_ref(running.var)[seen])
    expected = kappa(pmat.T @ hessian @ pmat)
    assert logged["bnp/hessian_kappa/network.2/preconditioned"][0][1] == pytest.approx(expected, rel=1e-5)
    # the tolerance above tells the columns' P from the per-channel average's and from the other group's
    per_channel = var_tilde_ref(running.var)[seen].view(2, 9).mean(1).repeat_interleave(9)
    wrong = explicit_column_p(running.mu[seen], per_channel)
    assert kappa(wrong.T @ hessian @ wrong) != pytest.approx(expected, rel=1e-5)
    other = slice(18 - seen.start, 36 - seen.start)
    wrong = explicit_column_p(running.mu[other], var_tilde_ref(running.var)[other])
    assert kappa(wrong.T @ hessian @ wrong) != pytest.approx(expected, rel=1e-5)


def test_callback_argument_is_validated_and_shown() -> None:
    with pytest.raises(ValueError, match=r"`conv_statistics` must be 'channel' or 'column', got 'columns'"):
        BatchNormPreconditioning(conv_statistics="columns")  # type: ignore[arg-type]
    assert repr(BatchNormPreconditioning(conv_statistics="column")).endswith("verbose=True, conv_statistics='column')")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "conv_statistics" not in repr(BatchNormPreconditioning())
