"""``python -c CODE`` and ``python -m MODULE ARGS`` in a new process without the seconds a new interpreter spends
importing torch and Lightning (~6 s each on the CI machine, most of a docs snippet's or a DDP test's time).

A server process (one per pytest worker, started at the first run) imports torch and Lightning and nothing more — no
tensor op, so no thread pool and no CUDA context exists yet — and then forks a child per run. The child is a process of
its own as ``python`` would start it: its own working directory, environment, ``sys.argv``, ``__main__`` module and
session (a timeout kills it and every process it started); its output goes to files the caller reads; it ends as an
interpreter ends (non-daemon threads joined, ``atexit`` handlers run) with the command's exit status. Only the imports
are shared, as they were before any code ran.

Where CUDA is available a fresh interpreter runs instead (a CUDA driver that was initialised before a fork cannot be
used after it, and Lightning asks whether CUDA is available when it is imported).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# what every run imports and pays for; not lightning_bnp: a docs snippet that forgot to import it, or a CLI whose short
# callback names resolve only once it is imported, must fail as it would for a user
PRELOAD = ("torch", "lightning", "lightning.pytorch")


def _child(request: dict[str, Any]) -> int:
    """Run one request in this (forked) process as ``python`` would; returns the exit status."""
    import random
    import runpy
    import traceback
    import types

    os.setsid()  # its own session: a timeout kills it and the ranks it launched together
    written = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    for fd, path, flags in (
        (0, os.devnull, os.O_RDONLY),
        (1, request["stdout"], written),
        (2, request["stderr"], written),
    ):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    random.seed()  # a new interpreter's random state is its own
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    argv = request["argv"]
    try:
        if argv[0] == "-c":
            sys.argv, sys.path[0] = ["-c", *argv[2:]], ""
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            assert argv[0] == "-m", argv
            sys.argv, sys.path[0] = [argv[1], *argv[2:]], os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1


def serve() -> int:
    """The server's loop: a JSON request per line on stdin; answers the child's pid, then its exit status. Returns in
    a forked child (with the status it is to exit with), or when the client closed the pipe."""
    for name in PRELOAD:
        __import__(name)
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    print("ready", file=answers)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            answers.close()
            return _child(request)
        print(pid, file=answers)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), file=answers)
    return 0


class WarmPython:
    """The client: :meth:`run` is ``subprocess.run([sys.executable, *argv], cwd=, env=, capture_output=True,
    text=True, timeout=)`` through the server."""

    def __init__(self) -> None:
        self.server: subprocess.Popen[str] | None = None

    def _start(self) -> subprocess.Popen[str]:
        if self.server is None or self.server.poll() is not None:
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            self.server = subprocess.Popen(
                [sys.executable, "-m", "tests.warm_python"],
                cwd=ROOT,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            atexit.register(self.server.kill)
            assert self._answer(120.0) == "ready"
        return self.server

    def _answer(self, timeout: float) -> str:
        assert self.server is not None and self.server.stdout is not None
        ready, _, _ = select.select([self.server.stdout], [], [], timeout)
        if not ready:
            raise subprocess.TimeoutExpired("warm python", timeout)
        line = self.server.stdout.readline()
        if not line:
            raise RuntimeError("the warm python server ended")
        return line.strip()

    def run(
        self, argv: list[str], *, cwd: str | Path, env: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess[str]:
        if _cuda_available():
            return subprocess.run(
                [sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
            )
        server = self._start()
        assert server.stdin is not None
        with tempfile.TemporaryDirectory() as folder:
            out, err = os.path.join(folder, "out"), os.path.join(folder, "err")
            request = {"argv": argv, "cwd": str(cwd), "env": env, "stdout": out, "stderr": err}
            server.stdin.write(json.dumps(request) + "\n")
            server.stdin.flush()
            pid = int(self._answer(120.0))
            try:
                status = int(self._answer(timeout))
            except subprocess.TimeoutExpired:
                os.killpg(pid, signal.SIGKILL)
                self._answer(60.0)
                raise
            return subprocess.CompletedProcess(
                [sys.executable, *argv], status, Path(out).read_text(), Path(err).read_text()
            )


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


_warm = WarmPython()


def run_python(
    *argv: str, cwd: str | Path = ROOT, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """``python *argv`` (``-c CODE`` or ``-m MODULE ARGS``) in a new process of a warm interpreter, its output
    captured as text; ``env`` by default this process's with the repository on ``PYTHONPATH``."""
    return _warm.run(list(argv), cwd=cwd, env=env or {**os.environ, "PYTHONPATH": str(ROOT)}, timeout=timeout)


def _exit(status: int) -> None:
    """End a child as an interpreter ends — non-daemon threads joined, ``atexit`` handlers run, output flushed — but
    without tearing down the modules the server imported (~1.5 s that nothing a run does depends on)."""
    import threading

    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(status)


if __name__ == "__main__":
    _exit(serve())
