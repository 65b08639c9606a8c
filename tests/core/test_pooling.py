"""Pooling a step's statistics over ranks (``sync_statistics``: one ``all_gather`` of every layer's packed moments,
then a Chan merge in rank order) in one process. Two threads are the two ranks of a fake process group: each steps
its own replica of the model on its own part of the batch, and the fake ``all_gather`` hands every rank the parts
of both, as ``torch.distributed`` does. The reference is BNP without ranks on the whole batch. Real processes:
``tests/ddp`` (outside ``make mutate``)."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_bnp.core import BNPPreconditioner, BNPWarning


class TwoRanks:
    """A process group of two ranks (threads) in a default world of three, as ``torch.distributed`` sees it: the
    size of the group or of the world, and an ``all_gather`` that refuses a tensor list of another length than the
    group's (the group defaulting to the world, whose third rank never joins)."""

    def __init__(self) -> None:
        self.group = object()
        self.size = 2  # of the group
        self.parts: list[Tensor | None] = [None, None]
        self.barrier = threading.Barrier(2, timeout=30)
        self.local = threading.local()
        self.gathered: list[tuple[int, int]] = []  # (rank, entries sent) per all_gather

    def get_world_size(self, group: object = None) -> int:
        return self.size if group is self.group else 3

    def all_gather(
        self, tensor_list: list[Tensor], tensor: Tensor, group: object = None, async_op: bool = False
    ) -> None:
        if group is not self.group or len(tensor_list) != self.get_world_size(group):
            raise ValueError(f"all_gather over a group of {self.get_world_size(group)} ranks: {len(tensor_list)}")
        rank = self.local.rank
        self.gathered.append((rank, tensor.numel()))
        self.parts[rank] = tensor.clone()
        self.barrier.wait()
        for out, part in zip(tensor_list, self.parts):
            assert part is not None
            out.copy_(part)
        self.barrier.wait()  # nobody sends again before everyone has read

    def run(self, *steps: Callable[[], None]) -> None:
        """Run rank r's ``steps[r]`` in a thread of its own; the first error of either rank is raised."""
        errors: list[BaseException] = []

        def rank_main(rank: int) -> None:
            self.local.rank = rank
            try:
                steps[rank]()
            except BaseException as error:  # handed to the test thread
                errors.append(error)
                self.barrier.abort()  # the other rank stops waiting for this one

        threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]


@pytest.fixture
def ranks(monkeypatch: pytest.MonkeyPatch) -> TwoRanks:
    fake = TwoRanks()
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", fake.get_world_size)
    monkeypatch.setattr(dist, "all_gather", fake.all_gather)
    return fake


def make_net(device: str = "cpu") -> nn.ModuleDict:
    torch.manual_seed(0)
    net = nn.ModuleDict({"a": nn.Linear(3, 4), "b": nn.Linear(4, 2), "c": nn.Linear(4, 3)})
    return net.double().to(device)


def backward(net: nn.ModuleDict, x: Tensor, x_c: Tensor | None) -> None:
    """``b`` sees every row of ``x``; the branch ``c`` sees the rows of ``x_c`` (none when it is None)."""
    loss = net["b"](torch.tanh(net["a"](x))).sum()
    if x_c is not None:
        loss = loss + net["c"](torch.tanh(net["a"](x_c))).square().sum()
    loss.backward()


def set_gradients(net: nn.ModuleDict) -> None:
    """The same gradient on every replica (under DDP every rank holds the all-reduced one), by hand."""
    g = torch.Generator().manual_seed(1)
    for p in net.parameters():
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype).to(p.device)


def test_ranks_pool_their_moments_into_the_statistics_of_the_whole_batch(ranks: TwoRanks) -> None:
    """Rank 0 runs 3 rows and never the branch ``c``; rank 1 runs 5 rows, 4 of them through ``c`` too. After one
    step both ranks hold what BNP without ranks holds on the 8 rows (and ``c`` on its 4): the same running μ, σ²
    and the same transformed gradients (μ, σ² and the counts behind q² pooled), bitwise the same on both ranks
    (merged in rank order), in one ``all_gather`` per rank of 3 + 2·features entries per layer."""
    g = torch.Generator().manual_seed(2)
    x0 = torch.randn(3, 3, generator=g, dtype=torch.float64)
    x1 = 2.0 + 3.0 * torch.randn(5, 3, generator=g, dtype=torch.float64)  # ranks with other μ and σ²: Chan's δ
    nets = [make_net(), make_net()]
    pres = [BNPPreconditioner(net, sync_statistics=True, process_group=ranks.group) for net in nets]
    backward(nets[0], x0, None)
    backward(nets[1], x1, x1[1:])
    for net in nets:
        set_gradients(net)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BNPWarning)  # rank 0: ``c`` has a gradient but did not run there
        ranks.run(pres[0].step, pres[1].step)
    assert sorted(ranks.gathered) == [(0, 3 * 3 + 2 * (3 + 4 + 4)), (1, 31)]  # features: the inputs

    whole = make_net()
    reference = BNPPreconditioner(whole, sync_statistics=False)  # not in the fake group
    backward(whole, torch.cat([x0, x1]), x1[1:])
    set_gradients(whole)
    reference.step()
    for name in ("a", "b", "c"):
        want = reference.layers[name].running
        for pre in pres:
            got = pre.layers[name].running
            assert got.steps == want.steps == 1
            torch.testing.assert_close(got.mean_acc, want.mean_acc, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(got.var_acc, want.var_acc, rtol=1e-12, atol=1e-12)
        assert torch.equal(pres[0].layers[name].running.var_acc, pres[1].layers[name].running.var_acc)
    for pname, p in whole.named_parameters():
        grads = [dict(net.named_parameters())[pname].grad for net in nets]
        assert grads[0] is not None and grads[1] is not None and p.grad is not None
        torch.testing.assert_close(grads[0], p.grad, rtol=1e-10, atol=1e-12)
        assert torch.equal(grads[0], grads[1]), pname
    # the pooling is seen: rank 0 alone (3 rows, no ``c``) would transform ``a`` otherwise and leave ``c`` alone
    alone_net = make_net()
    alone = BNPPreconditioner(alone_net, sync_statistics=False)
    backward(alone_net, x0, None)
    set_gradients(alone_net)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BNPWarning)
        alone.step()
    for name in ("a", "c"):
        alone_grad, whole_grad = alone_net[name].weight.grad, whole[name].weight.grad
        assert isinstance(alone_grad, Tensor) and isinstance(whole_grad, Tensor)
        assert not torch.allclose(alone_grad, whole_grad), name


