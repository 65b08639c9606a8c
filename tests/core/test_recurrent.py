"""Issue 44: recurrent layers (``nn.RNN``, ``nn.LSTM``, ``nn.GRU`` with one layer, and their cells) as BNP layers.

The reference is independent of the kinds: the layer unrolled into one Linear per time step on z_t = [x_t ; h_{t−1}],
its rows built here by plain indexing from the module's own input, ``hx`` and output (one row per real step), and
eq. 15 applied as the explicit matrix M = (1/q²)·P·Pᵀ to the gradient of the stacked weight [W_ih | W_hh] with the
one bias b = b_ih + b_hh (its gradient is b_ih's, equal to b_hh's); a GRU's n rows are two such layers, on x_t and
on h_{t−1} alone. Float64 to 1e-12, float32 to round-off; packed = padded with a token mask; cells over several steps;
statistics pooled over two (fake) ranks; a resumed state; ``num_layers > 1`` and ``proj_size`` named."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from lightning_bnp.core import BNPPreconditioner
from lightning_bnp.core.kinds import register_layer_kind, unregister_layer_kind
from lightning_bnp.core.recurrent import RecurrentKind
from lightning_bnp.core.step_plan import column_block_runs
from tests.core.test_pooling import TwoRanks, ranks  # noqa: F401  (the fixture)

EPS1, EPS2, RHO = 1e-2, 1e-4, 0.99
F64 = {"rtol": 0.0, "atol": 1e-12}


# ------------------------------------------------------------------ the reference: eq. 15 as an explicit matrix
def explicit(gw: Tensor, gb: Tensor | None, z: Tensor, mode: str = "batch") -> tuple[Tensor, Tensor | None]:
    """:func:`explicit_with` without μ and q²."""
    new_w, new_b, _, _ = explicit_with(gw, gb, z, mode)
    return new_w, new_b


def explicit_with(gw: Tensor, gb: Tensor | None, z: Tensor, mode: str) -> tuple[Tensor, Tensor | None, Tensor, float]:
    """M·[g_b ; g_w] per output row, M = (1/q²)·P·Pᵀ from the rows ``z`` (N, n) of one linear layer after one step
    of BNP in ``mode`` ("batch": μ, σ² of this batch; "running": the paper's start μ = 0, σ² = 1 moved once by ρ;
    "corrected": the running statistics divided by 1 − ρ). Without a bias: P = diag(1/σ̃), σ² uncentred. Also
    returns the μ and q² of P."""
    z = z.double()
    rows, n = z.shape
    mu, var = z.mean(0), z.var(0, unbiased=False)
    if gb is None:
        var, mu = var + mu.square(), torch.zeros_like(mu)
    if mode == "running":
        mu, var = (1 - RHO) * mu, RHO * 1.0 + (1 - RHO) * var
    var_t = var + EPS1 * var.max() + EPS2
    q2 = max(n / rows, 1.0)
    p = torch.eye(n + 1, dtype=torch.float64)
    p[0, 1:] = -mu
    p = p @ torch.diag(torch.cat([torch.ones(1, dtype=torch.float64), var_t.rsqrt()]))
    m = p @ p.t() / q2
    g = torch.cat([(torch.zeros(len(gw)) if gb is None else gb).double()[:, None], gw.double()], 1)
    new = g @ m  # (M symmetric) row i: M·[g_b ; g_w]_i
    return new[:, 1:], (None if gb is None else new[:, 0]), mu, q2


def previous_rows(x: Tensor, h0: Tensor, out: Tensor, lengths: list[int], reverse: bool) -> Tensor:
    """[x_t ; h_{t−1}] of every real step, (B, T, ·) tensors of one direction (out: its outputs), by indexing:
    forward h_{t−1} = out[b, t − 1] (h_0 at t = 0), reverse h_{t+1} = out[b, t + 1] (h_0 at t = L_b − 1)."""
    rows = []
    for b, length in enumerate(lengths):
        for t in range(length):
            if reverse:
                h = h0[b] if t == length - 1 else out[b, t + 1]
            else:
                h = h0[b] if t == 0 else out[b, t - 1]
            rows.append(torch.cat([x[b, t], h]))
    return torch.stack(rows).detach()


def expect_pair(raw: dict[str, Tensor], z: Tensor, tail: str, mode: str, span: slice = slice(None)) -> dict[str, Any]:
    """The one layer [W_ih | W_hh] (rows ``span``) with bias b_ih + b_hh on rows ``z``: its weights' new gradients
    and the new gradient of the bias sum; the split BNP documents (each bias G_b/(2q²) − its block's Σ μ·G_w)."""
    n_x = raw[f"weight_ih{tail}"].shape[1]
    gw = torch.cat([raw[f"weight_ih{tail}"][span], raw[f"weight_hh{tail}"][span]], 1)
    gb = raw.get(f"bias_ih{tail}")
    if gb is not None:  # the premise: b_ih and b_hh get one gradient on these rows
        torch.testing.assert_close(raw[f"bias_ih{tail}"][span], raw[f"bias_hh{tail}"][span], rtol=0, atol=1e-14)
        gb = gb[span]
    new_w, new_b, mu, q2 = explicit_with(gw, gb, z, mode)
    # b_ih's own update: G_b/(2q²) − Σ over W_ih's columns (b_hh's: over W_hh's); the two sum to new_b
    b_ih = None if gb is None else gb.double() / (2 * q2) - new_w[:, :n_x] @ mu[:n_x]
    return {"ih": new_w[:, :n_x], "hh": new_w[:, n_x:], "b": new_b, "b_ih": b_ih}


def random_loss(out: Any, seed: int = 5) -> Tensor:
    """Σ R ⊙ t over every tensor of a module's output, R fixed random (a gradient on every output and state)."""
    g = torch.Generator().manual_seed(seed)
    tensors = [out] if isinstance(out, Tensor) else list(_flat(out))
    return sum((torch.randn(t.shape, generator=g, dtype=t.dtype) * t).sum() for t in tensors)  # type: ignore[return-value]


def _flat(item: Any) -> Any:
    for x in item:
        if isinstance(x, Tensor):
            yield x
        else:
            yield from _flat(x)


def step(module: nn.Module, run: Any, mode: str = "batch", **kwargs: Any) -> tuple[dict[str, Tensor], Any]:
    """BNP on ``module`` (its root, so the layers are named by suffix) for one step of ``run(module)`` (returns the
    loss and what the reference needs); the raw gradients and ``run``'s extra."""
    statistics = "batch" if mode == "batch" else "running"
    pre = BNPPreconditioner(module, statistics=statistics, bias_correction=mode == "corrected", **kwargs)
    loss, extra = run(module)
    loss.backward()
    raw = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    pre.step()
    pre.detach()
    return raw, extra


def check_pair(module: nn.Module, expected: dict[str, Any], tail: str, span: slice = slice(None), **tol: Any) -> None:
    grads = dict(module.named_parameters())
    got_ih, got_hh = grads[f"weight_ih{tail}"].grad, grads[f"weight_hh{tail}"].grad
    assert got_ih is not None and got_hh is not None
    torch.testing.assert_close(got_ih[span].double(), expected["ih"], **tol)
    torch.testing.assert_close(got_hh[span].double(), expected["hh"], **tol)
    if expected["b"] is not None:
        b_ih, b_hh = grads[f"bias_ih{tail}"].grad, grads[f"bias_hh{tail}"].grad
        assert b_ih is not None and b_hh is not None
        torch.testing.assert_close((b_ih[span] + b_hh[span]).double(), expected["b"], **tol)
        torch.testing.assert_close(b_ih[span].double(), expected["b_ih"], **tol)  # the documented split


# ------------------------------------------------------------------ modules, padded
def _module(cls: type[nn.Module], *, bidirectional: bool, batch_first: bool, bias: bool = True, dtype: Any = None):
    torch.manual_seed(0)
    return cls(3, 4, bidirectional=bidirectional, batch_first=batch_first, bias=bias).to(dtype or torch.float64)


def _inputs(batch_first: bool, given: bool, directions: int, dtype: Any = torch.float64, steps: int = 3):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, steps, 3, generator=g, dtype=dtype) * 1.5 + 0.5  # (B, T, F)
    h0 = torch.randn(directions, 2, 4, generator=g, dtype=dtype) if given else None
    c0 = torch.randn(directions, 2, 4, generator=g, dtype=dtype) if given else None
    return (x if batch_first else x.transpose(0, 1)), h0, c0


