"""Issue 15: one bad batch, one unusual call, tied weights — the core's rules, each against a reference
run that never saw the bad input (so every test fails on the code before the fix)."""

from __future__ import annotations

import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_bnp.core import BNPPreconditioner, BNPWarning

BATCH, FEATURES, HIDDEN, CLASSES = 8, 5, 6, 3


def make_net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.LeakyReLU(), nn.Linear(HIDDEN, CLASSES)).double()


def batch(seed: int, *, bad: float | None = None) -> tuple[Tensor, Tensor]:
    """Inputs far from μ = 0, σ² = 1 (so that a wrong statistic shows); ``bad`` puts that value
    (NaN or Inf) into one entry of one sample."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, FEATURES, generator=g, dtype=torch.float64) * torch.logspace(-1, 1, FEATURES) + 2.0
    if bad is not None:
        x[3, 1] = bad
    return x, torch.randint(0, CLASSES, (BATCH,), generator=g)


def statistics(pre: BNPPreconditioner) -> dict[str, tuple[Tensor, Tensor, int]]:
    return {name: (lay.running.mean_acc, lay.running.var_acc, lay.running.steps) for name, lay in pre.layers.items()}


def assert_same_state(net: nn.Module, pre: BNPPreconditioner, ref_net: nn.Module, ref_pre: BNPPreconditioner) -> None:
    for (name, p), q in zip(net.named_parameters(), ref_net.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    for name, (mean, var, steps) in statistics(pre).items():
        ref_mean, ref_var, ref_steps = statistics(ref_pre)[name]
        assert steps == ref_steps, name
        torch.testing.assert_close(mean, ref_mean, rtol=0, atol=0)
        torch.testing.assert_close(var, ref_var, rtol=0, atol=0)


def zero_non_finite_gradients(net: nn.Module) -> None:
    """A common guard: a non-finite gradient entry becomes 0."""
    for p in net.parameters():
        if p.grad is not None:
            torch.nan_to_num_(p.grad, nan=0.0, posinf=0.0, neginf=0.0)


def sgd_step(net: nn.Module, lr: float = 0.5) -> None:
    with torch.no_grad():
        for p in net.parameters():
            if p.grad is not None:
                p -= lr * p.grad
                p.grad = None


# ------------------------------------------------------------ item 1: NaN / Inf samples
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_sample_never_enters_the_running_statistics(bad: float) -> None:
    """Issue 15 item 1a: with a guard that zeroes non-finite gradients, a NaN/Inf sample must not
    poison the statistics: the run equals one that skipped that batch, warns once naming the layer,
    and keeps training (before the fix every later update was exactly 0). The warning comes from the next
    step (issue 28: the step itself reads nothing back from the device)."""
    net, ref = make_net(), make_net()
    pre, ref_pre = BNPPreconditioner(net), BNPPreconditioner(ref)
    for step in range(4):
        bad_now = bad if step == 1 else None
        if bad_now is None:  # the reference skips the bad batch altogether
            x, y = batch(step)
            F.cross_entropy(ref(x), y).backward()
            ref_pre.step()
            sgd_step(ref)
        x, y = batch(step, bad=bad_now)
        before = [p.detach().clone() for p in net.parameters()]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            F.cross_entropy(net(x), y).backward()
            pre.step()
        zero_non_finite_gradients(net)
        sgd_step(net)
        messages = [str(w.message) for w in caught if issubclass(w.category, BNPWarning)]
        if step == 2:  # the step after the bad one
            assert any("'0'" in m and "not finite" in m for m in messages), messages
        else:
            assert not messages, messages
        if step != 1:
            assert all(not torch.equal(b, p) for b, p in zip(before, net.parameters()))  # it still trains
    assert_same_state(net, pre, ref, ref_pre)
    assert all(torch.isfinite(m).all() and torch.isfinite(v).all() for m, v, _ in statistics(pre).values())


@pytest.mark.parametrize("give_optimizer", [True, False])
def test_step_given_the_optimizer_commits_only_if_the_optimizer_steps(give_optimizer: bool) -> None:
    """Issue 15 item 1b: in a plain loop with ``torch.amp.GradScaler``, ``pre.step(optimizer)`` stores the
    statistics only when ``optimizer.step()`` runs; the step the scaler skips leaves them as before.
    ``pre.step()`` without the optimizer cannot know, and commits."""
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    pre = BNPPreconditioner(net)
    stored = []
    for step in range(3):
        opt.zero_grad()
        x, y = batch(step)
        loss = F.cross_entropy(net(x), y) * (float("inf") if step == 1 else 1.0)  # finite inputs, inf gradient
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        pre.step(opt) if give_optimizer else pre.step()
        scaler.step(opt)
        scaler.update()
        stored.append(statistics(pre)["0"])
    assert [s[2] for s in stored] == ([1, 1, 2] if give_optimizer else [1, 2, 3])
    if give_optimizer:  # the skipped step committed nothing
        torch.testing.assert_close(stored[1][0], stored[0][0], rtol=0, atol=0)


def test_step_given_the_optimizer_equals_step_then_optimizer_step() -> None:
    nets = [make_net(), make_net()]
    opts = [torch.optim.SGD(n.parameters(), lr=0.5, momentum=0.9) for n in nets]
    pres = [BNPPreconditioner(n) for n in nets]
    for step in range(3):
        for i, (net, opt, pre) in enumerate(zip(nets, opts, pres)):
            opt.zero_grad()
            x, y = batch(step)
            F.cross_entropy(net(x), y).backward()
            pre.step(opt) if i == 0 else pre.step()
            opt.step()
    assert_same_state(nets[0], pres[0], nets[1], pres[1])


# ------------------------------------------------- item 2: forwards the backward never reaches
def test_a_forward_whose_output_gets_no_gradient_adds_no_statistics() -> None:
    """Issue 15 item 2: a micro-batch that is run and then dropped (``training_step`` returning None) —
    here with its inputs scaled by 1000 and one NaN — changes nothing."""
    net, ref = make_net(), make_net()
    pre, ref_pre = BNPPreconditioner(net), BNPPreconditioner(ref)
    x, y = batch(0)
    dropped, _ = batch(1, bad=float("nan"))
    net(dropped * 1000.0)  # forward in training mode with grad, never back-propagated
    for model, p in ((net, pre), (ref, ref_pre)):
        F.cross_entropy(model(x), y).backward()
        p.step()
        sgd_step(model)
    assert_same_state(net, pre, ref, ref_pre)


def test_a_second_backward_through_one_forward_counts_it_once() -> None:
    net, ref = make_net(), make_net()
    pre, ref_pre = BNPPreconditioner(net), BNPPreconditioner(ref)
    x, y = batch(0)
    loss = F.cross_entropy(net(x), y)
    loss.backward(retain_graph=True)
    (0.0 * loss).backward()
    pre.step()
    F.cross_entropy(ref(x), y).backward()
    ref_pre.step()
    assert_same_state(net, pre, ref, ref_pre)
    assert statistics(pre)["0"][2] == 1


def test_a_second_backward_counts_once_where_q2_depends_on_the_batch() -> None:
    """Issue 27: at a batch smaller than the input width q² = n_in/N, so a forward counted twice (2N rows) would
    halve q² of both layers and double the step (at N > n_in, q² = 1 whatever N is and the counting rule is free)."""
    net, ref = make_net(), make_net()
    pre, ref_pre = BNPPreconditioner(net), BNPPreconditioner(ref)
    x, y = batch(0)
    x, y = x[:3], y[:3]  # N = 3 < n_in = 5 and 6
    loss = F.cross_entropy(net(x), y)
    loss.backward(retain_graph=True)
    (0.0 * loss).backward()  # the same graph once more: adds nothing to the gradient
    pre.step()
    F.cross_entropy(ref(x), y).backward()
    ref_pre.step()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=0)
    for layer, fan_in in zip(pre.layers.values(), (FEATURES, HIDDEN)):
        assert layer.transform is not None and layer.transform.q2 == fan_in / 3


def test_a_forward_from_before_detach_never_counts_after_a_new_attach() -> None:
    """Issue 27: detach() drops an unfinished step; a forward that ran before it (here with inputs 1000× larger)
    whose backward runs only after attach() must not join the next step."""
    net, ref = make_net(), make_net()
    pre, ref_pre = BNPPreconditioner(net), BNPPreconditioner(ref)
    old, _ = batch(1)
    stale = net(old * 1000.0)  # hooked: its statistics wait for the backward to reach this output
    pre.detach()
    pre.attach()
    x, y = batch(0)
    (F.cross_entropy(net(x), y) + 0.0 * stale.sum()).backward()  # reaches the stale output too
    pre.step()
    F.cross_entropy(ref(x), y).backward()
    ref_pre.step()
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=0)
    assert_same_state(net, pre, ref, ref_pre)


def test_a_forward_between_two_detaches_never_counts_after_the_second() -> None:
    """Every detach() starts a new generation: a forward from between the first and the second detach (not only
    one from before the first) stays out of a step after the second."""
    net, ref = make_net(), make_net()
    pre, ref_pre = BNPPreconditioner(net), BNPPreconditioner(ref)
    pre.detach()
    pre.attach()
    old, _ = batch(1)
    stale = net(old * 1000.0)
    pre.detach()
    pre.attach()
    x, y = batch(0)
    (F.cross_entropy(net(x), y) + 0.0 * stale.sum()).backward()
    pre.step()
    F.cross_entropy(ref(x), y).backward()
    ref_pre.step()
    assert_same_state(net, pre, ref, ref_pre)


def test_moments_whose_variance_alone_is_not_finite_never_enter_the_running_statistics() -> None:
    """Issue 27: the non-finite guard must look at σ²_H, not only at μ_H. (The issue's case, one float32 sample of
    1e20, no longer reaches the guard: σ²_H saturates since issue 25 item 4, tested below with the overflow; so the
    step's σ²_H is made NaN directly, with μ_H finite.) The step keeps the committed statistics (P from them),
    later steps equal a run without that batch, and a BNPWarning names the layer by the end of the next step."""
    net, ref = make_net().float(), make_net().float()
    pre, ref_pre = BNPPreconditioner(net), BNPPreconditioner(ref)
    messages = []
    for step in range(4):
        x, y = batch(step)
        x = x.float()
        if step != 1:  # the reference skips the bad batch altogether
            F.cross_entropy(ref(x), y).backward()
            ref_pre.step()
            sgd_step(ref)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            F.cross_entropy(net(x), y).backward()
            if step == 1:
                for layer in pre.layers.values():
                    assert layer.moments is not None
                    layer.moments.var[1] = math.nan  # μ_H stays finite
                moments = pre.layers["0"].running.mean_acc.clone(), pre.layers["0"].running.var_acc.clone()
            pre.step()
        messages += [str(w.message) for w in caught if issubclass(w.category, BNPWarning)]
        if step == 1:
            for p in net.parameters():  # the optimizer step is skipped (as GradScaler would on an inf gradient)
                p.grad = None
            running = pre.layers["0"].running
            torch.testing.assert_close(running.mean_acc, moments[0], rtol=0, atol=0)
            torch.testing.assert_close(running.var_acc, moments[1], rtol=0, atol=0)
        else:
            sgd_step(net)
    assert any("'0'" in m for m in messages), messages  # loosely: raised at the bad step or the next one
    for name, (mean, var, _) in statistics(pre).items():
        ref_mean, ref_var, _ = statistics(ref_pre)[name]
        torch.testing.assert_close(mean, ref_mean, rtol=0, atol=0)
        torch.testing.assert_close(var, ref_var, rtol=0, atol=0)
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


# ----------------------------------------------------------- item 3: activation checkpointing
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_counts_each_forward_once(use_reentrant: bool) -> None:
    """Issue 15 item 3: the forward that checkpointing recomputes during backward is not a second batch
    (non-reentrant mode pooled 4 rows instead of 2 before the fix, halving q² = n_in/N)."""
    net, ref = make_net(), make_net()
    pre, ref_pre = BNPPreconditioner(net), BNPPreconditioner(ref)
    for step in range(2):
        x, y = (t[:2] for t in batch(step))  # N = 2 < n_in: q² depends on N
        x.requires_grad_(use_reentrant)  # reentrant checkpointing needs an input that requires grad
        F.cross_entropy(checkpoint(net, x, use_reentrant=use_reentrant), y).backward()
        pending = pre.precondition(commit=False)
        pending.commit()
        assert [layer.running.steps for layer in pre.layers.values()] == [step + 1, step + 1]
        F.cross_entropy(ref(x.detach()), y).backward()
        ref_pre.step()
        for model in (net, ref):
            sgd_step(model)
    assert_same_state(net, pre, ref, ref_pre)


# ----------------------------------------------------------------------- item 4: tied weights
class TiedAutoencoder(nn.Module):
    def __init__(self, share_bias: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc, self.dec = nn.Linear(FEATURES, FEATURES).double(), nn.Linear(FEATURES, FEATURES).double()
        self.dec.weight = self.enc.weight
        if share_bias:
            self.dec.bias = self.enc.bias

    def forward(self, x: Tensor) -> Tensor:
        return self.dec(torch.tanh(self.enc(x)))


def test_tied_weights_with_separate_biases_are_refused_naming_both() -> None:
    """Issue 15 item 4: the shared gradient used to be divided by both layers' q²σ̃² — neither transform."""
    with pytest.raises(ValueError, match=r"'enc' and 'dec' share one weight but not their bias"):
        BNPPreconditioner(TiedAutoencoder(share_bias=False))
    pre = BNPPreconditioner(TiedAutoencoder(share_bias=False), exclude="dec")  # the suggested way out warns
    assert list(pre.layers) == ["enc"]


def test_excluding_one_of_two_tied_layers_warns() -> None:
    with pytest.warns(BNPWarning, match=r"'enc' shares its weight with 'dec'"):
        BNPPreconditioner(TiedAutoencoder(share_bias=False), exclude="dec")


def test_fully_tied_layers_are_one_layer_like_a_module_called_twice() -> None:
    """A weight and bias shared by two modules is one layer applied twice: its statistics pool both
    calls and the gradient is transformed once — exactly the run of one module called twice."""
    tied = TiedAutoencoder(share_bias=True)
    torch.manual_seed(0)
    single = nn.Linear(FEATURES, FEATURES).double()

    def twice(x: Tensor) -> Tensor:
        return single(torch.tanh(single(x)))

    pre, ref_pre = BNPPreconditioner(tied), BNPPreconditioner(single)
    assert list(pre.layers) == ["enc"] and list(pre.layers["enc"].modules) == ["enc", "dec"]
    for step in range(3):
        x, _ = batch(step)
        for model, p in ((tied, pre), (twice, ref_pre)):
            model(x).square().mean().backward()
            p.step()
        for module in (tied, single):
            sgd_step(module)
    torch.testing.assert_close(tied.enc.weight, single.weight, rtol=0, atol=0)
    torch.testing.assert_close(tied.enc.bias, single.bias, rtol=0, atol=0)
    assert pre.state_dict()["layers"]["enc"]["steps"] == 3
    torch.testing.assert_close(pre.layers["enc"].running.var_acc, ref_pre.layers[""].running.var_acc, rtol=0, atol=0)


# ------------------------------------------------------------- item 8: keyword arguments
class KeywordNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def forward(self, x: Tensor) -> Tensor:
        return self.net[2](input=self.net[1](self.net[0](input=x)))


def test_a_bias_registered_after_set_up_is_left_as_autograd_gave_it() -> None:
    """A Linear set up without a bias keeps the bias-free P it was set up with (uncentred statistics, no centring
    block) when a bias is registered on it later: P has no block for the new bias, whose gradient stays as autograd
    gave it (two rows: q² = 3/2, so a transformed one would differ), and the weight's gradient is the bias-free
    layer's."""
    torch.manual_seed(0)
    late, plain = nn.Linear(3, 2, bias=False).double(), nn.Linear(3, 2, bias=False).double()
    plain.load_state_dict(late.state_dict())
    pre_late, pre_plain = BNPPreconditioner(late), BNPPreconditioner(plain)
    late.bias = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    x = torch.randn(2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) + 1
    for net in (late, plain):
        net(x).square().sum().backward()
    assert late.bias.grad is not None
    raw = late.bias.grad.clone()
    pre_late.step()
    pre_plain.step()
    assert torch.equal(late.bias.grad, raw)
    assert plain.weight.grad is not None and late.weight.grad is not None
    torch.testing.assert_close(late.weight.grad, plain.weight.grad, rtol=0, atol=0)


def test_a_layer_called_with_a_keyword_argument_is_preconditioned() -> None:
    """Issue 15 item 8: ``self.fc(input=x)`` raised ``IndexError: tuple index out of range`` in the hook."""
    net, ref = KeywordNet(), make_net()
    pre, ref_pre = BNPPreconditioner(net), BNPPreconditioner(ref)
    x, y = batch(0)
    for model, p in ((net, pre), (ref, ref_pre)):
        F.cross_entropy(model(x), y).backward()
        p.step()
        sgd_step(model)
    for (name, p), q in zip(net.net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    assert pre.layers["net.0"].running.steps == 1


# --------------------------------------------------------- "also measured": misuse made loud
def test_a_second_step_on_the_same_gradient_leaves_it_and_says_why() -> None:
    """``pre.step()`` twice for one backward used to warn that the forward never ran "… F.linear";
    the gradient is transformed once and the warning says what happened."""
    net = make_net()
    pre = BNPPreconditioner(net)
    x, y = batch(0)
    F.cross_entropy(net(x), y).backward()
    pre.step()
    once = [p.grad.clone() for p in net.parameters()]  # type: ignore[union-attr]
    with pytest.warns(BNPWarning, match="already preconditioned") as caught:
        pre.step()
    assert not any("F.linear" in str(w.message) for w in caught)
    for g, p in zip(once, net.parameters()):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
    F.cross_entropy(net(x), y).backward()  # a new backward accumulates into the same tensor: transformed again
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pre.step()


def test_two_attached_preconditioners_on_one_model_are_refused() -> None:
    """Two preconditioners transformed the gradients twice, silently."""
    net = make_net()
    first = BNPPreconditioner(net)
    with pytest.raises(RuntimeError, match=r"already managed by another attached BNPPreconditioner"):
        BNPPreconditioner(net)
    first.detach()
    second = BNPPreconditioner(net)
    with pytest.raises(RuntimeError, match="already managed"):
        first.attach()
    assert second.attached


# ------------------------------------------------- issue 25 item 4: finite inputs whose squares overflow
def _huge_batch(seed: int, scale: float) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(BATCH, FEATURES, generator=g) + 2.0) * scale
    return x, torch.randint(0, CLASSES, (BATCH,), generator=g)


def test_finite_inputs_whose_squares_overflow_are_named_as_such_and_never_freeze_the_statistics() -> None:
    """|h| ≈ 1e20 in float32: σ²_H ≈ 1e40 is not representable. Before the fix σ² was inf, the step was
    treated as a NaN/Inf sample ("a NaN or Inf in the batch": there was none) and the statistics were never
    updated again. Now σ²_H saturates, every step counts, the statistics stay finite and follow the data back
    when it returns to normal, and the warning names the overflow."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.LeakyReLU(), nn.Linear(HIDDEN, CLASSES))
    pre = BNPPreconditioner(net, rho=0.5)
    scales = [1.0, 1e20, 1e20, 1e20, 1.0, 1.0, 1.0, 1.0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, scale in enumerate(scales):
            x, y = _huge_batch(step, scale)
            F.cross_entropy(net(x), y).backward()
            pre.step()
            for p in net.parameters():
                assert p.grad is not None and torch.isfinite(p.grad).all()
                p.grad = None
        pre.detach()  # raises the warnings the last step still owes
    messages = [str(w.message) for w in caught if issubclass(w.category, BNPWarning)]
    assert any("'0'" in m and "overflows float32" in m for m in messages), messages
    assert not any("NaN or Inf" in m for m in messages), messages
    running = pre.layers["0"].running
    assert running.steps == len(scales)  # no step was dropped
    assert torch.isfinite(running.mean_acc).all() and torch.isfinite(running.var_acc).all()
    # four normal steps at ρ = 0.5 after the saturated ones: the saturated σ² has decayed by 2⁻⁴ at least
    assert running.var_acc.max() < torch.finfo(torch.float32).max * 2.0**-24 / 2**3


def test_batch_statistics_of_overflowing_inputs_never_zero_the_gradient() -> None:
    """statistics='batch' with |h| ≈ 1e20: before the fix σ̃² = inf and the weight gradient was silently 0.
    Now it is the eq. 15 transform with the saturated σ²_H (named by the warning): finite and not 0."""
    from lightning_bnp.core.transform import precondition_, q_squared, var_tilde

    torch.manual_seed(0)
    layer = nn.Linear(FEATURES, CLASSES)
    pre = BNPPreconditioner(layer, statistics="batch")
    x, y = _huge_batch(0, 1e20)
    F.cross_entropy(layer(x), y).backward()
    gw, gb = layer.weight.grad.clone(), layer.bias.grad.clone()  # type: ignore[union-attr]
    pre.step()
    ceiling = torch.finfo(torch.float32).max * 2.0**-24
    x64 = x.double()
    var = x64.var(0, unbiased=False).clamp(max=ceiling).float()
    precondition_(gw, gb, x64.mean(0).float(), var_tilde(var, pre.eps1, pre.eps2), q_squared(FEATURES, BATCH, 1.0))
    grad = layer.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and (grad != 0).all()
    torch.testing.assert_close(grad, gw, rtol=1e-5, atol=0)
    with pytest.warns(BNPWarning, match=r"'' \(Linear\).*overflows float32"):
        pre.flush_warnings()


def test_the_overflow_warning_gives_the_magnitude_and_the_saturation_value() -> None:
    """float32: squares overflow above √max ≈ 1.8e19, and σ²_H saturates at max·2⁻²⁴ ≈ 2.0e31 (so that σ̃² and
    q²·σ̃², q² up to 2²⁴, stay finite)."""
    layer = nn.Linear(FEATURES, CLASSES)
    pre = BNPPreconditioner(layer, statistics="batch")
    x, y = _huge_batch(0, 1e20)
    F.cross_entropy(layer(x), y).backward()
    pre.step()
    message = (
        "BNP layer '' (Linear): the step's input variance σ²_H overflows float32 (finite inputs of magnitude above "
        "~1.8e+19, whose squares are not representable); it is saturated at 2.0e+31 for that step, so σ² and P of "
        "this layer are not exact while inputs stay that large. Rescale the layer's input (normalize the data), or "
        "use float64."
    )
    with pytest.warns(BNPWarning, match="^" + re.escape(message) + "$"):
        pre.flush_warnings()