def test_a_layer_that_did_not_run_on_a_rank_sends_an_empty_part_on_the_layers_device(ranks: TwoRanks) -> None:
    """Issue 27 (`make mutate` survivors): the empty part that rank 0 sends for the branch it never ran is made on
    the layer's device, like the parts it sends for the others (one tensor to gather). ``meta`` makes a part made
    on the CPU show on a CPU-only machine; both ranks' statistics stay there."""
    nets = [make_net("meta"), make_net("meta")]
    pres = [BNPPreconditioner(net, process_group=ranks.group) for net in nets]
    x = torch.empty(5, 3, dtype=torch.float64, device="meta")
    backward(nets[0], x[:3], None)
    backward(nets[1], x, x[1:])
    for net in nets:
        set_gradients(net)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BNPWarning)
        ranks.run(pres[0].step, pres[1].step)
    assert len(ranks.gathered) == 2
    for pre in pres:
        for layer in pre.layers.values():
            assert layer.running.mean_acc.device.type == layer.running.var_acc.device.type == "meta"


def test_pooled_statistics_keep_the_layers_dtype(ranks: TwoRanks) -> None:
    """Issue 27 (`_pool` survivors): the parts travel as float64 but every rank's pooled μ and σ² come back in the
    layer's statistics dtype (float32 for a float32 model), so the running statistics stay float32 and equal, up
    to float32 rounding, those of BNP without ranks on the whole batch."""
    g = torch.Generator().manual_seed(3)
    x0, x1 = torch.randn(4, 3, generator=g), 1.0 + 2.0 * torch.randn(6, 3, generator=g)
    nets = [make_net().float(), make_net().float()]
    pres = [BNPPreconditioner(net, process_group=ranks.group) for net in nets]
    backward(nets[0], x0, x0)
    backward(nets[1], x1, x1)
    for net in nets:
        set_gradients(net)
    ranks.run(pres[0].step, pres[1].step)
    whole = make_net().float()
    reference = BNPPreconditioner(whole, sync_statistics=False)
    x = torch.cat([x0, x1])
    backward(whole, x, x)
    set_gradients(whole)
    reference.step()
    for name in ("a", "b", "c"):
        want = reference.layers[name].running
        for pre in pres:
            got = pre.layers[name].running
            assert got.mean_acc.dtype == got.var_acc.dtype == torch.float32, name
            torch.testing.assert_close(got.mean_acc, want.mean_acc)
            torch.testing.assert_close(got.var_acc, want.var_acc)


def test_a_group_of_one_rank_pools_nothing(ranks: TwoRanks) -> None:
    """A process group of one rank in a world of three: nothing to pool, so no collective (the world's size is
    not the group's); the step is BNP's without ranks."""
    ranks.size = 1
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 3, generator=g, dtype=torch.float64)
    net, twin = make_net(), make_net()
    pre = BNPPreconditioner(net, process_group=ranks.group)
    reference = BNPPreconditioner(twin, sync_statistics=False)
    for model, p in ((net, pre), (twin, reference)):
        backward(model, x, x)
        set_gradients(model)
        p.step()
    assert ranks.gathered == []
    for name in ("a", "b", "c"):
        assert torch.equal(pre.layers[name].running.var_acc, reference.layers[name].running.var_acc)


def test_a_nan_another_rank_brought_is_named_only_where_the_layer_ran(ranks: TwoRanks) -> None:
    """Rank 1's batch of the branch ``c`` holds a NaN (it reaches ``a`` and ``c``, not ``b``); rank 0 never ran ``c``.
    Pooled, both ranks' ``a`` and ``c`` statistics are NaN. Rank 1 names both; rank 0 names ``a`` and not ``c``,
    which its step already named as never run there."""
    g = torch.Generator().manual_seed(5)
    x0, x1 = torch.randn(3, 3, generator=g, dtype=torch.float64), torch.randn(4, 3, generator=g, dtype=torch.float64)
    x_c = torch.randn(2, 3, generator=g, dtype=torch.float64)
    x_c[1, 0] = float("nan")
    nets = [make_net(), make_net()]
    pres = [BNPPreconditioner(net, process_group=ranks.group) for net in nets]
    backward(nets[0], x0, None)
    backward(nets[1], x1, x_c)
    for net in nets:
        set_gradients(net)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BNPWarning)
        ranks.run(pres[0].step, pres[1].step)
    named = []
    for pre in pres:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pre.flush_warnings()
        messages = [str(w.message) for w in caught if issubclass(w.category, BNPWarning)]
        assert all("(a NaN or Inf in the batch)" in m for m in messages), messages
        named.append(sorted(m.split("'")[1] for m in messages))
    assert named == [["a"], ["a", "c"]]
