# Two commands for a new machine: `make serve` (set up, then run pagedserve) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
# CI and CPU machines take the local CPU wheel; on a GPU box use e.g. `make serve TORCH=torch`.
TORCH ?= torch==2.13.0
ARGS ?=

.PHONY: setup serve test test-slow test-long lint bench

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.installed

serve: setup
	$(VENV)/bin/pagedserve up $(ARGS)

test: setup
	VENV=$(VENV) bash scripts/test.sh $(ARGS)

test-slow: setup
	VENV=$(VENV) bash scripts/test.sh -m slow $(ARGS)

test-long: setup
	VENV=$(VENV) bash scripts/test.sh -m long $(ARGS)

lint: setup
	$(VENV)/bin/ruff check .
