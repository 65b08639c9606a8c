"""Issue 16: what a BNP step dispatches (counted, never timed), and the flat step against a per-layer
reference built from the single-layer functions (running view, σ̃², eq. 15/23 transform)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import Tensor, nn

from benchmarks.op_count import added_cost, profile_cost, standard_models
from lightning_bnp.core import BNPPreconditioner
from lightning_bnp.core.layout import FeatureLayout
from lightning_bnp.core.moments import moments_of_input
from lightning_bnp.core.transform import precondition_, q_squared, var_tilde


@pytest.mark.parametrize("name", list(standard_models()))
def test_bnp_adds_no_host_read_and_at_most_five_calls_per_layer_plus_fourteen(name: str) -> None:
    """Counted as a GPU's host pays them (``benchmarks.op_count``: the profiler sees nested calls; a foreach call that
    falls back counts per tensor): no read back to the host, and per managed layer the statistics of each
    forward call (on the CPU two calls for a Linear: ``batch_norm_update_stats`` and the exact ``mean(0)``; one
    ``var_mean`` on CUDA; one for a convolution) and the transform's three calls (G_w − μ·G_b, ÷ q²σ̃², the bias
    update; fewer for a bias-free layer or a q, k, v run), plus the step's 14 calls for all layers (one of them the
    copy of the new state into the plan's buffer, in place: what a CUDA graph replays). L counts
    each q/k/v block: the encoder has 13 layers, the benchmark ViT 14, the char-LM 13."""
    make, x, y = standard_models()[name]
    added, layers = added_cost(make, x, y)
    assert added.host_reads == 0, added.by_name
    assert added.calls <= 5 * layers + 14, f"{name}: {added.calls} calls for {layers} layers: {added.by_name}"
    expected = {"Transformer encoder": 13, "ViT": 14, "char-LM": 13}
    for prefix, count in expected.items():
        if name.startswith(prefix):
            assert layers == count


def test_the_counter_sees_the_reads_and_per_tensor_calls_inside_other_calls() -> None:
    """``profile_cost`` counts the two ``.item()`` reads that ``segment_reduce`` makes inside itself unless told
    ``unsafe=True``, a foreach call over tensors of different shapes index by index as one call per tensor (its
    fallback) and one whose lists agree index by index as one launch, and neither views nor allocations as calls."""
    x, lengths = torch.arange(6.0), torch.tensor([2, 4])
    assert profile_cost(lambda: torch.segment_reduce(x, "max", lengths=lengths)).host_reads == 2
    assert profile_cost(lambda: torch.segment_reduce(x, "max", lengths=lengths, unsafe=True)).host_reads == 0
    grads = [torch.ones(3, 2), torch.ones(4, 5)]
    broadcast = [torch.ones(2), torch.ones(5)]
    fallback = profile_cost(lambda: torch._foreach_div_(grads, broadcast))
    assert (fallback.calls, dict(fallback.by_name)) == (2, {"aten::div_": 2})
    same = [torch.ones(3, 2), torch.ones(4, 5)]
    fused = profile_cost(lambda: torch._foreach_div_(grads, same))
    assert fused.calls == 1 and fused.host_reads == 0
    views = profile_cost(lambda: (x.view(2, 3).t(), x[1:4], torch.empty(3)))
    assert (views.calls, views.allocations) == (0, 1)


def test_feature_layout_maxima_and_per_layer_values() -> None:
    layout = FeatureLayout([3, 1, 2], [True, False, True], torch.device("cpu"), torch.float64)
    flat = torch.tensor([1.0, 5.0, 2.0, -7.0, 0.5, 0.25], dtype=torch.float64)
    torch.testing.assert_close(
        layout.layer_max(flat), torch.tensor([5.0, 5.0, 5.0, -7.0, 0.5, 0.5], dtype=torch.float64)
    )
    torch.testing.assert_close(
        layout.per_layer([2.0, 3.0, 4.0]), torch.tensor([2.0, 2, 2, 3, 4, 4], dtype=torch.float64)
    )
    assert layout.uncentred_mask is not None and layout.uncentred_mask.tolist() == [0, 0, 0, 1, 0, 0]
    assert [t.tolist() for t in layout.split(flat)] == [[1.0, 5.0, 2.0], [-7.0], [0.5, 0.25]]


def test_feature_layout_caches_the_last_eight_per_layer_vectors() -> None:
    """Issue 27 (survivors of `make mutate`): a repeated q² tuple reuses its vector (built once), and the cache
    keeps the last 8 tuples."""
    layout = FeatureLayout([2, 1], [True, True], torch.device("cpu"), torch.float64)
    first = layout.per_layer_cached([1.0, 2.0])
    assert layout.per_layer_cached([1.0, 2.0]) is first
    for q2 in range(3, 13):  # ten more distinct tuples: the oldest are dropped, the newest kept
        assert layout.per_layer_cached([1.0, float(q2)]).tolist() == [1.0, 1.0, float(q2)]
    assert len(layout._cache) == 8 and (1.0, 12.0) in layout._cache and (1.0, 2.0) not in layout._cache


def test_feature_layout_per_layer_values_are_one_entry_per_layer_built_once_per_tuple() -> None:
    """``per_layer_values`` (q² as data for a compiled step): one entry per layer in the statistics' dtype, built
    once per tuple in the cache that ``per_layer_cached`` fills (the same tuple there is per *entry*: no clash),
    the last 8 kept; on the layout's device (``meta``: a tensor made on the default device would show)."""
    layout = FeatureLayout([2, 1], [True, False], torch.device("cpu"), torch.float64)
    first = layout.per_layer_values([1.0, 2.0])
    assert first.dtype == torch.float64 and first.tolist() == [1.0, 2.0]
    assert layout.per_layer_values([1.0, 2.0]) is first
    assert layout.per_layer_values([3.0, 4.0]).tolist() == [3.0, 4.0]
    assert layout.per_layer_cached([1.0, 2.0]).tolist() == [1.0, 1.0, 2.0]
    assert layout.per_layer_values([1.0, 2.0]) is first
    for q2 in range(5, 15):  # ten more distinct tuples: the oldest are dropped
        assert layout.per_layer_values([1.0, float(q2)]).tolist() == [1.0, float(q2)]
    assert len(layout._cache) == 8
    again = layout.per_layer_values([1.0, 2.0])
    assert again is not first and again.tolist() == [1.0, 2.0]
    meta = torch.device("meta")
    on_meta = FeatureLayout([2, 1], [True, False], meta, torch.float32)
    assert on_meta.uncentred_mask is not None
    made = (on_meta.lengths, on_meta.owner, on_meta.state_owner, on_meta.decay_target, on_meta.uncentred_mask)
    for tensor in (*made, on_meta.per_layer([1.0, 2.0]), on_meta.per_layer_values([1.0, 2.0])):
        assert tensor.device == meta
    assert on_meta.per_layer([1.0, 2.0]).shape == (3,)


