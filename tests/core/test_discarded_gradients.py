"""Statistics of a forward whose gradient is thrown away (issue 37, item 5): a GAN trained without
``toggle_optimizer``. The discriminator's forward during the generator's step reaches the discriminator's weights,
but its ``zero_grad()`` then discards that gradient: its statistics must not join the discriminator's next step."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import torch
from torch import nn

from lightning_bnp import BNPPreconditioner
from tests.host_reads import HostReads

STEPS, BATCH = 4, 8


def _models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 5))
    discriminator = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 1))
    return generator, discriminator


@contextmanager
def _frozen(module: nn.Module) -> Iterator[None]:
    """What Lightning's ``toggle_optimizer`` does to the other optimizer's parameters."""
    for p in module.parameters():
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in module.parameters():
            p.requires_grad_(True)


def _train(*, toggle: bool) -> tuple[nn.Module, nn.Module, BNPPreconditioner, list[dict[str, int]]]:
    generator, discriminator = _models()
    model = nn.ModuleDict({"g": generator, "d": discriminator})
    pre = BNPPreconditioner(model)
    opt_g = torch.optim.SGD(generator.parameters(), lr=0.1)
    opt_d = torch.optim.SGD(discriminator.parameters(), lr=0.1)
    rows: list[dict[str, int]] = []
    transform = pre._step.transform

    def recording(ready: list, pending: object, not_run_here: set[str]) -> None:  # type: ignore[type-arg]
        rows.append({layer.name: int(m.rows) for layer, m, _ in ready})
        transform(ready, pending, not_run_here)

    pre._step.transform = recording  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(1)
    bce = nn.functional.binary_cross_entropy_with_logits
    for _ in range(STEPS):
        z, real = torch.randn(BATCH, 3, generator=g), torch.randn(BATCH, 5, generator=g) * 2 + 1
        # generator step: the discriminator's forward runs, and (untoggled) its weights get a gradient
        opt_g.zero_grad()
        fake = generator(z)
        if toggle:
            with _frozen(discriminator):
                loss_g = bce(discriminator(fake), torch.ones(BATCH, 1))
        else:
            loss_g = bce(discriminator(fake), torch.ones(BATCH, 1))
        loss_g.backward()
        pre.step(opt_g)
        opt_g.step()
        # discriminator step: its zero_grad() discards the gradient of the generator step's forward
        logits_real, logits_fake = discriminator(real), discriminator(fake.detach())
        loss_d = bce(logits_real, torch.ones(BATCH, 1)) + bce(logits_fake, torch.zeros(BATCH, 1))
        opt_d.zero_grad()
        loss_d.backward()
        pre.step(opt_d)
        opt_d.step()
    return generator, discriminator, pre, rows


def test_a_discarded_gradient_takes_its_statistics_with_it() -> None:
    with HostReads() as reads:
        generator, discriminator, pre, rows = _train(toggle=False)
    assert reads.total == 0
    ref_generator, ref_discriminator, ref_pre, ref_rows = _train(toggle=True)
    assert rows == ref_rows
    assert rows[1] == {"d.0": 2 * BATCH, "d.2": 2 * BATCH}  # the discriminator's step: real and fake, once each
    for name, layer in ref_pre.layers.items():
        assert pre.layers[name].running.steps == layer.running.steps == STEPS
        torch.testing.assert_close(pre.layers[name].running.mu, layer.running.mu, rtol=0, atol=0)
        torch.testing.assert_close(pre.layers[name].running.var, layer.running.var, rtol=0, atol=0)
    for p, q in zip([*generator.parameters(), *discriminator.parameters()],
                    [*ref_generator.parameters(), *ref_discriminator.parameters()]):  # fmt: skip
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_accumulated_micro_batches_keep_their_statistics() -> None:
    """Two backwards into one gradient (no reset between them) both count, as before."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3))
    pre = BNPPreconditioner(net)
    seen: list[int] = []
    transform = pre._step.transform

    def recording(ready: list, pending: object, not_run_here: set[str]) -> None:  # type: ignore[type-arg]
        seen.extend(int(m.rows) for _, m, _ in ready)
        transform(ready, pending, not_run_here)

    pre._step.transform = recording  # type: ignore[method-assign]
    for x in (torch.randn(5, 4), torch.randn(7, 4)):
        net(x).sum().backward()
    pre.step()
    assert seen == [12]


def test_a_layer_run_traced_and_eager_in_one_step_after_a_counted_step_keeps_both_calls() -> None:
    """The mark that a step's statistics reached the gradient is the previous step's: once that step consumed them,
    a traced forward (counted at the forward) and an eager one (counted when the backward reaches it) of the next
    step both count, 5 + 6 rows, after ``zero_grad()`` reset the gradient between the steps — as after a paused
    first step."""
    torch.manual_seed(0)
    for first in ("paused", "counted"):
        net = nn.Linear(3, 2)
        pre = BNPPreconditioner(net)
        if first == "paused":
            with pre.paused():
                net(torch.randn(4, 3)).sum().backward()
        else:
            net(torch.randn(4, 3)).sum().backward()
            pre.step()
        net.zero_grad()
        with mock.patch.object(torch.compiler, "is_compiling", lambda: True):
            traced = net(torch.randn(5, 3))
        eager = net(torch.randn(6, 3))
        (traced.sum() + eager.sum()).backward()
        moments = pre.layers[""].moments
        assert moments is not None and int(moments.rows) == 11, first
