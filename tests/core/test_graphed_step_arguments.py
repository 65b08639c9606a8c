"""What ``GraphedTrainingStep`` refuses, by name, on any machine: a machine without CUDA first, then arguments that
no CUDA graph can replay (its replays are tested on a GPU: ``test_cuda_graph.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_bnp.core import GraphedTrainingStep


def test_an_optimizer_that_is_not_capturable_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # refused before any CUDA work, on any machine
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam([{"params": [model.bias]}, {"params": [model.weight], "capturable": False}])
    opt.param_groups[0]["capturable"] = True
    with pytest.raises(ValueError, match=r"`optimizer` \(Adam\) has capturable=False in param group 1"):
        GraphedTrainingStep(lambda: torch.zeros(()), opt)


@pytest.mark.parametrize("warmup", [0, -1, 1.5, True, "3"])
def test_warmup_steps_must_be_a_positive_int(warmup: object) -> None:
    opt = torch.optim.SGD(nn.Linear(3, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"`warmup_steps` must be an int ≥ 1.*got " + repr(warmup).replace(".", r"\.")):
        GraphedTrainingStep(lambda: torch.zeros(()), opt, warmup_steps=warmup)  # type: ignore[arg-type]


@pytest.mark.parametrize("capturable", [None, False, True])
def test_without_cuda_it_says_so_before_the_optimizers_options(
    monkeypatch: pytest.MonkeyPatch, capturable: bool | None
) -> None:
    """Issue 45 item 8: without CUDA, an Adam with capturable=False was told to set capturable=True first."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without CUDA, on any machine
    model = nn.Linear(3, 2)
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.1)
        if capturable is None
        else torch.optim.Adam(model.parameters(), capturable=capturable)
    )
    with pytest.raises(RuntimeError) as raised:
        GraphedTrainingStep(lambda: torch.zeros(()), opt)
    assert str(raised.value) == (
        "GraphedTrainingStep needs a CUDA device (torch.cuda.is_available() is False): a CUDA graph captures CUDA "
        "kernels. Without one, run the step eagerly: loss.backward(); pre.step(optimizer); optimizer.step()"
    )
