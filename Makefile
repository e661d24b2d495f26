# Two commands do all the set-up on a fresh machine:
#   make demo   -> trains a small Flax model with cocijax checkpoints (see README)
#   make test   -> ruff + the whole test suite (what CI runs)
# Each creates .venv on first use and installs what it needs (and reinstalls when
# pyproject.toml changes): `demo` the demo extra only, `test` the test set.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch: a looser requirement pulls a multi-GB CUDA build.
TORCH_CPU := torch==2.13.0

.PHONY: demo test lint bench chaos clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.demo: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e ".[demo]"
	touch $@

$(VENV)/.test: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet "$(TORCH_CPU)" -e ".[test]"
	touch $@

demo: $(VENV)/.demo
	$(BIN)/python examples/flax_train.py

lint: $(VENV)/.test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m pytest -n 2 --dist loadgroup $(PYTEST_ARGS)

# Prints the tables; `make bench BENCH_ARGS=--write` also records them in BENCHMARKS.md.
bench: $(VENV)/.test
	$(BIN)/python benchmarks/policy_bench.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/step_cost_bench.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/write_bench.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/restore_floor.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/tier_bench.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
