"""Issue 44: ``nn.ConvTranspose{1,2,3}d`` is a linear layer on an explicit matrix [e, H] — one row per (sample,
*output* position), one column per (input channel c, tap κ), H[(n, t), (c, κ)] = x[n, c, i] where tap κ of input
position i lands on t and 0 where none does — and BNP on it is Alg. 2 (eq. 15) on that matrix.

The reference builds H column by column through torch's own ``F.conv_transpose*d`` with a one-hot weight (column
(c, κ) is the output of the weight that is 1 at [c, 0, κ] and 0 elsewhere), checks it against the definition with
explicit loops and against the layer's output, and runs a dense Alg. 2 on it written from the paper (the
``DenseAlg2`` and ``explicit_transform`` of the column-statistics tests). q² is Alg. 3's for H:
max(c_in·∏k/N, √L_out), L_out the output positions per sample.
"""

from __future__ import annotations

import copy
import itertools
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DeviceMesh, Replicate, Shard, distribute_tensor

from benchmarks.op_count import profile_cost
from lightning_bnp.core import BNPPreconditioner, BNPWarning
from lightning_bnp.core.moments import column_moments_of_input, moments_of_input
from lightning_bnp.core.transposed_conv import transposed_channel_moments, transposed_column_moments
from tests.core.test_column_statistics import EPS1, EPS2, RHO, DenseAlg2
from tests.core.test_dtensor_gradients import expected_refusal, mesh  # noqa: F401  # a one-rank mesh fixture
from tests.core.test_pooling import TwoRanks, ranks  # noqa: F401  # the fake two-rank group and its fixture

TRANSPOSED = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}
FUNCTIONAL = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def output_padding_for(conv: nn.modules.conv._ConvTransposeNd, x: Tensor, output_size: tuple[int, ...] | None):
    """The output padding that gives ``output_size`` (the layer's own when None), from the output-size formula."""
    if output_size is None:
        return tuple(conv.output_padding)
    natural = [
        (size - 1) * s - 2 * p + d * (k - 1) + 1
        for size, s, p, d, k in zip(x.shape[2:], conv.stride, conv.padding, conv.dilation, conv.kernel_size)
    ]
    return tuple(want - got for want, got in zip(output_size, natural))


def explicit_h(conv: nn.modules.conv._ConvTransposeNd, x: Tensor, output_size: tuple[int, ...] | None = None) -> Tensor:
    """H (N·L_out, c_in·∏k): column (c, κ) is ``conv_transpose`` of ``x`` with a one-hot weight, rows (n, t)."""
    d, kernel = x.dim() - 2, tuple(conv.kernel_size)
    pad = output_padding_for(conv, x, output_size)
    columns = []
    for c in range(x.shape[1]):
        for tap in itertools.product(*(range(k) for k in kernel)):
            w = torch.zeros(x.shape[1], 1, *kernel, dtype=x.dtype)
            w[(c, 0, *tap)] = 1.0
            out = FUNCTIONAL[d](x, w, None, conv.stride, conv.padding, pad, 1, conv.dilation)
            columns.append(out[:, 0].reshape(-1))
    return torch.stack(columns, 1)


