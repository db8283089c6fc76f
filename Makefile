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
.PHONY: help install run test test-motor test-py311 lint format schema types types-check types-compile \
	configuration bench index-sizes \
	test-api test-browser load migrate bench-migration bench-langgraph

help: ## List the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-16s %s\n", $$1, $$2}'

$(BIN)/python:
	@test -n "$(PYTHON)" || { echo "python3.13 not found: set PYTHON=/path/to/python3.13"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# The service and the embedded server only: what `make run` needs.
$(VENV)/.service-installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[service,embedded]'
	touch $@

# Everything: the service, every integration, the test and lint tools (a superset of the above).
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[dev,embedded]'
	touch $@ $(VENV)/.service-installed

install: $(VENV)/.installed ## Create .venv with the service and its development tools

run: $(VENV)/.service-installed ## Serve the API (embedded database unless MONGODB_URI is set); installs the service only
	$(BIN)/python -m app

CODE := agent_store app migrations tests scripts

lint: $(VENV)/.installed ## Ruff, mypy (strict) and the import-linter layering contract
	$(BIN)/ruff check $(CODE)
	$(BIN)/ruff format --check $(CODE)
	$(BIN)/mypy
	$(BIN)/lint-imports

# pytest-xdist: one worker per core, at most four; each has its own embedded wire server.
PARALLEL := -n auto --maxprocesses 4

test: lint types-check ## Lint, type-check and run every test (each storage test on mongomock and the embedded server)
	$(BIN)/pytest $(PARALLEL)

test-motor: $(VENV)/.installed ## Every storage test through a Motor client, as existing runtimes hold (CI runs it)
	MOTOR_MATRIX=all $(BIN)/pytest $(PARALLEL) -m motor

$(VENV311)/.installed: pyproject.toml
	@test -n "$(PYTHON311)" || { echo "python3.11 not found: set PYTHON311=/path/to/python3.11"; exit 1; }
	$(PYTHON311) -m venv $(VENV311)
	$(VENV311)/bin/pip install --quiet --upgrade pip
	$(VENV311)/bin/pip install --quiet -e '.[dev]'
	touch $@

# One socket of unknown origin, found unclosed by the garbage collector in 2 of 8 CI runs on
# 3.11 (never on 3.13; a socket tracker over whole runs found none): docs/TESTING.md.
test-py311: $(VENV311)/.installed ## The fast suite (in-process backend) on Python 3.11
	$(VENV311)/bin/pytest $(PARALLEL) -m "not wire" -W "ignore:unclosed <socket.socket:ResourceWarning"

format: $(VENV)/.installed ## Apply ruff's fixes and formatting
	$(BIN)/ruff check --fix $(CODE)
	$(BIN)/ruff format $(CODE)

schema: $(VENV)/.installed ## Regenerate the JSON Schemas in schemas/
	$(BIN)/python -m scripts.schema

configuration: $(VENV)/.installed ## Regenerate docs/CONFIGURATION.md from the settings class
	$(BIN)/python -m scripts.configuration

TS_DIR := clients/typescript

# npm ci writes node_modules/.package-lock.json: reinstall when the lock file changes.
$(TS_DIR)/node_modules/.package-lock.json: $(TS_DIR)/package.json $(TS_DIR)/package-lock.json
	@command -v node >/dev/null && command -v npm >/dev/null || { \
		echo "node and npm not found: install Node.js 20+ to check the TypeScript declarations"; exit 1; }
	cd $(TS_DIR) && npm ci --no-audit --no-fund
	touch $@

types: $(VENV)/.installed ## Regenerate clients/typescript/agent-message.d.ts from the models
	$(BIN)/python -m scripts.typescript

# Outside CI a machine without Node.js skips this check, saying so; in CI (CI set) it fails.
types-check: ## Compile the TypeScript example with tsc --strict (needs Node.js 20+ and npm)
	@if command -v node >/dev/null && command -v npm >/dev/null; then \
		$(MAKE) --no-print-directory types-compile; \
	elif [ -n "$$CI" ]; then \
		echo "node and npm not found: install Node.js 20+ (.ci/run does)"; exit 1; \
	else \
		echo "types-check SKIPPED: Node.js 20+ and npm not found (CI installs them and runs it)"; \
	fi

types-compile: $(TS_DIR)/node_modules/.package-lock.json
	$(TS_DIR)/node_modules/.bin/tsc --strict --noEmit -p $(TS_DIR)

$(VENV)/.bench-installed: $(VENV)/.installed
	$(BIN)/pip install --quiet -e '.[dev,embedded,bench]'
	touch $@

bench: $(VENV)/.bench-installed ## Writes and reads across a simulated network vs raw PyMongo and peers (ARGS=...)
	$(BIN)/python -m scripts.bench $(ARGS)

bench-langgraph: $(VENV)/.bench-installed ## LangGraph checkpointer vs langgraph-checkpoint-mongodb, 200 turns (ARGS=...)
	$(BIN)/python -m scripts.bench_langgraph $(ARGS)

index-sizes: $(VENV)/.installed ## Estimate index sizes per million messages (docs/SCALING.md)
	$(BIN)/python -m scripts.index_sizes

test-api: $(VENV)/.installed ## The admin API, auth, attacks, schemathesis and viewer tests
	$(BIN)/pytest tests/test_api.py tests/test_api_routes.py tests/test_api_authorization.py \
		tests/test_api_attacks.py tests/test_api_client_input.py tests/test_api_logs_and_headers.py \
		tests/test_api_streaming.py tests/test_api_openapi.py tests/test_api_schemathesis.py \
		tests/test_config.py tests/test_viewer.py

test-browser: $(VENV)/.installed ## The viewer in headless Chromium; screenshots in tests/output/
	$(BIN)/pytest -m browser

load: $(VENV)/.installed ## API load test on loopback: list and transcript vs a plain route (ARGS=...)
	$(BIN)/python -m scripts.load_api $(ARGS)

migrate: $(VENV)/.installed ## Legacy-turns migration: make migrate ARGS="run --dry-run" (default: status)
	$(BIN)/python -m migrations $(or $(ARGS),status)

bench-migration: $(VENV)/.installed ## Migration turns/s and peak RSS for two corpus sizes (a few minutes)
	$(BIN)/python scripts/bench_migration.py $(ARGS)
