# Two commands do all the set-up on a fresh machine with Python ≥ 3.10 and pip:
#   make demo   – vanilla vs BatchNorm vs BNP on 5,000 bundled MNIST digits: summary table, PNG, TensorBoard logs
#   make test   – ruff, mypy and the pytest suite (in parallel over the cores: pytest-xdist; the 10 slowest tests last)
# Both create (or refresh, when pyproject.toml changes) the virtual environment in .venv.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test reproduce bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -e '.[dev,examples]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m example_projects.demo

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -p no:cacheprovider -n auto --dist worksteal --durations=10

# `make reproduce` regenerates benchmarks/RESULTS.md and benchmarks/results/*.png (about 75 min on
# 2 CPU cores); `make bench` runs it and then the other benchmarks, which write into benchmarks/out/.
reproduce: $(STAMP)
	$(BIN)/python -m benchmarks.reproduce

bench: reproduce
	$(BIN)/python -m benchmarks.overhead
	$(BIN)/python -m benchmarks.shipped_configs --max-epochs 20
	$(BIN)/python -m benchmarks.ddp_sync
	$(BIN)/python -m benchmarks.regularization
	$(BIN)/python -m benchmarks.weight_conditioning
	$(BIN)/python -m benchmarks.monitor_overhead

clean:
	rm -rf $(VENV) runs benchmarks/out .pytest_cache .mypy_cache .ruff_cache
