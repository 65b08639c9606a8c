"""Counts on the device in one process (issue 27). A token mask (``BNPPreconditioner.token_mask``) gives a layer
its row count as a 0-dim tensor; a step where any layer's count is on the device then takes every layer's counts
there (the path counts pooled over ranks take too). Checked against the same model without a mask (host counts),
against BNP fed only the real tokens, against BNP on separate Linears, and against the formulas by hand: a
convolution's q² and N = 1 rule read its samples and output positions, a layer with one real token follows the
N = 1 rule with q² = n_in and reports a NaN token, the transform a step keeps maps a gradient exactly as the step
did, and the two row blocks of a registered kind are one entry each with its own q². Also: the ε1·max σ² floor of
``statistics="batch"`` is per layer, and row blocks are one run only when they are the blocks of one weight in
order."""

from __future__ import annotations

import copy
import re
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_bnp.core import BNPPreconditioner, BNPWarning
from lightning_bnp.core.kinds import LINEAR_FAMILY, LayerKind, register_layer_kind, unregister_layer_kind
from lightning_bnp.core.step_plan import row_block_runs as _row_block_runs


class ConvThenTokens(nn.Module):
    """A convolution whose output positions become the tokens of a Linear: (B, 3, 6, 6) → (B, 16, 4) → (B, 16, 5)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.lin = nn.Linear(4, 5)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(torch.tanh(self.conv(x)).flatten(2).transpose(1, 2))


def test_a_convolution_beside_a_masked_layer_keeps_its_samples_and_output_positions() -> None:
    """Batch 1: the convolution sees N = 1 sample, 36 input rows and 16 output positions; with the Linear masked,
    its counts go to the device too. q² = max(c_in·k²/N, √(r·s)) = max(27/1, √16) = 27, σ²_H is its variance over
    the 36 rows (N = 1 is the sample count, not the row count: no (h − μ)² rule), and two steps equal BNP
    on the same model without a mask (host counts)."""
    torch.manual_seed(0)
    net = ConvThenTokens()
    twin = copy.deepcopy(net)
    pre, ref = BNPPreconditioner(net, rho=0.5), BNPPreconditioner(twin, rho=0.5)
    opts = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in (net, twin)]
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(1, 3, 6, 6, generator=g) * 2 + 1
        for model, p, opt, masked in ((net, pre, opts[0], True), (twin, ref, opts[1], False)):
            opt.zero_grad()
            if masked:
                with p.token_mask(torch.ones(1, 16, dtype=torch.bool), layers="lin"):
                    model(x).square().sum().backward()
            else:
                model(x).square().sum().backward()
            p.step(opt)
            opt.step()
        assert float(pre.layers["conv"].transform.q2) == 27.0  # type: ignore[union-attr]
        for (name, p), q in zip(net.named_parameters(), twin.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    for name in ("conv", "lin"):
        mine, theirs = pre.layers[name].running, ref.layers[name].running
        assert mine.steps == theirs.steps == 2
        torch.testing.assert_close(mine.mean_acc, theirs.mean_acc, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(mine.var_acc, theirs.var_acc, rtol=1e-5, atol=1e-6)


def test_a_layer_with_one_real_token_is_bnp_at_batch_size_1_and_reports_its_nan() -> None:
    """One real token among ten (its count 1 on the device): three steps equal BNP fed that token alone (the N = 1
    rule σ²_H = (h − μ)², q² = n_in / 1 = 8, statistics updated); a NaN in the one real token is reported."""
    torch.manual_seed(0)
    net = nn.Linear(8, 4)
    twin = copy.deepcopy(net)
    pre, ref = BNPPreconditioner(net, rho=0.5), BNPPreconditioner(twin, rho=0.5)
    opts = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in (net, twin)]
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(2, 5, 8, generator=g) * 2 + 1
        mask = torch.zeros(2, 5, dtype=torch.bool)
        mask[step % 2, 2 * step] = True
        opts[0].zero_grad()
        with pre.token_mask(mask):
            net(x).masked_fill(~mask[..., None], 0.0).square().sum().backward()
        opts[1].zero_grad()
        twin(x[mask]).square().sum().backward()
        for p, opt in ((pre, opts[0]), (ref, opts[1])):
            p.step(opt)
            opt.step()
        assert float(pre.layers[""].transform.q2) == 8.0  # type: ignore[union-attr]
        assert pre.layers[""].running.steps == ref.layers[""].running.steps == step + 1
        torch.testing.assert_close(net.weight, twin.weight, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(net.bias, twin.bias, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(pre.layers[""].running.mean_acc, ref.layers[""].running.mean_acc)
        torch.testing.assert_close(pre.layers[""].running.var_acc, ref.layers[""].running.var_acc)
    x, mask = torch.randn(2, 5, 8, generator=g), torch.zeros(2, 5, dtype=torch.bool)
    mask[1, 3] = True
    x[1, 3, 5] = float("nan")  # the real token; the padding is finite
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net.zero_grad()
        with pre.token_mask(mask):
            net(x).masked_fill(~mask[..., None], 0.0).sum().backward()
        pre.step()
        pre.flush_warnings()
    assert any("NaN or Inf" in str(w.message) for w in caught if issubclass(w.category, BNPWarning))


def test_the_batch_floor_is_each_layers_own_max_variance() -> None:
    """statistics='batch', two layers whose inputs differ in scale by 10⁴: σ̃² = σ² + ε1·max σ² + ε2 with the max
    over the layer's own features (Alg. 2 step 3), and the weight gradient is (G_w − G_b μᵀ)/(q² σ̃²) by hand."""
    torch.manual_seed(0)
    net = nn.ModuleDict({"big": nn.Linear(4, 3), "small": nn.Linear(4, 3)}).double()
    pre = BNPPreconditioner(net, statistics="batch", eps1=0.1, eps2=1e-6)
    g = torch.Generator().manual_seed(1)
    inputs = {
        "big": torch.randn(16, 4, generator=g, dtype=torch.float64) * torch.tensor([100.0, 30.0, 10.0, 1.0]) + 3,
        "small": torch.randn(16, 4, generator=g, dtype=torch.float64) * torch.tensor([0.01, 0.02, 0.03, 0.05]),
    }
    (net["big"](inputs["big"]).sum() + net["small"](inputs["small"]).square().sum()).backward()
    plain = {name: (net[name].weight.grad.clone(), net[name].bias.grad.clone()) for name in inputs}  # type: ignore[union-attr]
    pre.step()
    for name, h in inputs.items():
        mu, var = h.mean(0), h.var(0, correction=0)
        var_t = var + 0.1 * var.max() + 1e-6
        torch.testing.assert_close(pre.layers[name].transform.var_t, var_t, rtol=1e-10, atol=0.0)  # type: ignore[union-attr]
        q2 = max(4 / 16, 1.0)
        grad_w, grad_b = plain[name]
        expected = (grad_w - grad_b[:, None] * mu[None]) / (q2 * var_t)
        torch.testing.assert_close(net[name].weight.grad, expected, rtol=1e-10, atol=1e-12)


