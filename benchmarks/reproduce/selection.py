"""Learning-rate choice on the validation split, and the summaries the report is built from."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.reproduce.runs import CHANCE, Job, Run, runs_of
from benchmarks.reproduce.settings import Setting


def mean(values: Sequence[float]) -> float:
    """Mean of the finite values (``nan`` if there are none)."""
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def score(runs: list[Run]) -> float:
    """Selection score: validation accuracy averaged over the last 3 evaluation points and the seeds;
    a diverged run scores chance."""
    return mean([mean(r.val[-3:]) if not r.diverged else CHANCE for r in runs])


def steps_to(run: Run, target: float) -> int | None:
    """The first evaluated step at which the test accuracy reaches ``target``."""
    return next((s for s, a in zip(run.steps, run.test) if a >= target), None)


@dataclass
class Choice:
    """A method's chosen learning rate in a setting, with its runs and the whole grid's scores."""

    setting: Setting
    method: str
    lr: float
    runs: list[Run]
    grid: dict[float, float]  # lr -> selection score
    diverged: dict[float, int]  # lr -> diverged seeds

    @property
    def edge(self) -> bool:
        return len(self.setting.lrs) > 1 and self.lr in (self.setting.lrs[0], self.setting.lrs[-1])

    @property
    def final(self) -> list[float]:
        return [r.final for r in self.runs]

    def reached(self) -> list[int]:
        return [s for r in self.runs if (s := steps_to(r, self.setting.target)) is not None]

    def speed(self) -> float:
        """Mean steps to the target; runs that never reach it count as the run's length."""
        total = self.runs[0].steps[-1]
        reached = [steps_to(r, self.setting.target) for r in self.runs]
        return mean([float(total if s is None else s) for s in reached])


def choose(s: Setting, method: str, results: dict[Job, Run]) -> Choice:
    """The learning rate of ``s.lrs`` with the best validation :func:`score` (ties: the smaller rate)."""
    by_lr = {lr: runs_of(results, s, method, lr) for lr in s.lrs}
    grid = {lr: score(runs) for lr, runs in by_lr.items()}
    diverged = {lr: sum(r.diverged for r in runs) for lr, runs in by_lr.items()}
    best = max(s.lrs, key=lambda lr: (grid[lr], -lr))
    return Choice(s, method, best, by_lr[best], grid, diverged)


def fmt_range(values: Sequence[float], scale: float = 100.0, spec: str = ".1f") -> str:
    """``mean [min–max]`` of ``values × scale`` (finite values only)."""
    v = [x * scale for x in values if math.isfinite(x)]
    return f"{mean(v):{spec}} [{min(v):{spec}}–{max(v):{spec}}]" if v else "–"


def fmt_steps(c: Choice) -> str:
    reached = c.reached()
    if not reached:
        return f"never (0/{len(c.runs)})"
    text = f"{statistics.mean(reached):.0f} [{min(reached)}–{max(reached)}]"
    return text if len(reached) == len(c.runs) else f"{text} ({len(reached)}/{len(c.runs)} reached)"


def verdict(ok: bool | None) -> str:
    return {True: "**reproduced**", False: "**not reproduced**", None: "**partly reproduced**"}[ok]