def _run_padded(cls: type[nn.Module], batch_first: bool, h0: Tensor | None, c0: Tensor | None, x: Tensor):
    def run(module: nn.Module) -> tuple[Tensor, Any]:
        hx = None if h0 is None else ((h0, c0) if cls is nn.LSTM else h0)
        output = module(x, hx)
        return random_loss(output), output[0]

    return run


@pytest.mark.parametrize("mode", ["batch", "running", "corrected"])
@pytest.mark.parametrize(
    ("cls", "bidirectional", "batch_first", "given"),
    [
        (nn.LSTM, False, False, False),
        (nn.LSTM, True, True, True),
        (nn.RNN, True, False, True),
        (nn.RNN, False, True, False),
        (nn.LSTM, False, True, True),
    ],
)
def test_rnn_and_lstm_equal_eq15_on_the_stacked_layer(
    cls: type[nn.Module], bidirectional: bool, batch_first: bool, given: bool, mode: str
) -> None:
    """[W_ih | W_hh] with bias b_ih + b_hh on [x_t ; h_{t−1}] (one floor ε1·max σ² over both blocks, q² from
    n_x + n_h = 7 over N = 6 rows: 7/6): the weights' gradients and the bias sum's are eq. 15's, to 1e-12."""
    module = _module(cls, bidirectional=bidirectional, batch_first=batch_first)
    directions = 2 if bidirectional else 1
    x, h0, c0 = _inputs(batch_first, given, directions)
    raw, output = step(module, _run_padded(cls, batch_first, h0, c0, x), mode)
    xb = x if batch_first else x.transpose(0, 1)
    outb = output if batch_first else output.transpose(0, 1)
    for d in range(directions):
        tail = "_l0" + ("_reverse" if d else "")
        start = torch.zeros(2, 4, dtype=torch.float64) if h0 is None else h0[d]
        z = previous_rows(xb, start, outb[..., 4 * d : 4 * d + 4], [3, 3], reverse=bool(d))
        check_pair(module, expect_pair(raw, z, tail, mode), tail, **F64)


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("given", [False, True])
def test_gru_rz_rows_are_one_layer_and_its_n_rows_two(bidirectional: bool, given: bool) -> None:
    """A GRU's r, z rows: the stacked layer with the bias pair; its n rows: W_in with b_in on x_t and W_hn with b_hn
    on h_{t−1} (b_hn sits inside r ⊙ (W_hn h + b_hn)), each with its own q² and floor."""
    module = _module(nn.GRU, bidirectional=bidirectional, batch_first=True)
    directions = 2 if bidirectional else 1
    x, h0, _ = _inputs(True, given, directions)
    raw, output = step(module, _run_padded(nn.GRU, True, h0, None, x))
    grads = dict(module.named_parameters())
    rz, n = slice(0, 8), slice(8, 12)
    for d in range(directions):
        tail = "_l0" + ("_reverse" if d else "")
        start = torch.zeros(2, 4, dtype=torch.float64) if h0 is None else h0[d]
        z = previous_rows(x, start, output[..., 4 * d : 4 * d + 4], [3, 3], reverse=bool(d))
        check_pair(module, expect_pair(raw, z, tail, "batch", rz), tail, rz, **F64)
        for block, cols in (("ih", slice(0, 3)), ("hh", slice(3, 7))):
            want_w, want_b = explicit(
                raw[f"weight_{block}{tail}"][n], raw[f"bias_{block}{tail}"][n], z[:, cols], "batch"
            )
            torch.testing.assert_close(grads[f"weight_{block}{tail}"].grad[n], want_w, **F64)
            torch.testing.assert_close(grads[f"bias_{block}{tail}"].grad[n], want_b, **F64)
        assert not torch.allclose(raw[f"bias_ih{tail}"][n], raw[f"bias_hh{tail}"][n])  # not one bias there