def test_the_transform_a_masked_step_keeps_maps_a_gradient_as_the_step_did() -> None:
    """Three real tokens (q² = 8/3 from a count on the device): the StepTransform the step keeps (q² and σ̃² in the
    statistics' dtype) maps a copy of the untransformed gradient to exactly the step's gradient."""
    torch.manual_seed(0)
    net = nn.Linear(8, 6)
    pre = BNPPreconditioner(net, statistics="batch")
    g = torch.Generator().manual_seed(1)
    x, mask = torch.randn(2, 5, 8, generator=g) * 3 + 1, torch.zeros(2, 5, dtype=torch.bool)
    mask[0, :2] = mask[1, 4] = True
    with pre.token_mask(mask):
        net(x).masked_fill(~mask[..., None], 0.0).square().sum().backward()
    assert net.weight.grad is not None and net.bias.grad is not None
    grad_w, grad_b = net.weight.grad.clone(), net.bias.grad.clone()
    pre.step()
    transform = pre.layers[""].transform
    assert transform is not None
    assert float(transform.q2) == torch.tensor(8 / 3, dtype=torch.float32).item()
    transform.apply_(grad_w, grad_b)
    assert torch.equal(grad_w, net.weight.grad) and torch.equal(grad_b, net.bias.grad)


def test_row_block_runs_are_the_blocks_of_one_weight_in_order() -> None:
    """The q, k, v layers of one packed in_proj_weight, in order, are one run of 3; blocks out of order, or the
    blocks of two attentions side by side, are not."""
    net = nn.ModuleDict({"a": nn.MultiheadAttention(8, 2), "b": nn.MultiheadAttention(8, 2)})
    layers = BNPPreconditioner(net).layers
    q, k, v = (layers[f"a.{block}"] for block in "qkv")
    bq, bk, bv = (layers[f"b.{block}"] for block in "qkv")
    assert _row_block_runs([q, k, v, layers["a.out_proj"], bq, bk, bv]) == ((0, 3), (4, 3))
    assert _row_block_runs([q, v, k]) == ()
    assert _row_block_runs([q, k, bv]) == ()
    assert _row_block_runs([bq, q, k, v]) == ((1, 3),)


