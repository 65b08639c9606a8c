"""FSDP2-style ``DTensor`` gradients in one process (a world-size-1 gloo group): a gradient sharded by rows
(``Shard(0)``) or replicated is transformed through its local tensor exactly as the same plain gradient would be,
and every other sharding is refused naming the layer and the placements. Two ranks: ``tests/ddp/test_fsdp.py``."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard, distribute_tensor

from lightning_bnp.core import BNPPreconditioner


@pytest.fixture
def mesh() -> Iterator[DeviceMesh]:
    """A one-rank CPU mesh (BNP does not pool over a world of one)."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield DeviceMesh("cpu", [0])
    finally:
        dist.destroy_process_group()


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict(
        {
            "emb": nn.Embedding(6, 4),
            "lin": nn.Linear(4, 5),
            "conv": nn.Conv1d(5, 6, 3),
            "grouped": nn.Conv1d(6, 4, 3, groups=2),
        }
    )


def run(net: nn.Module) -> None:
    ids = torch.tensor([[0, 1, 2, 3, 4, 5, 1, 2], [5, 4, 3, 2, 1, 0, 0, 3]])
    h = net["lin"](net["emb"](ids)).transpose(1, 2)  # (2, 5, 8)
    net["grouped"](torch.tanh(net["conv"](h))).square().mean().backward()


def placements_of(name: str) -> list[Any]:
    # rows sharded where BNP can transform them locally, replicated where it cannot (transposed rows, groups)
    return [Shard(0)] if name in ("lin", "conv") else [Replicate()]


def test_row_sharded_and_replicated_dtensor_gradients_are_transformed_like_plain_ones(mesh: DeviceMesh) -> None:
    plain_net, sharded_net = make_net(), make_net()
    plain = BNPPreconditioner(plain_net, embeddings=True)
    sharded = BNPPreconditioner(sharded_net, embeddings=True)
    for _ in range(2):  # the second step uses running statistics of the first
        for net in (plain_net, sharded_net):
            net.zero_grad()
            run(net)
        dtensors = {}
        for name, module in sharded_net.items():
            for pname, p in module.named_parameters():
                assert p.grad is not None
                p.grad = dtensors[f"{name}.{pname}"] = distribute_tensor(p.grad, mesh, placements_of(name))
        plain.step()
        sharded.step()
        for name, module in plain_net.items():
            for pname, p in module.named_parameters():
                got = dtensors[f"{name}.{pname}"]
                assert isinstance(got, DTensor)
                assert p.grad is not None
                torch.testing.assert_close(got.to_local(), p.grad, rtol=0, atol=0)
    assert all(layer.running.steps == 2 for layer in sharded.layers.values())
    # the plain transform really changed the gradients (the comparison above is not between untouched ones)
    fresh = make_net()
    run(fresh)
    assert not torch.allclose(fresh["lin"].weight.grad, plain_net["lin"].weight.grad)


def expected_refusal(name: str, module: str, placements: str) -> str:
    return re.escape(
        f"BNP layer {name!r} ({module}): its gradient is a DTensor with placements {placements}; BNP transforms a "
        "layer sharded by rows (FSDP2's fully_shard: Shard(0) of an nn.Linear or ungrouped ConvNd weight, on a 1-D "
        "data-parallel mesh) or replicated. Tensor parallelism, a transposed weight (GPT-2's Conv1D) or a grouped "
        "convolution sharded by rows are not supported: exclude the layer with `exclude`, or shard it with "
        "fully_shard only."
    )


@pytest.mark.parametrize(
    ("layer", "placements", "shown"),
    [
        ("lin", [Shard(1)], "(Shard(dim=1),)"),  # tensor parallelism: a row split over ranks
        ("emb", [Shard(0)], "(Shard(dim=0),)"),  # the weight is stored transposed: its dim 0 is not BNP's rows
        ("grouped", [Shard(0)], "(Shard(dim=0),)"),  # a grouped convolution's rows span groups
        ("lin", [Shard(0), Shard(0)], "(Shard(dim=0), Shard(dim=0))"),  # a 2-D mesh sharding the rows twice
    ],
    ids=["columns", "transposed", "grouped", "two-dims"],
)
def test_other_shardings_are_refused_naming_the_layer_and_placements(
    mesh: DeviceMesh, layer: str, placements: list[Any], shown: str
) -> None:
    net = make_net()
    pre = BNPPreconditioner(net, embeddings=True)
    run(net)
    use = mesh if len(placements) == 1 else DeviceMesh("cpu", [[0]])
    weight = net[layer].weight
    untouched = weight.grad.clone()
    weight.grad = distribute_tensor(weight.grad, use, placements)
    kind = type(net[layer]).__name__
    with pytest.raises(ValueError, match="^" + expected_refusal(layer, kind, shown) + "$"):
        pre.step()
    torch.testing.assert_close(weight.grad.full_tensor(), untouched, rtol=0, atol=0)


