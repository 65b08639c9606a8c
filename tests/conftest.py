"""Shared fixtures."""

import os

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    # `make test` runs the suite in several pytest-xdist workers: share the cores between them instead of
    # giving each worker torch's default of one thread per core (2 workers × 2 threads on CI's 2 cores)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)
    # LIGHTNING_BNP_TEST_ACCELERATOR=cuda (tests/helpers.py): fp32 means fp32 where tests compare numbers
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