class TwoHeads(nn.Module):
    """One (2·out, in) weight and (2·out,) bias whose two row blocks read two inputs: [a·W_aᵀ + b_a, b·W_bᵀ + b_b]."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.out = out_features
        self.weight = nn.Parameter(torch.randn(2 * out_features, in_features) / in_features**0.5)
        self.bias = nn.Parameter(torch.randn(2 * out_features))

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        halves = (self.weight.split(self.out), self.bias.split(self.out))
        return torch.cat([F.linear(a, halves[0][0], halves[1][0]), F.linear(b, halves[0][1], halves[1][1])], -1)


class HalfKind(LayerKind):
    """Row block ``block`` of 2 of ``TwoHeads``' weight, fed by its ``block``-th input."""

    module_type = TwoHeads
    family = LINEAR_FAMILY

    def __init__(self, block: int) -> None:
        self.block = block
        self.name = f"TwoHeads.{'ab'[block]}"  # type: ignore[misc]
        self.suffix = f".{'ab'[block]}"  # type: ignore[misc]

    def input(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return args[self.block]

    def rows(self, module: nn.Module, weight: Tensor) -> Tensor:
        return weight[self.block * module.out : (self.block + 1) * module.out]  # type: ignore[operator]

    def bias_rows(self, module: nn.Module, bias: Tensor) -> Tensor:
        return bias[self.block * module.out : (self.block + 1) * module.out]  # type: ignore[operator]

    def row_block(self, module: nn.Module) -> tuple[int, int] | None:
        return (self.block, 2)


def test_two_row_blocks_of_one_weight_are_one_entry_each_with_its_own_q2() -> None:
    """A registered kind whose weight has two row blocks: they are one run (and one entry of the transform).
    Block a under a token mask (3 real tokens: q² = 8/3, its count on the device), block b every row (q² = 1):
    the weight and bias gradients equal BNP's on two separate Linears under the same mask."""
    kinds = [register_layer_kind(HalfKind(0)), register_layer_kind(HalfKind(1))]
    try:
        torch.manual_seed(0)
        net = nn.ModuleDict({"m": TwoHeads(8, 3)})
        twin = nn.ModuleDict({"a": nn.Linear(8, 3), "b": nn.Linear(8, 3)})
        with torch.no_grad():
            for i, lin in enumerate((twin["a"], twin["b"])):
                lin.weight.copy_(net["m"].weight[3 * i : 3 * i + 3])
                lin.bias.copy_(net["m"].bias[3 * i : 3 * i + 3])
        pre = BNPPreconditioner(net, layer_types=[k.name for k in kinds], statistics="batch")
        ref = BNPPreconditioner(twin, statistics="batch")
        assert _row_block_runs([pre.layers["m.a"], pre.layers["m.b"]]) == ((0, 2),)
        g = torch.Generator().manual_seed(1)
        a, b = torch.randn(2, 5, 8, generator=g) * 2 + 1, torch.randn(2, 5, 8, generator=g) - 1
        mask = torch.zeros(2, 5, dtype=torch.bool)
        mask[0, 1:3] = mask[1, 0] = True
        with pre.token_mask(mask, layers="m.a"):
            net["m"](a, b).square().sum().backward()
        with ref.token_mask(mask, layers="a"):
            (twin["a"](a).square().sum() + twin["b"](b).square().sum()).backward()
        pre.step()
        ref.step()
        spans = [n for plan in pre._step.plans.values() for config in plan.configs.values() for _, n in config.spans]
        assert spans == [2]
        assert [float(pre.layers[f"m.{x}"].transform.q2) for x in "ab"] == pytest.approx([8 / 3, 1.0])  # type: ignore[union-attr]
        weight, bias = net["m"].weight.grad, net["m"].bias.grad
        assert weight is not None and bias is not None
        for i, lin in enumerate((twin["a"], twin["b"])):
            torch.testing.assert_close(weight[3 * i : 3 * i + 3], lin.weight.grad, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(bias[3 * i : 3 * i + 3], lin.bias.grad, rtol=1e-5, atol=1e-6)
    finally:
        for kind in kinds:
            unregister_layer_kind(kind.name)


def test_a_step_with_counts_on_the_device_makes_them_where_the_statistics_live() -> None:
    """On the ``meta`` device (a tensor made on the default device would show on a CPU-only machine): the masked
    Linear's count and the convolution's host counts, its fan-in and the q² built from them all stay on the
    model's device through a whole step."""
    meta = torch.device("meta")
    net = ConvThenTokens().to(meta)
    pre = BNPPreconditioner(net, rho=0.5)
    with pre.token_mask(torch.ones(2, 16, dtype=torch.bool, device=meta), layers="lin"):
        net(torch.empty(2, 3, 6, 6, device=meta)).sum().backward()
    pre.precondition()
    for name, layer in pre.layers.items():
        transform = layer.transform
        assert transform is not None and isinstance(transform.q2, Tensor) and transform.q2.device == meta, name
        assert transform.var_t.device == layer.running.mean_acc.device == meta, name
    assert net.conv.weight.grad is not None and net.conv.weight.grad.device == meta


def test_the_overflow_warning_of_a_masked_step_names_the_statistics_dtype() -> None:
    """With counts on the device the step's host copy holds the peaks and the row counts (float64): the overflow
    warning still names float32, its √max ≈ 1.8e19 and its ceiling max·2⁻²⁴ ≈ 2.0e31."""
    net = nn.Linear(8, 4)
    pre = BNPPreconditioner(net, statistics="batch")
    g = torch.Generator().manual_seed(1)
    x, mask = torch.randn(2, 5, 8, generator=g) * 1e20, torch.zeros(2, 5, dtype=torch.bool)
    mask[0, :3] = mask[1, 1] = True
    with pre.token_mask(mask):
        net(x).masked_fill(~mask[..., None], 0.0).sum().backward()
    pre.step()
    message = (
        "BNP layer '' (Linear): the step's input variance σ²_H overflows float32 (finite inputs of magnitude above "
        "~1.8e+19, whose squares are not representable); it is saturated at 2.0e+31 for that step, so σ² and P of "
        "this layer are not exact while inputs stay that large. Rescale the layer's input (normalize the data), or "
        "use float64."
    )
    with pytest.warns(BNPWarning, match="^" + re.escape(message) + "$"):
        pre.flush_warnings()
