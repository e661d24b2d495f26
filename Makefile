# Two commands do all the set-up on a fresh machine:
#   make demo   -> trains a small Flax model with cocijax checkpoints (see README)
#   make test   -> ruff + the whole test suite
# Both create .venv on first use and reinstall when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/flax_train.py

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m pytest -n 2 --dist loadgroup $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/policy_bench.py
	$(BIN)/python benchmarks/write_bench.py
	$(BIN)/python benchmarks/restore_floor.py

clean:
	rm -rf $(VENV) .pytest_cache