def test_without_bias_the_stacked_layer_is_equilibrated_by_its_uncentred_second_moment() -> None:
    module = _module(nn.LSTM, bidirectional=False, batch_first=False, bias=False)
    x, h0, c0 = _inputs(False, True, 1)
    raw, output = step(module, _run_padded(nn.LSTM, False, h0, c0, x))
    z = previous_rows(x.transpose(0, 1), h0[0], output.transpose(0, 1), [3, 3], reverse=False)
    check_pair(module, expect_pair(raw, z, "_l0", "batch"), "_l0", **F64)


def test_float32_agrees_with_the_float64_reference_to_round_off() -> None:
    module = _module(nn.LSTM, bidirectional=True, batch_first=True, dtype=torch.float32)
    x, h0, c0 = _inputs(True, True, 2, dtype=torch.float32)
    raw, output = step(module, _run_padded(nn.LSTM, True, h0, c0, x))
    for d in range(2):
        tail = "_l0" + ("_reverse" if d else "")
        z = previous_rows(x, h0[d], output[..., 4 * d : 4 * d + 4], [3, 3], reverse=bool(d))
        check_pair(module, expect_pair(raw, z, tail, "batch"), tail, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ packed = padded with a token mask
LENGTHS = [5, 3, 2]


def _padded_batch(dtype: Any = torch.float64) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(3)
    mask = torch.arange(5)[None] < torch.tensor(LENGTHS)[:, None]  # (B, T)
    x = torch.randn(3, 5, 3, generator=g, dtype=dtype)
    x[~mask] = 7.0  # junk in the padding (finite: the backward multiplies it by a zero gradient)
    return x, mask


def _real_loss(out: Tensor, mask: Tensor) -> Tensor:
    g = torch.Generator().manual_seed(9)
    weights = torch.randn(out.shape, generator=g, dtype=out.dtype)
    return torch.where(mask[..., None], weights * out, 0.0).sum()


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
def test_a_packed_batch_equals_the_padded_one_with_a_token_mask_and_the_reference(cls: type[nn.Module]) -> None:
    x, mask = _padded_batch()
    torch.manual_seed(0)
    packed_module = cls(3, 4, batch_first=True).double()
    masked_module = copy.deepcopy(packed_module)
    pre = BNPPreconditioner(packed_module, statistics="batch")
    packed = pack_padded_sequence(x, torch.tensor(LENGTHS), batch_first=True, enforce_sorted=False)
    out, _ = pad_packed_sequence(packed_module(packed)[0], batch_first=True, total_length=5)
    _real_loss(out, mask).backward()
    raw = {n: p.grad.clone() for n, p in packed_module.named_parameters()}
    pre.step()
    masked = BNPPreconditioner(masked_module, statistics="batch")
    with masked.token_mask(mask):
        out_masked = masked_module(x)[0]
    _real_loss(out_masked, mask).backward()
    masked.step()
    for (name, p), q in zip(packed_module.named_parameters(), masked_module.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-13, atol=1e-13, msg=name)
    z = previous_rows(x, torch.zeros(3, 4, dtype=torch.float64), out, LENGTHS, reverse=False)
    span = slice(0, 8) if cls is nn.GRU else slice(None)
    check_pair(packed_module, expect_pair(raw, z, "_l0", "batch", span), "_l0", span, **F64)


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
def test_a_packed_bidirectional_batch_with_given_states_equals_the_reference(cls: type[nn.Module]) -> None:
    x, _ = _padded_batch()
    torch.manual_seed(0)
    module = cls(3, 4, bidirectional=True).double()
    g = torch.Generator().manual_seed(4)
    h0, c0 = (
        torch.randn(2, 3, 4, generator=g, dtype=torch.float64),
        torch.randn(2, 3, 4, generator=g, dtype=torch.float64),
    )
    packed = pack_padded_sequence(x.transpose(0, 1), torch.tensor(LENGTHS), enforce_sorted=False)

    def run(m: nn.Module) -> tuple[Tensor, Any]:
        output = m(packed, (h0, c0) if cls is nn.LSTM else h0)
        padded, _ = pad_packed_sequence(output[0], batch_first=True, total_length=5)
        return random_loss(output[0].data) + random_loss(output[1], seed=6), padded

    raw, out = step(module, run)
    span = slice(0, 8) if cls is nn.GRU else slice(None)
    for d in range(2):
        tail = "_l0" + ("_reverse" if d else "")
        z = previous_rows(x, h0[d], out[..., 4 * d : 4 * d + 4], LENGTHS, reverse=bool(d))
        check_pair(module, expect_pair(raw, z, tail, "batch", span), tail, span, **F64)


def test_a_token_mask_on_a_bidirectional_layer_or_a_packed_input_is_refused_by_name() -> None:
    x, mask = _padded_batch()
    module = nn.LSTM(3, 4, batch_first=True, bidirectional=True).double()
    pre = BNPPreconditioner(module)
    with (
        pytest.raises(ValueError, match=r"LSTM\.ih_l0_reverse: the reverse direction.*pack the batch"),
        pre.token_mask(mask),
    ):
        module(x)
    pre.detach()
    module = nn.GRU(3, 4, batch_first=True).double()
    pre = BNPPreconditioner(module)
    packed = pack_padded_sequence(x, torch.tensor(LENGTHS), batch_first=True, enforce_sorted=False)
    with (
        pytest.raises(ValueError, match=r"GRU\.ih_l0\.n: the GRU got a PackedSequence while a token mask is set"),
        pre.token_mask(mask),
    ):
        module(packed)
    pre.detach()


def test_the_statistics_count_when_the_backward_reaches_only_the_final_state() -> None:
    """A classifier on h_n alone: the output sequence gets no gradient, the step still has the statistics."""
    module = nn.LSTM(3, 4).double()
    x, _, _ = _inputs(False, False, 1)

    def run(m: nn.Module) -> tuple[Tensor, Any]:
        output, (h_n, _) = m(x)
        return h_n.square().sum(), output

    raw, output = step(module, run)
    z = previous_rows(x.transpose(0, 1), torch.zeros(2, 4, dtype=torch.float64), output.transpose(0, 1), [3, 3], False)
    check_pair(module, expect_pair(raw, z, "_l0", "batch"), "_l0", **F64)


# ------------------------------------------------------------------ cells
@pytest.mark.parametrize("cls", [nn.RNNCell, nn.LSTMCell, nn.GRUCell])
def test_a_cell_called_once_per_step_pools_its_calls_into_one_layer(cls: type[nn.Module]) -> None:
    """Three calls, the first without ``hx`` (zeros): one row per sample and call, [x_t ; h_{t−1}] each."""
    torch.manual_seed(0)
    cell = cls(3, 4).double()
    x, _, _ = _inputs(False, False, 1)  # (T, B, F)

    def run(m: nn.Module) -> tuple[Tensor, Any]:
        state: Any = None
        rows, loss = [], torch.zeros((), dtype=torch.float64)
        for t in range(3):
            h_prev = (
                torch.zeros(2, 4, dtype=torch.float64) if state is None else (state[0] if cls is nn.LSTMCell else state)
            )
            rows.append(torch.cat([x[t], h_prev], 1).detach())
            state = m(x[t], state)
            loss = loss + random_loss(state, seed=t)
        return loss, torch.cat(rows)

    raw, z = step(cell, run)
    span = slice(0, 8) if cls is nn.GRUCell else slice(None)
    check_pair(cell, expect_pair(raw, z, "", "batch", span), "", span, **F64)
    if cls is nn.GRUCell:
        grads = dict(cell.named_parameters())
        for block, cols in (("ih", slice(0, 3)), ("hh", slice(3, 7))):
            want_w, want_b = explicit(raw[f"weight_{block}"][8:], raw[f"bias_{block}"][8:], z[:, cols], "batch")
            torch.testing.assert_close(grads[f"weight_{block}"].grad[8:], want_w, **F64)
            torch.testing.assert_close(grads[f"bias_{block}"].grad[8:], want_b, **F64)


def test_an_lstm_cell_at_batch_size_one_takes_the_online_rule_on_both_blocks() -> None:
    """N = 1 (online learning): σ²_H = (z − μ_running)², per block, as for a Linear on [x ; h]."""
    torch.manual_seed(0)
    cell = nn.LSTMCell(3, 4).double()
    lin = nn.Linear(7, 16).double()
    with torch.no_grad():
        lin.weight.copy_(torch.cat([cell.weight_ih, cell.weight_hh], 1))
        lin.bias.copy_(cell.bias_ih + cell.bias_hh)
    pre_cell, pre_lin = BNPPreconditioner(cell), BNPPreconditioner(lin)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        x, h, c = (torch.randn(1, k, generator=g, dtype=torch.float64) for k in (3, 4, 4))
        h_new, c_new = cell(x, (h, c))
        (h_new.sum() + c_new.square().sum()).backward()
        # the Linear sees [x ; h] and gets the gradient of the pre-activation a = W z + b
        lin(torch.cat([x, h], 1)).sum().backward(torch.zeros((), dtype=torch.float64))  # its statistics
        assert cell.weight_ih.grad is not None and cell.weight_hh.grad is not None and cell.bias_ih.grad is not None
        lin.weight.grad = torch.cat([cell.weight_ih.grad, cell.weight_hh.grad], 1)
        lin.bias.grad = cell.bias_ih.grad.clone()
        pre_cell.step()
        pre_lin.step()
        torch.testing.assert_close(torch.cat([cell.weight_ih.grad, cell.weight_hh.grad], 1), lin.weight.grad, **F64)
        torch.testing.assert_close(cell.bias_ih.grad + cell.bias_hh.grad, lin.bias.grad, **F64)
        for p in itertools.chain(cell.parameters(), lin.parameters()):
            p.grad = None


# ------------------------------------------------------------------ what is left alone, and why
def test_a_multi_layer_module_is_left_alone_whole_and_named_with_its_reason() -> None:
    """No silent mix: none of its weights is transformed (layer 0's W_hh sees h_{t−1} inside the kernel, and its
    bias pair couples it with W_ih), each named; the gradients are the raw ones."""
    model = nn.ModuleDict({"rnn": nn.LSTM(3, 4, num_layers=2).double(), "head": nn.Linear(4, 2).double()})
    pre = BNPPreconditioner(model)
    assert list(pre.layers) == ["head"]
    names = ["weight_ih_l0", "weight_hh_l0", "weight_ih_l1", "weight_hh_l1"]
    assert sorted(pre.skipped) == sorted(f"rnn.{n}" for n in names)
    assert all("num_layers=2" in reason and "split_recurrent" in reason for reason in pre.skipped.values())
    x = torch.randn(3, 2, 3, dtype=torch.float64)
    model["head"](model["rnn"](x)[0]).sum().backward()
    raw = {n: p.grad.clone() for n, p in model["rnn"].named_parameters()}
    pre.step()
    for n, p in model["rnn"].named_parameters():
        assert torch.equal(p.grad, raw[n]), n
    pre.detach()


def test_an_lstm_projection_is_named_and_its_other_weights_are_exact() -> None:
    """``proj_size``: h is the projection's output (width 2), so W_hh's columns are 2; weight_hr is left alone."""
    torch.manual_seed(0)
    module = nn.LSTM(3, 4, proj_size=2).double()
    x, _, _ = _inputs(False, False, 1)
    pre = BNPPreconditioner(module, statistics="batch")
    assert list(pre.layers) == ["ih_l0", "hh_l0"]
    assert list(pre.skipped) == ["weight_hr_l0"] and "o_t ⊙ tanh(c_t)" in pre.skipped["weight_hr_l0"]
    output = module(x)
    random_loss(output).backward()
    raw = {n: p.grad.clone() for n, p in module.named_parameters()}
    pre.step()
    assert torch.equal(module.weight_hr_l0.grad, raw["weight_hr_l0"])
    z = previous_rows(
        x.transpose(0, 1), torch.zeros(2, 2, dtype=torch.float64), output[0].transpose(0, 1), [3, 3], False
    )
    check_pair(module, expect_pair(raw, z, "_l0", "batch"), "_l0", **F64)


# ------------------------------------------------------------------ ranks and checkpoints
def test_two_ranks_pool_into_the_statistics_of_the_whole_batch(ranks: TwoRanks) -> None:  # noqa: F811
    """Each rank runs half the sequences; the same gradient on both (as DDP's all-reduce leaves it): both transform it
    as BNP without ranks does on all the sequences."""
    x, _, _ = _inputs(True, False, 1, steps=4)
    x = torch.cat([x, x.flip(1) * 2 + 1])  # 4 sequences
    torch.manual_seed(0)
    whole = nn.GRU(3, 4, batch_first=True).double()
    nets = [copy.deepcopy(whole), copy.deepcopy(whole)]
    pres = [BNPPreconditioner(n, statistics="batch", sync_statistics=True, process_group=ranks.group) for n in nets]
    reference = BNPPreconditioner(whole, statistics="batch", sync_statistics=False)
    random_loss(whole(x)).backward()
    for net, part in zip(nets, (x[:2], x[2:])):
        net(part)[0].sum().backward()  # statistics of this rank's part
        for p, q in zip(net.parameters(), whole.parameters()):
            p.grad = q.grad.clone()  # the all-reduced gradient
    reference.step()
    ranks.run(pres[0].step, pres[1].step)
    for net in nets:
        for (name, p), q in zip(net.named_parameters(), whole.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)


def test_a_resumed_state_continues_the_same_steps() -> None:
    """Two steps, ``state_dict`` through a copy, a third step: the same as three steps without the break."""
    torch.manual_seed(0)
    first = nn.LSTM(3, 4, bidirectional=True).double()
    second = copy.deepcopy(first)
    x, h0, c0 = _inputs(False, True, 2)
    pre = BNPPreconditioner(first)
    for i in range(3):
        first.zero_grad()
        random_loss(first(x + i, (h0, c0))).backward()
        pre.step()
        if i == 1:
            resumed = BNPPreconditioner(second)
            resumed.load_state_dict(copy.deepcopy(pre.state_dict()))
    random_loss(second(x + 2, (h0, c0))).backward()
    resumed.step()
    for (name, p), q in zip(first.named_parameters(), second.parameters()):
        assert torch.equal(p.grad, q.grad), name


# ------------------------------------------------------------------ cost, side by side
class _LSTMTagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.LSTM(6, 8, batch_first=True), nn.Linear(8, 5)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.rnn(x)[0])


