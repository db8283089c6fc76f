# Every target creates what it needs on a fresh clone.
# The first interpreter of that version that actually runs (a pyenv shim may not).
find_python = $(shell for p in python$(1) $$HOME/.pyenv/versions/$(1)*/bin/python$(1) /usr/bin/python$(1); do \
	$$p -c 'import sys; print(sys.executable)' 2>/dev/null && break; done)
PYTHON ?= $(call find_python,3.13)
PYTHON311 ?= $(call find_python,3.11)
VENV := .venv
VENV311 := .venv311
BIN := $(VENV)/bin

.DEFAULT_GOAL := help
.PHONY: help install run test test-py311 lint format schema migrate bench-migration

help: ## List the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON)" || { echo "python3.13 not found: set PYTHON=/path/to/python3.13"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,embedded]'
	touch $@

install: $(VENV)/.installed ## Create .venv with the service and its development tools

run: $(VENV)/.installed ## Serve the API (embedded database unless MONGODB_URI is set)
	$(BIN)/python -m app

lint: $(VENV)/.installed ## Ruff (lint and format check) and mypy (strict on app/)
	$(BIN)/ruff check app migrations tests scripts
	$(BIN)/ruff format --check app migrations tests scripts
	$(BIN)/mypy

test: lint ## Lint, type-check and run every test (each storage test on every backend)
	$(BIN)/pytest

$(VENV311)/.installed: pyproject.toml
	@test -n "$(PYTHON311)" || { echo "python3.11 not found: set PYTHON311=/path/to/python3.11"; exit 1; }
	$(PYTHON311) -m venv $(VENV311)
	$(VENV311)/bin/pip install --quiet --upgrade pip
	$(VENV311)/bin/pip install --quiet -e '.[dev]'
	touch $@

test-py311: $(VENV311)/.installed ## The fast suite (in-process backend) on Python 3.11
	$(VENV311)/bin/pytest -m "not wire"

format: $(VENV)/.installed ## Apply ruff's fixes and formatting
	$(BIN)/ruff check --fix app migrations tests scripts
	$(BIN)/ruff format app migrations tests scripts

schema: $(VENV)/.installed ## Regenerate the JSON Schemas in schemas/
	$(BIN)/python -m app.schema

migrate: $(VENV)/.installed ## Legacy-turns migration: make migrate ARGS="run --dry-run" (default: status)
	$(BIN)/python -m migrations $(or $(ARGS),status)

bench-migration: $(VENV)/.installed ## Migration turns/s and peak RSS for two corpus sizes (a few minutes)
	$(BIN)/python scripts/bench_migration.py $(ARGS)
