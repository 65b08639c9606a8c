"""Benchmarks of lightning_bnp: scripts that run the compared variants side by side and write tables and plots."""

from __future__ import annotations

import multiprocessing
from multiprocessing.context import BaseContext

__all__ = ["worker_processes"]


def worker_processes(preload: str, *, cuda: bool = False) -> BaseContext:
    """How a benchmark starts its worker processes: forked from a fork server where the platform has one, else
    spawned; never forked from the calling process, whose torch thread pools may be running. The fork server is one
    new interpreter that imports ``preload`` (the module of the workers' task: torch, Lightning, the benchmark) once;
    every worker forked from it starts in milliseconds instead of the ~6 s a new interpreter spends on those imports.
    Workers that use CUDA (``cuda``) are spawned: importing Lightning asks the driver for its devices, and a driver
    initialised before a fork cannot be used after it.
    """
    if cuda or "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([preload])
    return context