class _TwoLinears(nn.Module):
    """The LSTM layer's two weight blocks as two Linears of the same sizes, on (B, T, ·) inputs of the same rows."""

    def __init__(self) -> None:
        super().__init__()
        self.ih, self.hh, self.head = nn.Linear(6, 32), nn.Linear(8, 32), nn.Linear(8, 5)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(x[..., :1]).expand(*x.shape[:-1], 8)
        return self.head((self.ih(x) + self.hh(h))[..., :8])


def test_an_lstm_layer_costs_two_linears_plus_the_shift_of_its_outputs() -> None:
    """Counted as a GPU's host pays them (``benchmarks.op_count``): what BNP adds to a step of an LSTM tagger is what
    it adds with the LSTM's W_ih and W_hh as two Linears of the same sizes, plus one call per direction (h_{t−1} is
    the output shifted by one step: one ``pad``, or one ``cat`` with a given h_0); the ε1 floor over each layer's
    two blocks costs the launches of a floor per layer; no host read."""
    from benchmarks.op_count import added_cost

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 7, 6, generator=g), torch.randint(5, (4, 7), generator=g)
    lstm, _ = added_cost(_LSTMTagger, x, y)
    linears, _ = added_cost(_TwoLinears, x, y)
    assert lstm.host_reads == linears.host_reads == 0
    extra = dict(lstm.by_name)
    for name, count in linears.by_name.items():
        extra[name] = extra.get(name, 0) - count
    assert {name: n for name, n in extra.items() if n} == {"aten::pad": 1}
    assert lstm.calls == linears.calls + 1


