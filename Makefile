# Two commands for a new user: `make run` (the main job) and `make test` (lint + the suite).
# Each sets itself up on a fresh machine (virtual environment, install) and is idempotent.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# Local wheel folder (this fleet's dev/CI machines ship the CPU torch build there).
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
STAMP := $(VENV)/.installed

.PHONY: setup run test lint bench profile clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(FIND_LINKS) -e '.[dev]'
	@touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(PY) -m relay_engine.profile

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) -m relay_engine.bench

profile: $(STAMP)
	$(PY) -m relay_engine.profile

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis artifacts