def test_feature_layout_decay_target_is_kappa_per_layer_in_the_statistics_dtype() -> None:
    """Issue 27 (`make mutate` survivors): the running update's batch value of d = ρ^t + κ is κ = ``decay_offset``
    per layer, 0 by default (plain ρ^t: ``RunningStatistics``' default), in the statistics' dtype (float64 here: a
    float32 κ = 0.1 would not be float64's 0.1); ``owner`` names each entry's layer."""
    cpu = torch.device("cpu")
    plain = FeatureLayout([3, 1, 2], [True, False, True], cpu, torch.float64)
    assert plain.decay_target.dtype == torch.float64 and plain.decay_target.tolist() == [0.0, 0.0, 0.0]
    assert plain.owner.tolist() == [0, 0, 0, 1, 2, 2]
    offset = FeatureLayout([3, 1, 2], [True, True, True], cpu, torch.float64, 0.1)
    assert offset.decay_target.dtype == torch.float64 and offset.decay_target.tolist() == [0.1, 0.1, 0.1]


class Mixed(nn.Module):
    """A conv without bias, a grouped conv with bias and two Linear layers, one of them used only on
    some steps (so that the layers reach different step counts)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1, bias=False)
        self.grouped = nn.Conv2d(4, 4, 3, stride=2, groups=2)
        self.fc = nn.Linear(36, 3)
        self.side = nn.Linear(36, 3)

    def forward(self, x: Tensor, use_side: bool) -> Tensor:
        h = torch.relu(self.grouped(torch.relu(self.conv(x)))).flatten(1)
        return self.fc(h) + (self.side(h) if use_side else 0.0)


def reference_step(
    model: Mixed, state: dict[str, tuple[Tensor, Tensor, int]], x: Tensor, use_side: bool, rho: float, eps: tuple
) -> dict[str, Tensor]:
    """Alg. 2/3 layer by layer with the single-layer functions; returns the transformed gradients."""
    inputs: dict[str, Tensor] = {}
    hooks = [
        m.register_forward_hook(lambda mod, a, out, name=name: inputs.__setitem__(name, (mod, a[0], out)))
        for name, m in model.named_children()
    ]
    model.zero_grad()
    model(x, use_side).square().sum().backward()
    for h in hooks:
        h.remove()
    grads = {}
    for name, (module, h, out) in inputs.items():
        m = moments_of_input(module, h.detach(), out)
        mean_acc, var_acc, steps = state[name]
        has_bias = module.bias is not None
        mu_h = m.mean if has_bias else torch.zeros_like(m.mean)
        var_h = m.var if has_bias else m.var + m.mean.square()
        mean_acc = rho * mean_acc + (1 - rho) * mu_h
        var_acc = rho * var_acc + (1 - rho) * var_h
        steps += 1
        state[name] = (mean_acc, var_acc, steps)
        mu, var = mean_acc, var_acc + rho**steps  # the paper's view
        gw, gb = module.weight.grad.clone(), module.bias.grad.clone() if has_bias else None
        q2 = q_squared(module.weight[0].numel(), m.samples, m.out_positions / m.samples)
        precondition_(gw, gb, mu if has_bias else None, var_tilde(var, *eps), q2, getattr(module, "groups", 1))
        grads[f"{name}.weight"] = gw
        if gb is not None:
            grads[f"{name}.bias"] = gb
    return grads


def test_flat_step_equals_layer_by_layer_reference_with_mixed_layers_and_step_counts() -> None:
    torch.manual_seed(0)
    model, reference = Mixed().double(), Mixed().double()
    reference.load_state_dict(model.state_dict())
    rho, eps = 0.9, (1e-2, 1e-4)
    pre = BNPPreconditioner(model, rho=rho, eps1=eps[0], eps2=eps[1])
    state = {name: (torch.zeros(lay.features, dtype=torch.float64),) * 2 + (0,) for name, lay in pre.layers.items()}
    g = torch.Generator().manual_seed(1)
    for step, use_side in enumerate([True, False, False, True, True]):
        x = torch.randn(3, 2, 8, 8, generator=g, dtype=torch.float64) * 2 + 1
        expected = reference_step(reference, state, x, use_side, rho, eps)
        model.zero_grad(set_to_none=True)
        model(x, use_side).square().sum().backward()
        pre.step()
        for name, grad in expected.items():
            torch.testing.assert_close(
                model.get_parameter(name).grad, grad, rtol=1e-10, atol=1e-12, msg=f"{step} {name}"
            )
        assert pre.layers["side"].running.steps == state["side"][2]
        with torch.no_grad():  # both take the same SGD step
            for name, p in model.named_parameters():
                if p.grad is not None:
                    p.sub_(0.01 * p.grad)
                    reference.get_parameter(name).sub_(0.01 * expected[name])


def test_layers_on_two_dtypes_are_stepped_in_separate_flat_groups() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    model[2].double()
    pre = BNPPreconditioner(model)
    x = torch.randn(5, 4)
    out = model[2](model[1](model[0](x)).double())
    out.sum().backward()
    pre.step()
    assert pre.layers["0"].running.mean_acc.dtype == torch.float32
    assert pre.layers["2"].running.mean_acc.dtype == torch.float64
    assert all(layer.running.steps == 1 for layer in pre.layers.values())


@pytest.mark.parametrize(
    ("layer", "shape"),
    [
        (nn.Linear(5, 2), (3, 7, 5)),
        (nn.Conv1d(3, 4, 3, stride=2), (5, 3, 9)),
        (nn.Conv2d(4, 4, 3, padding=1, groups=2), (2, 4, 6, 5)),
        (nn.Conv2d(2, 3, 3), (2, 6, 6)),  # unbatched
        (nn.Conv3d(2, 3, 2), (2, 2, 4, 5, 3)),
    ],
)
def test_var_mean_statistics_equal_the_fused_kernel(
    layer: nn.Module, shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The form torch.compile traces (and devices without the fused kernel use) computes the same moments."""
    h = torch.randn(*shape, dtype=torch.float64) * 3 + 2
    out = layer.double()(h)
    fused = moments_of_input(layer, h, out)
    monkeypatch.setattr("lightning_bnp.core.moments._FUSED_KERNEL_DEVICES", ())  # the var_mean form
    generic = moments_of_input(layer, h, out)
    assert (fused.rows, fused.samples, fused.out_positions) == (generic.rows, generic.samples, generic.out_positions)
    torch.testing.assert_close(generic.mean, fused.mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(generic.var, fused.var, rtol=1e-12, atol=1e-12)


def test_at_most_sixteen_layouts_are_kept_the_oldest_dropped_first() -> None:
    """A flat layout is built once per set of layers stepped together (``precondition(params)``); the 17th set
    drops the first one built (the earliest), keeping the other 16 as they were."""
    torch.manual_seed(0)
    linears = [nn.Linear(3, 3) for _ in range(5)]
    model = nn.Sequential(*linears)
    pre = BNPPreconditioner(model)
    names = [str(i) for i in range(5)]
    sets = [list(s) for k in (2, 3) for s in itertools.combinations(names, k)][:17]
    x = torch.randn(4, 3)
    built = []
    for chosen in sets:
        model.zero_grad()
        model(x).square().sum().backward()
        pre.precondition([linears[int(name)].weight for name in chosen])
        built.append(next(layout for key, layout in pre._step.plans.items() if list(key[0]) == chosen))
    assert len(pre._step.plans) == 16
    assert [list(key[0]) for key in pre._step.plans] == sets[1:]
    assert all(kept is made for kept, made in zip(pre._step.plans.values(), built[1:], strict=True))


@pytest.mark.parametrize("shape", [(60, 16), (4, 5, 16)])
def test_a_linear_layers_statistics_on_the_cpu_are_the_fused_kernel_not_var_mean(shape: tuple[int, ...]) -> None:
    """On the CPU a Linear layer's (rows, features) input is reduced by ATen's fused ``batch_norm_update_stats``
    (plus the exact ``mean(0)``), not by ``var_mean``, whose Welford kernel is 15–30× slower there for such an input;
    the statistics are those of the input all the same (biased variance)."""
    layer, h = nn.Linear(16, 3).double(), torch.randn(*shape, dtype=torch.float64) * 3 + 1
    cost = profile_cost(lambda: moments_of_input(layer, h, layer(h)))
    assert "aten::batch_norm_update_stats" in cost.by_name and "aten::var_mean" not in cost.by_name, cost.by_name
    rows = h.reshape(-1, 16)
    m = moments_of_input(layer, h, layer(h))
    assert m.rows == rows.shape[0]
    torch.testing.assert_close(m.mean, rows.mean(0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m.var, rows.var(0, correction=0), rtol=1e-10, atol=1e-12)
