"""What ``GraphedTrainingStep`` refuses, by name, before it needs a CUDA device (its replays are tested on a GPU:
``test_cuda_graph.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_bnp.core import GraphedTrainingStep


def test_an_optimizer_that_is_not_capturable_is_refused_by_name() -> None:
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error of a machine without CUDA")
def test_without_cuda_it_says_so() -> None:
    opt = torch.optim.SGD(nn.Linear(3, 2).parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match=r"needs a CUDA device"):
        GraphedTrainingStep(lambda: torch.zeros(()), opt)
