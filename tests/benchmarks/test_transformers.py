"""``benchmarks.transformers`` (RESULTS.md §7): the ``--quick`` run end to end, its data cache, and the rules its
verdicts rest on."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from benchmarks.transformers import data as bench_data
from benchmarks.transformers import report
from benchmarks.transformers.main import jobs_of, train_all
from benchmarks.transformers.runs import CHANCE, SETTINGS, Job, Run, Setting, lm_windows, train
from example_projects.transformers import torch_corpus
from tests.warm_python import run_python

ROOT = Path(__file__).resolve().parents[2]


def _command(out: Path, cache: Path, *extra: str) -> list[str]:
    quick = ["--quick", "--jobs", "2", "--out", str(out), "--data-cache", str(cache)]
    return ["-m", "benchmarks.transformers", *quick, *extra]


@pytest.mark.slow
def test_quick_run_splices_section_7_into_results(tmp_path: Path) -> None:
    existing = "# Report\n\n## 6. Earlier section\n\nkept\n\n---\nTraining runs: 1.\n"
    (tmp_path / "RESULTS.md").write_text(existing)
    cache = tmp_path / "data.pt"
    proc = run_python(*_command(tmp_path, cache))
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (tmp_path / "RESULTS.md").read_text()
    assert text.startswith("# Report\n\n## 6. Earlier section\n\nkept\n\n## 7. Transformers")
    assert text.rstrip().endswith("---\nTraining runs: 1.")
    assert "QUICK MODE" in text and "--device cpu --jobs 2" in text
    assert text.count("reproduced**") == 5  # 3 ViT claims, 2 LM claims
    for variant in ("| none+BNP |", "| LN+BNP |", "| SGD+BNP |", "| Adam+BNP |"):
        assert variant in text
    assert "ratio char-LM, batch 8: SGD+BNP / SGD step time" in proc.stdout
    assert (tmp_path / "results" / "transformers.png").stat().st_size < 150_000
    assert cache.is_file()
    # the section alone again, from the saved runs: the same text
    again = run_python(*_command(tmp_path, cache, "--rerender"), timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (tmp_path / "RESULTS.md").read_text() == text


def test_bad_arguments_name_the_option() -> None:
    proc = run_python("-m", "benchmarks.transformers", "--jobs", "0")
    assert proc.returncode == 2
    assert "--jobs must be a positive integer, got 0" in proc.stderr


def test_data_cache_gives_back_the_same_data(tmp_path: Path) -> None:
    from example_projects.mnist5k import load_mnist5k_splits

    cache = tmp_path / "data.pt"
    written = bench_data.prepare(cache)
    assert cache.is_file()
    bench_data.load.cache_clear()
    loaded = bench_data.load(str(cache))
    for split, (x, y) in load_mnist5k_splits().items():
        assert torch.equal(loaded["digits"][split][0], x)  # bit for bit: uint8 ÷ 255 is the loader's own division
        assert torch.equal(loaded["digits"][split][1], y)
    text = torch_corpus()
    assert written["corpus"] == text and len(text) == 2_000_000
    ids = torch.cat([loaded["corpus"][s] for s in ("train", "val", "test")])
    assert bytes(ids.to(torch.uint8).tolist()) == text  # 90 / 5 / 5 in order, nothing lost
    assert [len(loaded["corpus"][s]) for s in ("train", "val", "test")] == [1_800_000, 100_000, 100_000]
    (tmp_path / "other.pt").write_bytes(b"not a cache")
    with pytest.raises(ValueError, match=r"other\.pt' cannot be read"):
        bench_data.prepare(tmp_path / "other.pt")
    torch.save({"format": 0}, tmp_path / "old.pt")
    with pytest.raises(ValueError, match="is not a data file of this benchmark"):
        bench_data.prepare(tmp_path / "old.pt")


def test_lm_windows_are_consecutive_non_overlapping_slices() -> None:
    ids = torch.arange(20)
    w = lm_windows(ids, context=4, limit=0)
    assert w.tolist() == [[0, 1, 2, 3, 4], [4, 5, 6, 7, 8], [8, 9, 10, 11, 12], [12, 13, 14, 15, 16]]
    assert lm_windows(ids, context=4, limit=2).tolist() == w[:2].tolist()


def _run(val: float, test: float, diverged: bool = False) -> Run:
    return Run(steps=[0, 5, 10], val=[val, val, val], test=[test, test, test], loss=[1.0, 1.0, 1.0], diverged=diverged)


LM = Setting("lm", 32, 10, (("SGD", (0.1, 1.0)), ("SGD+BNP", (0.1, 1.0)), ("Adam", (1e-3,)), ("Adam+BNP", (1e-3,))), 1)
VIT = Setting("vit", 60, 10, (("none", (0.1, 1.0)),), 1)


def _results(s: Setting, table: dict[tuple[str, float], Run]) -> dict[Job, Run]:
    return {Job.of(s, v, lr, 0, "cpu", None): run for (v, lr), run in table.items()}


def test_rates_are_chosen_on_validation_lower_loss_for_the_lm() -> None:
    vit = _results(VIT, {("none", 0.1): _run(val=0.9, test=0.5), ("none", 1.0): _run(val=0.8, test=0.99)})
    c = report.choose(VIT, "none", vit, "cpu", None)
    assert (c.lr, c.final, c.edge) == (0.1, [0.5], True)
    # the LM's metric is a loss: the smaller validation loss wins, whatever the test loss
    lm = _results(LM, {("SGD", 0.1): _run(val=2.0, test=3.0), ("SGD", 1.0): _run(val=2.5, test=1.0)})
    assert report.choose(LM, "SGD", lm, "cpu", None).lr == 0.1
    # a diverged run scores chance (the uniform guess's ln 256), worse than any trained loss
    lm[Job.of(LM, "SGD", 0.1, 0, "cpu", None)] = _run(val=2.0, test=2.0, diverged=True)
    c = report.choose(LM, "SGD", lm, "cpu", None)
    assert c.lr == 1.0 and c.diverged == {0.1: 1, 1.0: 0} and c.largest_trained(lm, "cpu", None) == 1.0
    assert report.score(LM, [_run(val=9.0, test=9.0, diverged=True)]) == -CHANCE["lm"] == -math.log(256)


def _lm_verdicts(sgd: float, bnp: float, adam: float, sgd_at_1: str = "trains") -> list[str]:
    """The LM verdicts for these final losses (each variant's rate: the grid's smallest); SGD at rate 1.0 trains,
    ``"diverges"`` or is ``"broken"`` (finite training loss, final validation loss worse than ln 256)."""
    loss = {"SGD": sgd, "SGD+BNP": bnp, "Adam": adam, "Adam+BNP": adam}
    table = {(v, lr): _run(loss[v], loss[v]) for v in LM.variants for lr in LM.lrs(v)}
    if sgd_at_1 == "diverges":
        table[("SGD", 1.0)] = _run(5.0, 5.0, diverged=True)
    elif sgd_at_1 == "broken":
        table[("SGD", 1.0)] = _run(18.0, 18.0)
    results = _results(LM, table)
    cs = {}
    for v in LM.variants:
        lr = LM.lrs(v)[0]
        runs = report.runs_of(results, LM, v, lr, "cpu", None)
        grid = {x: -loss[v] for x in LM.lrs(v)}
        diverged = {x: sum(r.diverged for r in report.runs_of(results, LM, v, x, "cpu", None)) for x in LM.lrs(v)}
        cs[v] = report.Choice(LM, v, lr, runs, grid, diverged)
    return report.lm_verdicts(LM, cs, results, "cpu", None)


def test_lm_gap_verdict_follows_the_half_gap_rule() -> None:
    # the issue's own figures: (2.51 − 2.29) / (2.51 − 2.18) = 67% of the gap
    lines = _lm_verdicts(2.51, 2.29, 2.18, sgd_at_1="diverges")
    assert "**reproduced** — it closes 67% of it" in lines[0]
    assert (
        "every seed trained (none diverged, final validation loss below the uniform guess's ln 256): SGD 0.1, "
        in (lines[1])
    )
    assert "SGD + BNP 1.0 (diverged seeds per rate: SGD {1.0: 1}, SGD + BNP none)" in lines[1]
    assert lines[1].startswith("- SGD + BNP trains at a rate where plain SGD does not (expected at 0.3, where SGD ")
    assert "**reproduced**" in lines[1]
    # a finite but broken run (validation loss above ln 256) has not trained either
    assert "SGD 0.1, SGD + BNP 1.0" in _lm_verdicts(2.51, 2.29, 2.18, sgd_at_1="broken")[1]
    assert "**partly reproduced** — it closes 18% of it" in _lm_verdicts(2.51, 2.45, 2.18)[0]
    assert "**not reproduced** — it closes -27% of it" in _lm_verdicts(2.51, 2.6, 2.18)[0]
    assert "there is no gap to close" in _lm_verdicts(2.1, 2.0, 2.18)[0]
    # SGD trains at every rate: BNP cannot be said to train where SGD does not
    assert "(expected at 0.3, where SGD diverged): **not reproduced**" in _lm_verdicts(2.51, 2.29, 2.18)[1]


def test_compare_uses_one_point_and_two_hundredths_of_a_nat() -> None:
    def c(s: Setting, value: float) -> report.Choice:
        return report.Choice(s, s.variants[0], 0.1, [_run(value, value)], {}, {})

    assert report.compare(VIT, c(VIT, 0.945), c(VIT, 0.94)) == 0
    assert report.compare(VIT, c(VIT, 0.95), c(VIT, 0.93)) == 1
    assert report.compare(LM, c(LM, 2.30), c(LM, 2.31)) == 0
    assert report.compare(LM, c(LM, 2.30), c(LM, 2.33)) == 1  # lower loss is ahead
    assert report.compare(LM, c(LM, 2.36), c(LM, 2.33)) == -1


def test_a_short_run_records_every_evaluation_and_learns() -> None:
    s = next(x for x in SETTINGS if x.task == "lm")
    job = Job("lm", "SGD+BNP", 8, 0.3, 0, 20, 4, 8, "cpu", None)
    run = train(job)
    assert run.steps == [0, 5, 10, 15, 20] and len(run.val) == len(run.test) == len(run.loss) == 5
    assert not run.diverged
    assert run.val[0] > math.log(256) - 0.2  # untrained: no better than the uniform guess
    assert run.val[-1] < run.val[0] - 0.5
    assert s.batch == 32 and s.lrs("SGD+BNP")[2] == 0.3  # the set-up and its rate are in the grid


def test_the_full_report_keeps_section_7() -> None:
    """``benchmarks.reproduce`` rewrites RESULTS.md whole; §7 (generated on its own machine) is carried over."""
    old = "# R\n\n## 6. Six\n\nold six\n\n## 7. Transformers: x\n\n### ViT\n\n| t |\n\n---\nTraining runs: 1.\n"
    new = "# R\n\n## 6. Six\n\nnew six\n\n---\nTraining runs: 2.\n"
    kept = report.extract(old)
    assert kept == ["## 7. Transformers: x", "", "### ViT", "", "| t |"]
    assert report.splice(new, kept) == (
        "# R\n\n## 6. Six\n\nnew six\n\n## 7. Transformers: x\n\n### ViT\n\n| t |\n\n---\nTraining runs: 2.\n"
    )
    assert report.extract(new) == []


def test_no_run_starts_after_the_deadline() -> None:
    lm = next(x for x in SETTINGS if x.task == "lm")
    jobs = jobs_of([lm], "cpu", None)
    assert len(jobs) == 3 * (5 + 5 + 4 + 4)  # 3 seeds of every (variant, rate), each once
    assert train_all(jobs, 1, deadline_s=0.0) == {}
