"""Shared fixtures."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)
    # LIGHTNING_BNP_TEST_ACCELERATOR=cuda (tests/helpers.py): fp32 means fp32 where tests compare numbers
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