def test_a_two_dim_mesh_sharding_rows_once_is_transformed(mesh: DeviceMesh) -> None:
    plain_net, sharded_net = make_net(), make_net()
    plain, sharded = BNPPreconditioner(plain_net), BNPPreconditioner(sharded_net)
    run(plain_net)
    run(sharded_net)
    grad = sharded_net["lin"].weight.grad = distribute_tensor(
        sharded_net["lin"].weight.grad, DeviceMesh("cpu", [[0]]), [Shard(0), Replicate()]
    )
    plain.step()
    sharded.step()
    torch.testing.assert_close(grad.to_local(), plain_net["lin"].weight.grad, rtol=0, atol=0)


class Marked(torch.Tensor):
    """A tensor subclass without ``to_local``: not a DTensor."""


class WithLocal(torch.Tensor):
    """A tensor subclass with a ``to_local`` (a plain view of its storage) but no ``placements``: not sharded."""

    def to_local(self) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)


@pytest.mark.parametrize("subclass", [Marked, WithLocal])
def test_a_tensor_subclass_gradient_is_transformed_like_a_plain_one(subclass: type[torch.Tensor]) -> None:
    """Marked: transformed as it is; WithLocal: through its local tensor, in place (no placements: nothing sharded)."""
    torch.manual_seed(0)
    plain, marked = nn.Linear(3, 2), nn.Linear(3, 2)
    marked.load_state_dict(plain.state_dict())
    pre_plain, pre_marked = BNPPreconditioner(plain), BNPPreconditioner(marked)
    x = torch.randn(5, 3) + 1
    plain(x).sum().backward()
    marked(x).sum().backward()
    for p in marked.parameters():
        assert p.grad is not None
        p.grad = p.grad.as_subclass(subclass)
    pre_plain.step()
    pre_marked.step()
    for p, q in zip(plain.parameters(), marked.parameters()):
        assert type(q.grad) is subclass and p.grad is not None
        torch.testing.assert_close(q.grad.as_subclass(torch.Tensor), p.grad, rtol=0, atol=0)
    assert not torch.allclose(plain.bias.grad, torch.full((2,), 5.0))  # transformed: not the raw Σ of 5 ones


def make_attention() -> nn.Module:
    torch.manual_seed(0)
    return nn.MultiheadAttention(8, 2, batch_first=True)


@pytest.mark.parametrize("replicated", ["weight", "weight-and-bias"])
def test_replicated_dtensor_gradients_of_the_qkv_blocks_are_transformed_like_plain_ones(
    mesh: DeviceMesh, replicated: str
) -> None:
    """The q, k, v blocks of ``in_proj_weight`` (one weight, three layers with their own statistics) with replicated
    ``DTensor`` gradients: the same numbers as plain gradients. With a ``DTensor`` bias gradient the blocks are not
    grouped into one entry (its bias update would mix a ``DTensor`` with the plain statistics): each block is
    transformed through its own rows of the local tensor."""
    plain_net, sharded_net = make_attention(), make_attention()
    plain, sharded = BNPPreconditioner(plain_net), BNPPreconditioner(sharded_net)
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(1)) + 0.5
    for net in (plain_net, sharded_net):
        net(x, x, x)[0].square().mean().backward()
    names = ["in_proj_weight"] + (["in_proj_bias"] if replicated == "weight-and-bias" else [])
    dtensors = {}
    for name in names:
        p = getattr(sharded_net, name)
        p.grad = dtensors[name] = distribute_tensor(p.grad, mesh, [Replicate()])
    untouched = plain_net.in_proj_weight.grad.clone()
    plain.step()
    sharded.step()
    sharded_params = dict(sharded_net.named_parameters())
    for name, p in plain_net.named_parameters():
        got = sharded_params[name].grad
        assert isinstance(got, DTensor) == (name in names), name
        torch.testing.assert_close(got.to_local() if name in names else got, p.grad, msg=name)
    assert not torch.allclose(plain_net.in_proj_weight.grad, untouched)  # transformed
