# Two commands for a new user: `make run` (the main job) and `make test` (lint + the suite).
# Each sets itself up on a fresh machine (virtual environment, install) and is idempotent.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# Local wheel folder (this fleet's dev/CI machines ship the CPU torch build there).
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
STAMP := $(VENV)/.installed

.PHONY: setup browser promtool run test lint bench bench-curves profile clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(FIND_LINKS) -e '.[dev]'
	@touch $(STAMP)

# Browser tests drive Debian's Chromium through Playwright (no browser download of its own).
CHROMIUM ?= $(or $(shell command -v chromium 2>/dev/null),/usr/bin/chromium)
browser:
	@if [ ! -x "$(CHROMIUM)" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing Debian's chromium for the browser tests"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else \
	    echo "chromium is missing: install it (Debian: sudo apt-get install chromium) or set CHROMIUM_PATH"; \
	  fi; \
	fi

# The alert rules' tests run Debian's promtool, and the dashboards' test its prometheus server: one
# package, prometheus (where systemd runs, the package also enables its server: systemctl disable
# --now prometheus if it is not wanted; the tests start their own on a free port).
promtool:
	@if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing Debian's prometheus for promtool and prometheus (the rules' and dashboards' tests)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; \
	  else \
	    echo "promtool or prometheus is missing: install them (Debian: sudo apt-get install prometheus)"; \
	  fi; \
	fi

setup: $(STAMP) browser promtool

# The whole stack on embedded defaults; options after ARGS=, e.g. make run ARGS="--instances 4 --rate 10"
run: $(STAMP)
	$(PY) -m workers.stack $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: $(STAMP) browser promtool
	$(VENV)/bin/ruff check .
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) -m relay_engine.bench $(ARGS)

bench-curves: $(STAMP)
	$(PY) -m relay_engine.lab.bench.curves $(ARGS)

profile: $(STAMP)
	$(PY) -m relay_engine.profile

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis artifacts