def test_the_floor_of_a_run_of_column_blocks_is_the_max_over_the_run() -> None:
    """``FeatureLayout(floor_runs=…)``: layers 1 and 2 are the blocks of one layer; layers 0 and 3 stand alone."""
    from lightning_bnp.core.layout import FeatureLayout

    layout = FeatureLayout([2, 1, 2, 1], [True] * 4, torch.device("cpu"), torch.float64, floor_runs=[(1, 2)])
    flat = torch.tensor([1.0, 5.0, 2.0, 0.5, 3.0, -7.0], dtype=torch.float64)
    assert layout.layer_max(flat).tolist() == [5.0, 5.0, 3.0, 3.0, 3.0, -7.0]
    decay = torch.tensor([0.25, 0.5, 0.75, 1.0], dtype=torch.float64)  # d of each layer (d differs in a run)
    state = torch.cat([torch.zeros(6, dtype=torch.float64), flat, decay])  # [m ; v ; d]
    # per entry: its run's (or layer's) max v + 2·d of its own layer
    assert layout.floor_entries(state, 2.0).tolist() == [5.5, 5.5, 4.0, 4.5, 4.5, -5.0]
    assert layout.segment_max(flat).tolist() == [5.0, 2.0, 3.0, -7.0]  # each layer's own (the warnings' peak)


