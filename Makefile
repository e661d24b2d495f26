# Two commands do all the set-up on a fresh machine:
#   make demo   -> trains a small Flax model with cocijax checkpoints (see README)
#   make test   -> ruff + the test suite but its long tests (what CI runs), the docs' snippets and site included
#   make test-long -> the long tests only (marked `long`: fault sweeps, end-to-end runs)
#   make docs   -> the documentation site, strictly (a warning or a broken link fails), into docs/_build/html
# Each creates .venv on first use and installs what it needs (and reinstalls when
# pyproject.toml changes): `demo` the demo extra only, `docs` the docs extra, `test` the test set.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch: a looser requirement pulls a multi-GB CUDA build.
TORCH_CPU := torch==2.13.0

.PHONY: demo test test-long docs lint systools bench chaos clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.demo: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e ".[demo]"
	touch $@

$(VENV)/.test: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet "$(TORCH_CPU)" -e ".[test]"
	touch $@

$(VENV)/.docs: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet "$(TORCH_CPU)" -e ".[docs]"
	touch $@

demo: $(VENV)/.demo
	$(BIN)/python examples/flax_train.py

# tests/test_docs.py runs the same build under `make test`.
docs: $(VENV)/.docs
	$(BIN)/python -m sphinx -W --keep-going -q -b html -c docs . docs/_build/html

lint: $(VENV)/.test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# System tools of the reliability tests: strace records the file-system operations of a save
# (power-loss crash states), fiu-utils injects I/O errors (libfiu). Installed when this runs as
# root with apt-get; elsewhere the tests that need them skip, saying why (CI runs as root).
SYSTOOLS := strace fiu-run
SYSTOOLS_DEB := strace fiu-utils

systools:
	@missing=""; for t in $(SYSTOOLS); do command -v $$t >/dev/null || missing="$$missing $$t"; done; \
	if [ -z "$$missing" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "systools: running apt-get update and apt-get install $(SYSTOOLS_DEB) as root (missing:$$missing):"; \
	  echo "  the power-loss and I/O-error tests need them (install them beforehand, or run as non-root to skip those tests)"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(SYSTOOLS_DEB) >/dev/null; } \
	    || echo "apt-get could not install $(SYSTOOLS_DEB): the tests that need them will skip (and fail under CI)"; \
	else \
	  echo "missing:$$missing; not root or no apt-get, so not installed: the power-loss and I/O-error tests will skip"; \
	fi

test: lint systools
	$(BIN)/python -m pytest -n 2 --dist loadgroup -m "not long" --durations=25 $(PYTEST_ARGS)

# The tests `test` leaves out (`@pytest.mark.long`): the larger shares of the fault sweeps and
# the end-to-end runs. Same set-up as `test`.
test-long: $(VENV)/.test systools
	$(BIN)/python -m pytest -n 2 --dist loadgroup -m long $(PYTEST_ARGS)

# Prints the tables; `make bench BENCH_ARGS=--write` also records them in BENCHMARKS.md.
bench: $(VENV)/.test
	$(BIN)/python benchmarks/policy_bench.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/step_cost_bench.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/write_bench.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/restore_floor.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/resume_bench.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/tier_bench.py $(BENCH_ARGS)
	$(BIN)/python benchmarks/retention_bench.py $(BENCH_ARGS)

# The live chaos benchmark (half an hour; `make chaos CHAOS_ARGS=--quick`: five minutes), restarts
# loading compiled programs from JAX's persistent cache as a job that restarts often should. Not
# part of `bench`: it needs the machine to itself for that long.
chaos: $(VENV)/.test
	$(BIN)/python benchmarks/chaos_bench.py --compile-cache $(CHAOS_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache docs/_build
