"""Run a DDP worker module (``python -m tests.ddp.<worker>``) and read back the per-rank state files it wrote
(``rank*.pt`` in ``out``).

A run on several devices is a new process (forked from a warm interpreter: ``tests/warm_python.py``; Lightning
launches the other ranks from it). A one-process reference
run (``--devices 1``, or ``--single``) runs in this process: the same ``main`` with the same arguments, without the
seconds a fresh interpreter spends importing torch and Lightning (issue 27: the suite's speed).
"""

from __future__ import annotations

import argparse
import importlib
import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.warm_python import run_python

ROOT = Path(__file__).resolve().parents[2]


def _one_process(args: tuple[str, ...]) -> bool:
    return "--single" in args or ("--devices" in args and args[args.index("--devices") + 1] == "1")


def run_worker(worker: str, out: Path, *args: str, cwd: Path = ROOT) -> list[dict[str, Any]]:
    """``cwd``: the working directory of the subprocess (where relative paths of the run resolve)."""
    argv = ["--out", str(out), *args]
    if _one_process(args):
        importlib.import_module(f"tests.ddp.{worker}").main(argv)
    else:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
        proc = run_python("-m", f"tests.ddp.{worker}", *argv, cwd=cwd, env=env, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [torch.load(path, weights_only=False) for path in sorted(out.glob("rank*.pt"))]


def _gloo_rank(rank: int, run: Callable[[int], dict[str, object]], init: str, out: Path) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        torch.save(run(rank), out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def spawn_two_gloo_ranks(run: Callable[[int], dict[str, object]]) -> None:
    """The ``main`` of a plain-torch 2-process worker: ``--out DIR``, two spawned ranks in a gloo group (file
    rendezvous), each saving ``run(rank)`` as ``DIR/rank{r}.pt``. ``run`` must be a module-level function."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    init = "file://" + os.path.join(tempfile.mkdtemp(), "rendezvous")
    mp.spawn(_gloo_rank, args=(run, init, args.out), nprocs=2, join=True)