def weight_rows(conv: nn.modules.conv._ConvTransposeNd, weight: Tensor) -> Tensor:
    """A (c_in, c_out/groups, *k) tensor as the (c_out, c_in/groups, *k) rows output channels multiply, by indexing
    (a copy): row o of group γ = o // (c_out/groups) is ``weight[γ·c_in/g : (γ+1)·c_in/g, o − γ·c_out/g]``."""
    groups, cin_g, cout_g = conv.groups, conv.in_channels // conv.groups, conv.out_channels // conv.groups
    return torch.stack(
        [weight[(o // cout_g) * cin_g : (o // cout_g + 1) * cin_g, o % cout_g] for o in range(cout_g * groups)]
    )


def dense_weight(conv: nn.modules.conv._ConvTransposeNd) -> Tensor:
    """The (c_out, c_in·∏k) weight matrix of [e, H]: each output channel's row over its own group's columns, 0 over
    the other groups' columns."""
    rows = weight_rows(conv, conv.weight).flatten(1)
    per_group = rows.shape[1]
    dense = torch.zeros(conv.out_channels, conv.in_channels * math.prod(conv.kernel_size), dtype=rows.dtype)
    for o in range(conv.out_channels):
        group = o // (conv.out_channels // conv.groups)
        dense[o, group * per_group : (group + 1) * per_group] = rows[o]
    return dense


def layer_output_rows(y: Tensor) -> Tensor:
    return y.movedim(1, -1).reshape(-1, y.shape[1])


# 1-D/2-D/3-D with stride, padding, output_padding, dilation, no bias; output_size= where given
CASES = [
    (nn.ConvTranspose1d(2, 3, 3, stride=2, padding=1, output_padding=1), (3, 2, 5), None),
    (nn.ConvTranspose1d(2, 2, 4, stride=3, padding=2, dilation=2, bias=False), (2, 2, 6), None),
    (nn.ConvTranspose2d(2, 3, 4, stride=2, padding=1), (2, 2, 4, 3), None),  # DCGAN's block
    (
        nn.ConvTranspose2d(3, 2, (3, 2), stride=(2, 1), padding=(0, 1), dilation=(1, 2), output_padding=(1, 0)),
        (2, 3, 3, 4),
        None,
    ),
    (nn.ConvTranspose2d(2, 2, 3, stride=2, padding=1), (2, 2, 4, 4), (8, 7)),  # output_size=
    (nn.ConvTranspose2d(2, 3, 2, stride=2), (3, 2, 3, 3), None),  # no padding: the per-channel form is exact
    (
        nn.ConvTranspose3d(2, 2, (2, 3, 2), stride=(2, 1, 2), padding=(1, 1, 0), dilation=(1, 2, 1), bias=False),
        (2, 2, 3, 3, 2),
        None,
    ),
    (nn.ConvTranspose3d(1, 2, 3, stride=2, padding=1), (2, 1, 2, 3, 2), (4, 6, 4)),
    (nn.ConvTranspose2d(3, 6, 4, stride=2, padding=1, groups=3), (2, 3, 3, 4), None),  # depthwise
    (nn.ConvTranspose1d(2, 2, 3, stride=2, padding=1, groups=2, bias=False), (3, 2, 5), (10,)),
]
IDS = [f"{type(c).__name__}-{i}" for i, (c, _, _) in enumerate(CASES)]


def test_the_reference_matrix_is_the_definition_and_reproduces_the_layer() -> None:
    """H by one-hot ``conv_transpose`` equals the definition t = i·s + κ·d − p written as loops, and
    [e, H]·[b; W_o] is the layer's output (output_size= included)."""
    conv = nn.ConvTranspose1d(2, 3, 3, stride=2, padding=2, dilation=2, output_padding=1).double()
    x = torch.randn(2, 2, 4, dtype=torch.float64)
    out = conv(x)
    loops = torch.zeros(2 * out.shape[-1], 2 * 3, dtype=torch.float64)
    for n, c, i, tap in itertools.product(range(2), range(2), range(4), range(3)):
        t = i * 2 + tap * 2 - 2
        if 0 <= t < out.shape[-1]:
            loops[n * out.shape[-1] + t, c * 3 + tap] = x[n, c, i]
    assert torch.equal(explicit_h(conv, x), loops)
    for conv, shape, size in CASES:
        conv = copy.deepcopy(conv).double()
        x = torch.randn(shape, dtype=torch.float64)
        y = conv(x, output_size=size) if size is not None else conv(x)
        h = explicit_h(conv, x, size)
        expected = h @ dense_weight(conv).T + (0.0 if conv.bias is None else conv.bias)
        torch.testing.assert_close(expected, layer_output_rows(y), rtol=1e-12, atol=1e-12)


def run_steps(conv: nn.Module, shape: tuple[int, ...], size: tuple[int, ...] | None, dtype: torch.dtype,
              columns: bool, steps: int = 2, calls: int = 1) -> None:  # fmt: skip
    """``steps`` BNP steps (``calls`` forward calls each) against DenseAlg2 on the stacked H, in float64."""
    conv = copy.deepcopy(conv).to(dtype)
    pre = BNPPreconditioner(conv, rho=RHO, eps1=EPS1, eps2=EPS2, conv_statistics="column" if columns else "channel")
    taps = math.prod(conv.kernel_size)
    reference = DenseAlg2(conv.in_channels * taps)
    g = torch.Generator().manual_seed(0)
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 2e-5, "atol": 1e-6}
    for _ in range(steps):
        xs = [torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 1.5 for _ in range(calls)]
        conv.zero_grad()
        outs = [conv(x.to(dtype), output_size=size) if size is not None else conv(x.to(dtype)) for x in xs]
        sum((o * torch.randn(o.shape, generator=g, dtype=torch.float64).to(dtype)).sum() for o in outs).backward()
        grad_w = weight_rows(conv, conv.weight.grad.double())  # BNP's rows: (c_out, c_in/groups, *k)
        grad_b = None if conv.bias is None else conv.bias.grad.double().clone()
        pre.step()
        h = torch.cat([explicit_h(conv.double(), x, size) for x in xs])
        conv.to(dtype)
        if columns:
            reference.step(h, conv.bias is not None)
        else:  # the per-channel form: per channel, all N·L_in input values and N·(L_out − L_in) zeros, on every tap
            values = []
            for x in xs:
                zeros = (h.shape[0] - x.numel() // x.shape[1] * calls) // calls  # this call's N·(L_out − L_in)
                values.append(torch.cat([x.transpose(0, 1).reshape(x.shape[1], -1), x.new_zeros(x.shape[1], zeros)], 1))
            column = torch.cat(values, 1)  # (c_in, every row of every call)
            mean, var = column.mean(1), column.var(1, correction=0)
            if conv.bias is None:
                mean, var = torch.zeros_like(mean), column.square().mean(1)
            reference.mu = RHO * reference.mu + (1 - RHO) * mean.repeat_interleave(taps)
            reference.var = RHO * reference.var + (1 - RHO) * var.repeat_interleave(taps)
        samples = calls * shape[0]
        fan_in = conv.in_channels // conv.groups * taps  # what one output channel sees
        q2 = max(fan_in / samples, math.sqrt(h.shape[0] / samples))  # Alg. 3 step 3 for H
        expected_w, expected_b = reference.transform(conv.groups, grad_w, grad_b, q2)
        torch.testing.assert_close(weight_rows(conv, conv.weight.grad.double()), expected_w, **tol)
        if conv.bias is not None:
            torch.testing.assert_close(conv.bias.grad.double(), expected_b, **tol)
        running = pre.layers[""].running
        spread = 1 if columns else taps  # per channel: one entry for all taps of a channel
        torch.testing.assert_close(running.mu.double().repeat_interleave(spread), reference.mu, **tol)
        torch.testing.assert_close(running.var.double().repeat_interleave(spread), reference.var, **tol)
    pre.detach()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize(("conv", "shape", "size"), CASES, ids=IDS)
def test_column_statistics_are_dense_alg2_on_the_explicit_matrix(
    conv: nn.Module, shape: tuple[int, ...], size: tuple[int, ...] | None, dtype: torch.dtype
) -> None:
    """``conv_statistics="column"``: two steps of Alg. 2 on [e, H] (float64 to 1e-12, float32 to round-off)."""
    torch.manual_seed(1)
    run_steps(conv, shape, size, dtype, columns=True)


def test_two_calls_of_different_sizes_pool_the_rows_of_both() -> None:
    """A layer called twice in a step (two output sizes) is one H of both calls' rows."""
    torch.manual_seed(2)
    conv = nn.ConvTranspose2d(2, 2, 3, stride=2, padding=1)
    run_steps(conv, (2, 2, 3, 3), None, torch.float64, columns=True, calls=2)
    run_steps(conv, (2, 2, 3, 3), (6, 5), torch.float64, columns=False, calls=2)


@pytest.mark.parametrize(("conv", "shape", "size"), CASES, ids=IDS)
def test_channel_statistics_are_the_taps_pooled_and_scaled_by_rho(
    conv: nn.Module, shape: tuple[int, ...], size: tuple[int, ...] | None
) -> None:
    """``conv_statistics="channel"``: μ_H = ρ·μ_x, σ²_H = ρ·σ²_x + ρ(1 − ρ)·μ_x² from the input's own per-channel
    moments, ρ = L_in/L_out; the same P for every tap of a channel. Without padding it is the exact column form."""
    torch.manual_seed(3)
    conv = copy.deepcopy(conv).double()
    x = torch.randn(shape, dtype=torch.float64) * 2 + 1.5
    y = conv(x, output_size=size) if size is not None else conv(x)
    m = transposed_channel_moments(conv, x, y)
    dims = [0, *range(2, x.dim())]
    mu_x, var_x = x.mean(dims), x.var(dims, correction=0)
    rho = math.prod(x.shape[2:]) / math.prod(y.shape[2:])
    torch.testing.assert_close(m.mean, rho * mu_x, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m.var, rho * var_x + rho * (1 - rho) * mu_x.square(), rtol=1e-12, atol=1e-12)
    rows = shape[0] * math.prod(y.shape[2:])  # H's rows: N·L_out, also q²'s output positions
    assert (m.rows, m.samples, m.out_positions) == (rows, shape[0], rows)
    h = explicit_h(conv, x, size)
    column = transposed_column_moments(conv, x, y)
    torch.testing.assert_close(column.mean, h.mean(0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(column.var, h.var(0, correction=0), rtol=1e-12, atol=1e-12)
    if not any(conv.padding):  # every tap of every input position lands inside the output
        taps = math.prod(conv.kernel_size)
        torch.testing.assert_close(column.mean, m.mean.repeat_interleave(taps), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(column.var, m.var.repeat_interleave(taps), rtol=1e-12, atol=1e-12)


UNPADDED = [
    (nn.ConvTranspose1d(2, 3, 3, stride=2, dilation=2, output_padding=1), (3, 2, 5), None),
    (nn.ConvTranspose2d(2, 2, (2, 3), stride=(3, 1), dilation=(1, 2)), (2, 2, 3, 4), (8, 8)),
    (nn.ConvTranspose3d(1, 2, 2, stride=2, output_padding=1), (2, 1, 2, 3, 2), None),
]


@pytest.mark.parametrize(("conv", "shape", "size"), UNPADDED, ids=["1d-dilated", "2d-output_size", "3d"])
def test_without_padding_the_channel_form_is_the_explicit_matrix_on_every_tap(
    conv: nn.Module, shape: tuple[int, ...], size: tuple[int, ...] | None
) -> None:
    """With no padding every tap of every input position lands inside the output (dilation, output padding and a
    larger ``output_size=`` only add rows of zeros), so ρ-scaled per-channel moments are H's column moments exactly."""
    torch.manual_seed(5)
    conv = copy.deepcopy(conv).double()
    x = torch.randn(shape, dtype=torch.float64) * 3 - 2
    y = conv(x, output_size=size) if size is not None else conv(x)
    h = explicit_h(conv, x, size)
    m = transposed_channel_moments(conv, x, y)
    taps = math.prod(conv.kernel_size)
    torch.testing.assert_close(m.mean.repeat_interleave(taps), h.mean(0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m.var.repeat_interleave(taps), h.var(0, correction=0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize(("conv", "shape", "size"), CASES[::2], ids=IDS[::2])
def test_channel_statistics_step_is_eq15_with_the_channel_moments_on_every_tap(
    conv: nn.Module, shape: tuple[int, ...], size: tuple[int, ...] | None, dtype: torch.dtype
) -> None:
    torch.manual_seed(4)
    run_steps(conv, shape, size, dtype, columns=False)


def test_input_moments_alone_would_over_centre_by_one_over_rho() -> None:
    """What a convolution records (the input's own μ_x) is 1/ρ = 4× the columns' mean at stride 2 in 2-D."""
    conv = nn.ConvTranspose2d(2, 2, 2, stride=2).double()
    x = torch.rand(3, 2, 4, 4, dtype=torch.float64) + 1
    h = explicit_h(conv, x)
    own = moments_of_input(conv, x, conv(x)).mean.repeat_interleave(4)
    torch.testing.assert_close(own / h.mean(0), torch.full((8,), 4.0, dtype=torch.float64))


def test_column_variance_is_accurate_when_the_mean_dwarfs_the_spread() -> None:
    conv = nn.ConvTranspose2d(2, 2, 3, stride=2, padding=1)
    x64 = torch.randn(4, 2, 6, 6, dtype=torch.float64) + 1e4
    m = transposed_column_moments(conv, x64.float(), conv(x64.float()))
    h = explicit_h(conv.double(), x64)
    torch.testing.assert_close(m.mean.double(), h.mean(0), rtol=1e-6, atol=0.0)
    torch.testing.assert_close(m.var.double(), h.var(0, correction=0), rtol=1e-3, atol=0.0)


def test_empty_unbatched_and_half_inputs() -> None:
    conv = nn.ConvTranspose2d(2, 3, 3, stride=2).double()
    for moments in (transposed_column_moments, transposed_channel_moments):
        empty = moments(conv, torch.zeros(0, 2, 3, 3, dtype=torch.float64), torch.zeros(0, 3, 7, 7))
        assert empty.rows == 0 and empty.mean.dtype == torch.float64
        x = torch.randn(2, 3, 3, dtype=torch.float64)
        single, batched = moments(conv, x, conv(x)), moments(conv, x[None], conv(x[None]))
        assert (single.rows, single.samples) == (49, 1)
        torch.testing.assert_close(single.var, batched.var)
        half = moments(conv.float(), x[None].bfloat16(), conv.float()(x[None].float()))
        assert half.mean.dtype == torch.float32
        conv.double()
    assert transposed_column_moments(conv, torch.zeros(0, 2, 3, 3), torch.zeros(0, 3, 7, 7)).mean.shape == (18,)


def test_layers_report_their_rows_features_and_q2() -> None:
    model = nn.Sequential(nn.ConvTranspose2d(3, 4, 4, stride=2, padding=1), nn.ReLU(), nn.ConvTranspose1d(2, 2, 1))
    channel = BNPPreconditioner(model[0])
    layer = channel.layers[""]
    assert (layer.features, layer.fan_in, layer.groups, layer.kind.name) == (3, 48, 1, "ConvTranspose2d")
    assert layer.rows(model[0].weight).shape == (4, 3, 4, 4)
    assert layer.rows(model[0].weight)._base is model[0].weight  # a view: the transform writes in place
    channel.detach()
    column = BNPPreconditioner(model[0], conv_statistics="column")
    assert column.layers[""].features == 48 and column.layers[""].kind.statistics_unit(model[0]) == "columns"
    x = torch.randn(2, 3, 5, 5)
    model[0](x).sum().backward()
    column.step()
    assert column.layers[""].transform.q2 == max(48 / 2, math.sqrt(100))  # c_in·k²/N vs √L_out


def test_default_layer_types_select_transposed_convolutions_by_family_and_by_name() -> None:
    """``Conv2d`` (in the default ``layer_types``) selects ``ConvTranspose2d`` too; its own name selects it alone."""
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ConvTranspose2d(2, 2, 2, stride=2), nn.ConvTranspose1d(2, 1, 2))
    default = BNPPreconditioner(model)
    assert list(default.layers) == ["0", "1", "2"]
    default.detach()
    only = BNPPreconditioner(model, layer_types=["ConvTranspose2d"])
    assert list(only.layers) == ["1"]
    assert only.skipped["0.weight"] == "layer type 'Conv2d' is not in `layer_types`"
    assert only.skipped["2.weight"] == "layer type 'ConvTranspose1d' is not in `layer_types`"


def test_grouped_transposed_convolutions_are_left_alone_and_named() -> None:
    """Several input channels per group: left alone (no view of the rows); one per group (depthwise): transformed."""
    model = nn.Sequential(
        nn.ConvTranspose2d(4, 4, 2, stride=2, groups=2),
        nn.ConvTranspose2d(4, 2, 2),
        nn.ConvTranspose2d(2, 4, 2, groups=2),
    )
    message = (
        r"BNP layer '0' \(ConvTranspose2d\) is left alone: a transposed convolution with groups=2 and 2 input "
        r"channels per group stores its weight \(c_in, c_out/groups, \*k\)"
    )
    with pytest.warns(BNPWarning, match=message):
        pre = BNPPreconditioner(model)
    assert list(pre.layers) == ["1", "2"]
    assert pre.skipped["0.weight"].startswith("left alone: a transposed convolution with groups=2")
    assert pre.coverage.transformed == ("1.weight", "2.weight")
    depthwise = pre.layers["2"]
    assert (depthwise.groups, depthwise.fan_in, depthwise.features) == (2, 4, 2)
    assert depthwise.rows(model[2].weight).shape == (4, 1, 2, 2)
    assert depthwise.rows(model[2].weight).data_ptr() == model[2].weight.data_ptr()


def test_token_masks_are_refused_naming_the_layer() -> None:
    conv = nn.ConvTranspose1d(2, 2, 2)
    pre = BNPPreconditioner(conv)
    with pytest.raises(ValueError, match=r"mask of shape \(2, 3\) does not fit its input of shape \(2, 2, 3\)"):
        with pre.token_mask(torch.ones(2, 3, dtype=torch.bool)):
            conv(torch.randn(2, 2, 3))


def test_checkpoint_resume_is_exact() -> None:
    """Two steps, a state_dict round trip into a new preconditioner, a third step: as three uninterrupted steps."""
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(2, 2, 3, 3, generator=g, dtype=torch.float64) + 1 for _ in range(3)]

    def train(split: bool, columns: str) -> Tensor:
        torch.manual_seed(0)
        conv = nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1).double()
        pre = BNPPreconditioner(conv, conv_statistics=columns)  # type: ignore[arg-type]
        for i, x in enumerate(xs):
            if split and i == 2:
                state = pre.state_dict()
                pre.detach()
                pre = BNPPreconditioner(conv, conv_statistics=columns)  # type: ignore[arg-type]
                pre.load_state_dict(state)
            conv.zero_grad()
            conv(x).square().sum().backward()
            pre.step()
            with torch.no_grad():
                conv.weight -= 0.01 * conv.weight.grad
        pre.detach()
        return torch.cat([conv.weight.grad.flatten(), conv.bias.grad, conv.weight.flatten()])

    for columns in ("channel", "column"):
        assert torch.equal(train(True, columns), train(False, columns))
    conv = nn.ConvTranspose2d(2, 3, 3)
    saved = BNPPreconditioner(conv)
    state = saved.state_dict()
    saved.detach()
    with pytest.raises(ValueError, match="conv_statistics"):
        BNPPreconditioner(conv, conv_statistics="column").load_state_dict(state)


def test_two_ranks_pool_into_the_statistics_of_the_whole_batch(ranks: TwoRanks) -> None:  # noqa: F811
    """Rank 0 and rank 1 each run half the batch (different output sizes through ``output_size=``): after one step
    both hold what BNP without ranks holds on the whole batch, for both forms."""
    g = torch.Generator().manual_seed(6)
    x0 = torch.randn(2, 2, 3, 3, generator=g, dtype=torch.float64)
    x1 = 2.0 + 3.0 * torch.randn(3, 2, 3, 3, generator=g, dtype=torch.float64)
    for columns in ("channel", "column"):
        nets = []
        for _ in range(3):
            torch.manual_seed(0)
            nets.append(nn.ConvTranspose2d(2, 2, 3, stride=2, padding=1).double())
        pres = [BNPPreconditioner(n, process_group=ranks.group, conv_statistics=columns) for n in nets[:2]]  # type: ignore[arg-type]
        reference = BNPPreconditioner(nets[2], sync_statistics=False, conv_statistics=columns)  # type: ignore[arg-type]
        nets[0](x0).sum().backward()
        nets[1](x1, output_size=(6, 6)).sum().backward()
        (nets[2](x0).sum() + nets[2](x1, output_size=(6, 6)).sum()).backward()
        grad = torch.randn(nets[0].weight.shape, generator=g, dtype=torch.float64)
        for net in nets:  # the gradient DDP would all-reduce, the same on every replica
            net.weight.grad, net.bias.grad = grad.clone(), torch.ones(2, dtype=torch.float64)
        ranks.run(pres[0].step, pres[1].step)
        reference.step()
        for net, pre in zip(nets[:2], pres):
            torch.testing.assert_close(pre.layers[""].running.var_acc, reference.layers[""].running.var_acc,
                                       rtol=1e-12, atol=1e-12)  # fmt: skip
            torch.testing.assert_close(net.weight.grad, nets[2].weight.grad, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(net.bias.grad, nets[2].bias.grad, rtol=1e-10, atol=1e-12)


class UNet(nn.Module):
    """A small U-Net: conv encoder, transposed-conv decoder with a skip connection, BN in between."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.pool = nn.Conv2d(4, 8, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(8, 4, 4, stride=2, padding=1)
        self.head = nn.Sequential(nn.ConvTranspose2d(8, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 1, 1))

    def forward(self, x: Tensor) -> Tensor:
        skip = self.down(x)
        return self.head(torch.cat([self.up(torch.relu(self.pool(skip))), skip], 1))


def test_a_unet_reports_every_weight_matrix_transformed() -> None:
    model = UNet()
    pre = BNPPreconditioner(model, conv_statistics="column")
    assert set(pre.coverage.transformed) == {
        "down.0.weight", "pool.weight", "up.weight", "head.0.weight", "head.2.weight"
    }  # fmt: skip
    assert pre.skipped == {} and pre.coverage.trainable == 5
    model(torch.randn(2, 1, 8, 8)).square().mean().backward()
    pre.step()
    assert all(layer.transform is not None for layer in pre.layers.values())


def test_torchvision_mask_rcnn_names_every_weight_matrix() -> None:
    """torchvision's Mask R-CNN head upsamples with a ConvTranspose2d (``roi_heads.mask_predictor.conv5_mask``):
    transformed, and every weight matrix of the model transformed or named."""
    detection = pytest.importorskip("torchvision.models.detection")
    model = detection.maskrcnn_resnet50_fpn(weights=None, weights_backbone=None, num_classes=3)
    pre = BNPPreconditioner(model)
    assert "roi_heads.mask_predictor.conv5_mask.weight" in pre.coverage.transformed
    named = set(pre.coverage.transformed) | set(pre.skipped)
    assert named == {name for name, p in model.named_parameters() if p.dim() >= 2}
    assert not any("unknown layer type" in reason for reason in pre.skipped.values()), pre.skipped


def test_statistics_cost_at_most_a_conv2d_of_the_same_sizes() -> None:
    """Counted, not timed: the statistics of one forward call of a transposed convolution (per channel and per
    column) dispatch no more calls, and read the host no more, than those of a Conv2d whose input is the transposed
    convolution's output (the adjoint's sizes) and than those of a Conv2d on the same input."""
    tconv = nn.ConvTranspose2d(16, 8, 4, stride=2, padding=1)
    x = torch.randn(4, 16, 8, 8)
    y = tconv(x)
    adjoint = nn.Conv2d(8, 16, 4, stride=2, padding=1)  # input (4, 8, 16, 16), output (4, 16, 8, 8)
    same_input = nn.Conv2d(16, 8, 4, stride=2, padding=1)
    for moments in (transposed_channel_moments, transposed_column_moments):  # warm the shape caches
        moments(tconv, x, y)
    column_moments_of_input(adjoint, y, adjoint(y))
    column_moments_of_input(same_input, x, same_input(x))
    t_channel = profile_cost(lambda: transposed_channel_moments(tconv, x, y))
    t_column = profile_cost(lambda: transposed_column_moments(tconv, x, y))
    for conv, h in ((adjoint, y.detach()), (same_input, x)):
        out = conv(h)
        c_channel = profile_cost(lambda: moments_of_input(conv, h, out))  # noqa: B023
        c_column = profile_cost(lambda: column_moments_of_input(conv, h, out))  # noqa: B023
        assert t_column.host_reads == c_column.host_reads == 0
        assert t_column.calls <= c_column.calls, (t_column.by_name, c_column.by_name)
        assert t_channel.host_reads == c_channel.host_reads == 0
        assert t_channel.calls <= c_channel.calls + 2, (t_channel.by_name, c_channel.by_name)


class _Block(nn.Module):
    """One (16 → 8, k 4, stride 2, padding 1) transposed convolution, or a Conv2d in its place, and a Linear head."""

    def __init__(self, transposed: bool) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose2d(16, 8, 4, 2, 1) if transposed else nn.Conv2d(16, 8, 3, padding=1)
        self.head = nn.Linear(8, 5)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.conv(x).mean((2, 3)))


def test_a_step_costs_a_conv2d_step_plus_the_two_calls_of_the_rho_scaling() -> None:
    """Per training step (``benchmarks.op_count``, forward to ``opt.step()``): BNP adds to a transposed convolution's
    step what it adds with a Conv2d in its place, plus the per-channel form's ρ scaling (one ``addcmul_``, one fused
    ``_foreach_mul_``): docs "Transposed convolutions" say why no form tried saves them; no host read."""
    from benchmarks.op_count import added_cost

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 16, 8, 8, generator=g), torch.randint(5, (4,), generator=g)
    tconv, _ = added_cost(lambda: _Block(True), x, y)
    conv, _ = added_cost(lambda: _Block(False), x, y)
    assert tconv.host_reads == conv.host_reads == 0
    extra = {name: tconv.by_name[name] - conv.by_name[name] for name in tconv.by_name | conv.by_name}
    assert {name: n for name, n in extra.items() if n} == {"aten::addcmul_": 1, "aten::_foreach_mul_": 1}
    assert tconv.calls == conv.calls + 2  # 26 and 24 today


def test_grouped_warning_is_silenced_by_exclude() -> None:
    model = nn.Sequential(nn.ConvTranspose2d(4, 4, 2, groups=2), nn.Linear(3, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", BNPWarning)
        pre = BNPPreconditioner(model, exclude="0")
    assert list(pre.layers) == ["1"]
    assert pre.skipped["0.weight"].startswith("left alone: a transposed convolution with groups=2")


@pytest.mark.parametrize("columns", ["channel", "column"])
def test_compiled_forward_traces_the_hook_without_a_graph_break(columns: str) -> None:
    """``torch.compile(model, fullgraph=True)`` (aot_eager): both forms trace into the graph; steps as eager."""
    torch._dynamo.reset()
    grads = []
    for backend in (None, "aot_eager"):
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.ConvTranspose2d(2, 3, 4, stride=2, padding=1), nn.ReLU(), nn.Flatten(2), nn.ConvTranspose1d(3, 2, 3)
        )
        pre = BNPPreconditioner(model, conv_statistics=columns)  # type: ignore[arg-type]
        forward = model if backend is None else torch.compile(model, backend=backend, fullgraph=True)
        for seed in range(3):
            x = torch.randn(3, 2, 4, 5, generator=torch.Generator().manual_seed(seed)) + 1
            model.zero_grad()
            forward(x).square().sum().backward()
            pre.step()
        grads.append([p.grad.clone() for p in model.parameters()] + [pre.layers["3"].running.var_acc])
        pre.detach()
    torch._dynamo.reset()
    for eager, compiled in zip(*grads):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


def test_fsdp2_gradients_replicated_are_transformed_and_sharded_ones_refused(mesh: DeviceMesh) -> None:  # noqa: F811
    """FSDP2's ``Shard(0)`` of the stored (c_in, c_out, *k) weight splits BNP's columns, not its rows: refused naming
    the layer; a replicated gradient is transformed like the plain one."""
    x = torch.randn(2, 2, 3, 3) + 1
    grads = []
    for placements in (None, [Replicate()]):
        torch.manual_seed(0)
        conv = nn.ConvTranspose2d(2, 3, 4, stride=2, padding=1)
        pre = BNPPreconditioner(conv)
        conv(x).square().sum().backward()
        if placements is not None:
            for p in conv.parameters():
                p.grad = distribute_tensor(p.grad, mesh, placements)
        pre.step()
        grads.append(conv.weight.grad if placements is None else conv.weight.grad.to_local())
        pre.detach()
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
    conv = nn.ConvTranspose2d(2, 3, 4, stride=2, padding=1)
    pre = BNPPreconditioner(conv)
    conv(x).sum().backward()
    conv.weight.grad = distribute_tensor(conv.weight.grad, mesh, [Shard(0)])
    with pytest.raises(ValueError, match="^" + expected_refusal("", "ConvTranspose2d", "(Shard(dim=0),)") + "$"):
        pre.step()
