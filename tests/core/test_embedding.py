"""Issue 24, item 4: ``nn.Embedding`` is a bias-free ``nn.Linear`` on one-hot inputs.

The reference is BNP on ``nn.Linear(V, d, bias=False)`` with the transposed weight, fed ``F.one_hot`` of the
same tokens: after several SGD steps (running statistics, batch size one included) both hold the same
parameters and statistics. With ``padding_idx`` the twin sees the real tokens only.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_bnp.core import BNPPreconditioner
from lightning_bnp.core.layers import BNPWarning
from lightning_bnp.core.moments import token_moments
from lightning_bnp.core.statistics import Moments

V, D, C = 11, 6, 3
PAD = 2


class EmbeddingNet(nn.Module):
    """Tokens → embedding → tanh → Linear head; with ``padding_idx`` the head sees the real positions only."""

    def __init__(self, padding_idx: int | None = None, max_norm: float | None = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D, padding_idx=padding_idx, max_norm=max_norm)
        self.head = nn.Linear(D, C)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.emb(x))
        if self.emb.padding_idx is not None:
            h = h[x != self.emb.padding_idx]
        return self.head(h)


class OneHotTwin(nn.Module):
    """The same network with the embedding written as ``nn.Linear(V, D, bias=False)`` on ``F.one_hot``."""

    def __init__(self, net: EmbeddingNet) -> None:
        super().__init__()
        self.emb = nn.Linear(V, D, bias=False)
        self.head = nn.Linear(D, C)
        self.padding_idx = net.emb.padding_idx
        with torch.no_grad():
            self.emb.weight.copy_(net.emb.weight.t())
        self.head.load_state_dict(net.head.state_dict())

    def forward(self, x: Tensor) -> Tensor:
        if self.padding_idx is not None:
            x = x[x != self.padding_idx]  # the padding positions are no rows at all
        return self.head(torch.tanh(self.emb(F.one_hot(x, V).to(self.emb.weight.dtype))))


def batches(shapes: list[tuple[int, ...]], padding: bool, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    """Tokens drawn unevenly (some frequent, token V − 1 never), targets per real position."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.linspace(4.0, 0.5, V)
    weights[V - 1] = 0.0
    out = []
    for shape in shapes:
        x = torch.multinomial(weights, int(torch.tensor(shape).prod()), replacement=True, generator=g).view(shape)
        if padding:
            x.view(-1)[:: max(x.numel() // 3, 2)] = PAD  # a third or so of the positions (not all)
            x.view(-1)[-1] = 0  # at least one real token
        real = int((x != PAD).sum()) if padding else x.numel()
        y = torch.randint(0, C, (real,) if padding else (*shape,), generator=g)
        out.append((x, y))
    return out


def loss_of(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out.reshape(-1, C), y.reshape(-1))


def run(model: nn.Module, data: list[tuple[Tensor, Tensor]], accumulate: int = 1, **bnp: object) -> BNPPreconditioner:
    pre = BNPPreconditioner(model, **bnp)  # type: ignore[arg-type]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for i in range(0, len(data), accumulate):
        opt.zero_grad()
        for x, y in data[i : i + accumulate]:
            loss_of(model(x), y).backward()
        pre.step(opt)
        opt.step()
    return pre


def assert_twins(net: EmbeddingNet, twin: OneHotTwin, pre: BNPPreconditioner, pre_twin: BNPPreconditioner) -> None:
    tol = {"rtol": 1e-6, "atol": 1e-7}
    torch.testing.assert_close(net.emb.weight, twin.emb.weight.t(), **tol)
    torch.testing.assert_close(net.head.weight, twin.head.weight, **tol)
    torch.testing.assert_close(net.head.bias, twin.head.bias, **tol)
    assert list(pre.layers) == list(pre_twin.layers) == ["emb", "head"]
    for name in ("emb", "head"):
        got, want = pre.layers[name].running, pre_twin.layers[name].running
        assert got.steps == want.steps
        torch.testing.assert_close(got.mean_acc, want.mean_acc, **tol)
        torch.testing.assert_close(got.var_acc, want.var_acc, **tol)


@pytest.mark.parametrize(("statistics", "bias_correction"), [("running", False), ("running", True), ("batch", False)])
def test_embedding_equals_bnp_on_a_bias_free_linear_fed_one_hot_inputs(statistics: str, bias_correction: bool) -> None:
    torch.manual_seed(0)
    net = EmbeddingNet()
    twin = OneHotTwin(net)
    shapes = [(4, 5), (2, 3), (7,), (3, 2, 2)] + ([(1, 1), (1,)] if statistics == "running" else [])
    data = batches(shapes, padding=False)
    options = {"statistics": statistics, "bias_correction": bias_correction}
    pre = run(net, data, embeddings=True, **options)
    pre_twin = run(twin, data, **options)
    assert_twins(net, twin, pre, pre_twin)
    assert pre.layers["emb"].fan_in == pre.layers["emb"].features == V
    if statistics == "running" and not bias_correction:  # a never-seen token keeps the paper's initial σ² = ρ^t
        running = pre.layers["emb"].running
        assert running.var[V - 1] == pytest.approx(running.rho**running.steps)


def test_embedding_statistics_are_the_token_frequencies() -> None:
    """Uncentred second moment of a one-hot column = the token's frequency; N = every index; q² = V/N."""
    x = torch.tensor([[0, 3, 3], [5, 3, 0]])
    m = token_moments(x, 7, None, torch.float32)
    p = torch.tensor([2, 0, 0, 3, 0, 1, 0]) / 6
    assert m.rows == m.samples == 6
    torch.testing.assert_close(m.mean, p)
    torch.testing.assert_close(m.var + m.mean**2, p)  # what the step uses for a bias-free layer
    with_pad = token_moments(x, 7, 3, torch.float32)
    assert isinstance(with_pad.rows, Tensor) and float(with_pad.rows) == 3.0  # stays on the device
    torch.testing.assert_close(with_pad.mean, torch.tensor([2, 0, 0, 0, 0, 1, 0]) / 3)
    empty = token_moments(torch.tensor([3, 3]), 7, 3, torch.float64)
    assert float(empty.rows) == 0.0 and empty.mean.dtype == torch.float64 and not empty.mean.any()


def test_padding_positions_are_not_tokens() -> None:
    """The padding row gets no gradient from torch and keeps none; μ, σ², N (hence q²) are those of the real
    tokens: equal to the one-hot twin fed the real tokens only, with micro-batches accumulated."""
    torch.manual_seed(1)
    net = EmbeddingNet(padding_idx=PAD)
    twin = OneHotTwin(net)
    data = batches([(4, 5), (2, 3), (3, 4), (5, 2), (2, 2), (6,)], padding=True)
    pad_row = net.emb.weight[PAD].detach().clone()
    for accumulate in (1, 2):
        pre, pre_twin = run(net, data, accumulate, embeddings=True), run(twin, data, accumulate)
        assert_twins(net, twin, pre, pre_twin)
        assert torch.equal(net.emb.weight[PAD], pad_row)
        assert pre.layers["emb"].running.var[PAD] == pytest.approx(pre.layers["emb"].running.rho ** (6 // accumulate))
        pre.detach()
        pre_twin.detach()


def test_a_step_with_only_padding_leaves_the_embeddings_statistics_alone() -> None:
    """No real token in a step: N = 0 on the device, so the embedding gets M = I and keeps its statistics."""
    net = EmbeddingNet(padding_idx=PAD)
    pre = BNPPreconditioner(net, embeddings=True, include="emb")
    net.emb(torch.full((2, 3), PAD)).sum().backward()
    pre.step()
    assert pre.layers["emb"].running.steps == 0
    assert not net.emb.weight.grad.any()  # type: ignore[union-attr]
    net.emb(torch.tensor([[PAD, 1, 1]])).sum().backward()
    pre.step()
    running = pre.layers["emb"].running
    assert running.steps == 1 and running.mean_acc.sum() == 0.0  # bias-free: μ stays 0
    torch.testing.assert_close(running.var_acc[1], torch.tensor(0.01))  # (1 − ρ)·p_1, p_1 = 2/2


def test_max_norm_renormalizes_in_the_forward_and_bnp_transforms_that_forwards_gradient() -> None:
    """``max_norm``: torch rescales the looked-up rows of the stored weight in place before the lookup; the
    gradient is that of the renormalized weight, which BNP transforms as the twin's (built from it)."""
    torch.manual_seed(2)
    net = EmbeddingNet(max_norm=0.5)
    ((x, y),) = batches([(4, 5)], padding=False)
    pre = BNPPreconditioner(net, embeddings=True)
    loss_of(net(x), y).backward()
    assert net.emb.weight[x.unique()].norm(dim=1).max() <= 0.5 + 1e-6  # renormalized in the forward
    twin = OneHotTwin(net)  # from the renormalized weight
    pre_twin = BNPPreconditioner(twin)
    loss_of(twin(x), y).backward()
    pre.step()
    pre_twin.step()
    torch.testing.assert_close(net.emb.weight.grad, twin.emb.weight.grad.t(), rtol=1e-6, atol=1e-7)  # type: ignore[union-attr]


def test_embeddings_are_off_by_default_and_named_in_the_setup_report() -> None:
    net = EmbeddingNet()
    pre = BNPPreconditioner(net)
    assert list(pre.layers) == ["head"]
    assert pre.skipped == {"emb.weight": "embedding (embeddings=False)"}
    assert "emb.weight (embedding (embeddings=False))" in pre.report()
    assert "embeddings" not in repr(pre)
    pre.detach()
    on = BNPPreconditioner(net, embeddings=True)
    assert list(on.layers) == ["emb", "head"] and on.skipped == {} and "embeddings=True" in repr(on)
    on.detach()
    named = BNPPreconditioner(net, layer_types=["Embedding"])  # the kind's name selects it as well
    assert list(named.layers) == ["emb"] and named.skipped == {
        "head.weight": "layer type 'Linear' is not in `layer_types`"
    }
    named.detach()
    excluded = BNPPreconditioner(net, embeddings=True, exclude="emb")
    assert excluded.skipped == {"emb.weight": "excluded by `exclude` pattern 'emb'"}
    excluded.detach()
    with pytest.raises(TypeError, match="`embeddings` must be a bool"):
        BNPPreconditioner(net, embeddings="yes")  # type: ignore[arg-type]


def test_sparse_embeddings_and_an_embedding_tied_to_a_managed_linear_are_refused() -> None:
    net = EmbeddingNet()
    net.emb.sparse = True
    with pytest.raises(ValueError, match=r"BNP layer 'emb' \(Embedding\): sparse=True gives a sparse gradient"):
        BNPPreconditioner(net, embeddings=True)
    BNPPreconditioner(net).detach()  # left alone when embeddings are off

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.out = nn.Embedding(V, D), nn.Linear(D, V, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, x: Tensor) -> Tensor:
            return self.out(self.emb(x))

    with pytest.raises(ValueError, match=r"layers 'emb' \(Embedding\) and 'out' \(Linear\) share one weight"):
        BNPPreconditioner(Tied(), embeddings=True)
    with pytest.warns(BNPWarning, match="shares its weight with 'out'"):
        BNPPreconditioner(Tied(), embeddings=True, exclude="out").detach()


@pytest.mark.parametrize("padding_idx", [None, PAD])
def test_the_token_counts_trace_into_a_compiled_models_graph(padding_idx: int | None) -> None:
    """``index_add_`` has a static shape (``bincount`` would not): the statistics fuse into the compiled
    forward (fullgraph) and equal eager BNP's."""
    torch.manual_seed(3)
    nets = [EmbeddingNet(padding_idx), EmbeddingNet(padding_idx)]
    nets[1].load_state_dict(nets[0].state_dict())
    data = batches([(4, 5), (3, 3), (2, 6)], padding=padding_idx is not None)
    eager = run(nets[0], data, embeddings=True)
    # (with padding the net's own h[x != pad] is data-dependent and breaks the graph; BNP's hook does not)
    compiled = torch.compile(nets[1], backend="aot_eager", fullgraph=padding_idx is None)
    pre = BNPPreconditioner(nets[1], embeddings=True)
    opt = torch.optim.SGD(nets[1].parameters(), lr=0.5)
    for x, y in data:
        opt.zero_grad()
        loss_of(compiled(x), y).backward()
        pre.step(opt)
        opt.step()
    for name in ("emb", "head"):
        torch.testing.assert_close(pre.layers[name].running.var_acc, eager.layers[name].running.var_acc)
    torch.testing.assert_close(nets[1].emb.weight, nets[0].emb.weight)


@pytest.mark.parametrize("padding_idx", [None, PAD])
def test_token_moments_pack_and_pool_over_ranks_as_one_batch(padding_idx: int | None) -> None:
    """What ``_pool`` does with two ranks' parts (pack, all-gather, unpack, Chan merge) gives the moments of the
    two ranks' tokens together; with ``padding_idx`` the counts packed are device tensors."""
    g = torch.Generator().manual_seed(4)
    a, b = torch.randint(0, V, (3, 4), generator=g), torch.randint(0, V, (5,), generator=g)
    a[0, 0] = b[1] = PAD
    parts = [token_moments(t, V, padding_idx, torch.float32) for t in (a, b)]
    flat = [Moments.unpack(p.pack(), V, torch.float32) for p in parts]
    pooled = flat[0].merge(flat[1])
    whole = token_moments(torch.cat([a.flatten(), b]), V, padding_idx, torch.float32)
    real = int((torch.cat([a.flatten(), b]) != PAD).sum()) if padding_idx is not None else 17
    assert float(pooled.rows) == float(whole.rows) == real
    torch.testing.assert_close(pooled.mean, whole.mean)
    torch.testing.assert_close(pooled.var, whole.var)


def test_a_token_mask_leaves_the_masked_positions_out_like_padding() -> None:
    """Under ``pre.token_mask`` the (B, T) mask applies to a (B, T) batch of indices position by position: the
    embedding's statistics are those of the real tokens alone, on top of ``padding_idx`` (explicit frequencies),
    and a masked run equals the one-hot twin fed the real tokens only."""
    x = torch.tensor([[0, 3, 3, 5], [5, 3, PAD, 1]])
    real = torch.tensor([[True, True, False, False], [True, True, True, False]])
    m = token_moments(x, 7, PAD, torch.float32, real)
    assert isinstance(m.rows, Tensor) and float(m.rows) == 4.0  # 0, 3, 5, 3 (PAD is not a token)
    torch.testing.assert_close(m.mean, torch.tensor([1, 0, 0, 2, 0, 1, 0]) / 4)

    torch.manual_seed(2)
    net = EmbeddingNet()
    twin = OneHotTwin(net)
    net_pre, twin_pre = BNPPreconditioner(net, embeddings=True), BNPPreconditioner(twin)
    opt, twin_opt = torch.optim.SGD(net.parameters(), lr=0.5), torch.optim.SGD(twin.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        tokens = torch.randint(0, V, (3, 5), generator=g)
        mask = torch.rand(3, 5, generator=g) < 0.6
        mask[0, 0] = True
        y = torch.randint(0, C, (int(mask.sum()),), generator=g)
        with net_pre.token_mask(mask):  # the embedding (B, T) and the head (B, T, D) alike
            loss_of(net(tokens)[mask], y).backward()
        loss_of(twin(tokens[mask]), y).backward()
        for pre, optimizer in ((net_pre, opt), (twin_pre, twin_opt)):
            pre.step(optimizer)
            optimizer.step()
            optimizer.zero_grad()
    torch.testing.assert_close(net.emb.weight, twin.emb.weight.t(), rtol=1e-6, atol=1e-7)
    got, want = net_pre.layers["emb"].running, twin_pre.layers["emb"].running
    torch.testing.assert_close(got.mean_acc, want.mean_acc, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got.var_acc, want.var_acc, rtol=1e-6, atol=1e-7)