def test_the_step_transform_of_each_block_maps_other_vectors_as_it_mapped_the_gradient() -> None:
    """``layer.transform.apply_`` (what z-space regularization and the landscape probes use) carries the bias share:
    applied to the raw gradients it gives what the step gave."""
    module = _module(nn.GRU, bidirectional=True, batch_first=False)
    x, h0, _ = _inputs(False, True, 2)
    pre = BNPPreconditioner(module, statistics="batch")
    random_loss(module(x, h0)).backward()
    raw = {n: p.grad.clone() for n, p in module.named_parameters()}
    pre.step()
    grads = dict(module.named_parameters())
    for layer in pre.layers.values():
        assert layer.transform is not None
        vec_w, vec_b = raw[layer.kind.weight_name].clone(), raw[layer.kind.bias_name].clone()  # type: ignore[index]
        layer.transform.apply_(vec_w, vec_b)
        rows = layer.rows
        torch.testing.assert_close(rows(vec_w), rows(grads[layer.kind.weight_name].grad), **F64)
        torch.testing.assert_close(layer.bias_rows(vec_b), layer.bias_rows(grads[layer.kind.bias_name].grad), **F64)  # type: ignore[index]
    assert sorted(layer.transform.share for layer in pre.layers.values()) == [1] * 4 + [2] * 4  # type: ignore[union-attr]
    pre.detach()


