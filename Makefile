# `make train` and `make test` set up .venv on first use, then run.
# Extra arguments: make train ARGS="trainer.max_epochs=3 model.num_heads=8"
#                  make test PYTEST_ARGS="-k attention"

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=
PYTEST_ARGS ?=
# Tests run in this many worker processes (pytest-xdist), an idle worker taking tests
# queued for the other (worksteal: 156 s against 170 s for one file to a worker, 2-core
# Zen 5); most of the suite's time is single-threaded (process start-up, compilers,
# subprocesses), and a third worker on 2 cores was slower (170 s against 143 s).
PYTEST_WORKERS ?= 2

.PHONY: setup train eval test lint clean

# Re-installs when pyproject.toml changes. torch and torchvision are unpinned so pip
# picks a matching pair (shared/GUIDE.md section 3).
$(VENV)/.installed: pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --editable '.[dev]'
	@touch $@

setup: $(VENV)/.installed

train: setup
	$(BIN)/python train.py $(ARGS)

eval: setup
	$(BIN)/python eval.py $(ARGS)

test: setup
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
