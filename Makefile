# Two commands do all the set-up on a fresh machine with Python ≥ 3.10 and pip:
#   make demo   – vanilla vs BatchNorm vs BNP on 5,000 bundled MNIST digits: summary table, PNG, TensorBoard logs
#   make test   – ruff, mypy, the import layering and circles (lint-imports) and the pytest suite (in parallel over the
#                 cores: pytest-xdist; the 10 slowest tests last), which also runs `make docs` and builds, checks and
#                 installs the wheel (tests/test_docs.py, test_wheel.py)
# `make docs` builds the documentation site into docs/_build/html (Sphinx, strict: any warning fails).
# Both create (or refresh, when pyproject.toml changes) the virtual environment in .venv.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test docs reproduce bench mutate clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -e '.[dev,examples]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m example_projects.demo

# mypy (one process, ~30 s from a fresh clone) runs beside the suite, whose waits on its subprocesses leave a core
# idle; its report follows the suite's, and either failing fails the target
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy > $(VENV)/mypy.log 2>&1 & mypy=$$!; \
	$(BIN)/python -m pytest -p no:cacheprovider -n auto --dist worksteal --durations=10; suite=$$?; \
	wait $$mypy; typed=$$?; cat $(VENV)/mypy.log; \
	[ $$suite -eq 0 ] && [ $$typed -eq 0 ]

# `make reproduce` regenerates benchmarks/RESULTS.md and benchmarks/results/*.png (about 75 min on
# 2 CPU cores); `make bench` runs it and then the other benchmarks, which write into benchmarks/out/.
DOCS_OUT ?= docs/_build/html
docs: $(STAMP)
	$(BIN)/python -m sphinx -b html -n -W --keep-going -q -d $(dir $(DOCS_OUT))doctrees docs $(DOCS_OUT)

reproduce: $(STAMP)
	$(BIN)/python -m benchmarks.reproduce

bench: reproduce
	$(BIN)/python -m benchmarks.overhead
	$(BIN)/python -m benchmarks.shipped_configs --max-epochs 20
	$(BIN)/python -m benchmarks.ddp_sync
	$(BIN)/python -m benchmarks.regularization
	$(BIN)/python -m benchmarks.weight_conditioning
	$(BIN)/python -m benchmarks.monitor_overhead

# `make mutate` – mutation testing of lightning_bnp/core and lightning_bnp/callbacks with mutmut (settings:
# [tool.mutmut] in pyproject.toml). Each mutant runs against the fast unit tests that call the function it
# changes (tests/core and tests/callbacks without the slow, DDP and torch.compile tests). Not in CI: hours on
# 2 cores. It resumes: mutants with a result are not run again, unless MUTATE names their modules, e.g.
#   make mutate MUTATE=lightning_bnp.core.statistics MUTATE_JOBS=1
# `$(BIN)/mutmut results` lists the survivors, `$(BIN)/mutmut show NAME` shows one; tests/MUTANTS.md lists
# those argued equivalent.
MUTATE ?=
MUTATE_JOBS ?= 2
mutate: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/mutmut run --max-children $(MUTATE_JOBS) $(foreach m,$(MUTATE),'$(m).*')
	$(BIN)/mutmut results

clean:
	rm -rf $(VENV) runs benchmarks/out .pytest_cache .mypy_cache .ruff_cache mutants docs/_build build dist