def test_a_compiled_step_transforms_a_gru_as_the_eager_step_does() -> None:
    """``compile_step``: q² as tensors, the bias share and the run floor inside one graph, to round-off."""
    module = _module(nn.GRU, bidirectional=True, batch_first=False)
    compiled_module = copy.deepcopy(module)
    eager, compiled = BNPPreconditioner(module), BNPPreconditioner(compiled_module).compile_step()
    x, h0, _ = _inputs(False, True, 2)
    for i in range(2):
        for m, pre in ((module, eager), (compiled_module, compiled)):
            m.zero_grad()
            random_loss(m(x + i, h0)).backward()
            pre.step()
        for (name, p), q in zip(module.named_parameters(), compiled_module.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-13, msg=name)


def test_an_unbatched_sequence_and_an_unbatched_cell_are_one_sample() -> None:
    """A (T, F) input (``hx`` (D, H)) and a cell's (F,) input are one sequence, one row per step."""
    torch.manual_seed(0)
    module = nn.LSTM(3, 4, bidirectional=True).double()
    g = torch.Generator().manual_seed(8)
    x = torch.randn(4, 3, generator=g, dtype=torch.float64)
    h0, c0 = (torch.randn(2, 4, generator=g, dtype=torch.float64) for _ in range(2))
    raw, output = step(module, lambda m: _once(m, x, h0, c0))
    for d in range(2):
        tail = "_l0" + ("_reverse" if d else "")
        z = previous_rows(x[None], h0[d][None], output[None, :, 4 * d : 4 * d + 4], [4], reverse=bool(d))
        check_pair(module, expect_pair(raw, z, tail, "batch"), tail, **F64)
    cell = nn.GRUCell(3, 4).double()

    def run(m: nn.Module) -> tuple[Tensor, Any]:
        h1 = m(x[0])
        h2 = m(x[1], h1)
        rows = torch.stack([torch.cat([x[0], torch.zeros(4, dtype=torch.float64)]), torch.cat([x[1], h1.detach()])])
        return random_loss((h1, h2)), rows

    raw, z = step(cell, run)
    check_pair(cell, expect_pair(raw, z, "", "batch", slice(0, 8)), "", slice(0, 8), **F64)


