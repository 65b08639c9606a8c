"""``precision="64-true"`` through the callback equals the core in float64 on the same steps (issue 37, item 8):
the state BNP makes at setup, while the model is still float32, follows the cast without passing through float32."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_bnp import BatchNormPreconditioning, BNPPreconditioner
from tests.helpers import BoringClassifier, _fit, make_data, make_mlp

STEPS, BATCH = 4, 16
FLOAT64 = {"rtol": 1e-12, "atol": 1e-12}


def test_64_true_equals_the_core_in_float64(tmp_path: Path) -> None:
    data = make_data()
    bnp = BatchNormPreconditioning()
    model = BoringClassifier(make_mlp())
    _fit(tmp_path, model, data, batch_size=BATCH, callbacks=[bnp], max_steps=STEPS, precision="64-true")
    reference = make_mlp().double()
    pre = BNPPreconditioner(reference)
    opt = torch.optim.SGD(reference.parameters(), lr=model.lr)
    x64, y = data.tensors[0].double(), data.tensors[1]
    for x, target in list(DataLoader(TensorDataset(x64, y), batch_size=BATCH))[:STEPS]:
        opt.zero_grad()
        nn.functional.cross_entropy(reference(x), target).backward()
        pre.step()
        opt.step()
    assert bnp.preconditioner is not None
    for name, layer in pre.layers.items():
        ours = bnp.preconditioner.layers[f"network.{name}"].running
        assert ours.mu.dtype == torch.float64
        torch.testing.assert_close(ours.mu.cpu(), layer.running.mu, **FLOAT64)
        torch.testing.assert_close(ours.var.cpu(), layer.running.var, **FLOAT64)
        torch.testing.assert_close(ours.decay.cpu(), layer.running.decay, rtol=0, atol=0)
    for (name, p), q in zip(model.network.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), msg=name, **FLOAT64)