def _once(module: nn.Module, x: Tensor, h0: Tensor, c0: Tensor) -> tuple[Tensor, Tensor]:
    output = module(x, (h0, c0))
    return random_loss(output), output[0]


def test_a_cell_whose_two_outputs_reach_the_loss_counts_its_call_once() -> None:
    """An ``LSTMCell``'s h and c come from two autograd nodes: a backward that reaches both holds the call's rows once
    (5 rows, not 10), and they count when the weights' gradients accumulate."""
    torch.manual_seed(0)
    cell = nn.LSTMCell(3, 4)
    pre = BNPPreconditioner(cell)
    h, c = cell(torch.randn(5, 3))
    assert h.grad_fn is not c.grad_fn
    (h.square().sum() + c.square().sum()).backward()
    assert {name: (layer.moments.rows, layer.moments.samples) for name, layer in pre.layers.items()} == {
        "ih": (5, 5),
        "hh": (5, 5),
    }


def test_each_layers_own_module_says_whether_its_blocks_are_column_blocks_of_one_layer() -> None:
    """:meth:`LayerKind.column_block` is asked of each layer's module: a user's kind that joins the two blocks of
    some cells only (here the ones flagged ``joined``) gets one run for those and layers on their own for the rest."""

    class FlaggedCell(nn.RNNCell):
        joined = True

    class FlaggedCellKind(RecurrentKind):
        def column_block(self, module: nn.Module) -> tuple[int, int] | None:
            return super().column_block(module) if module.joined else None

    kinds = [register_layer_kind(FlaggedCellKind(FlaggedCell, block)) for block in ("ih", "hh")]
    try:
        model = nn.ModuleList([FlaggedCell(2, 3), FlaggedCell(2, 3), FlaggedCell(2, 3)])
        model[1].joined = False
        pre = BNPPreconditioner(model)
        assert list(pre.layers) == ["0.ih", "0.hh", "1.ih", "1.hh", "2.ih", "2.hh"]
        assert column_block_runs(list(pre.layers.values())) == ((0, 2), (4, 2))
        pre.detach()
    finally:
        for kind in kinds:
            unregister_layer_kind(kind.name)
