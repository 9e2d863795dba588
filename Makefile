# Shortcuts; the README's commands work without make.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test lint format protos bench bench-fleet

$(PY):
	python3 -m venv $(VENV)

demo: $(PY)
	$(VENV)/bin/pip install -q -e . && $(VENV)/bin/furnace-gateway demo

test: $(PY)
	bash deploy/install-tools.sh && $(VENV)/bin/pip install -q -e '.[dev]' && $(PY) -m pytest

lint:
	$(VENV)/bin/ruff check gateway tests protos && $(VENV)/bin/ruff format --check gateway tests protos

format:
	$(VENV)/bin/ruff check --fix gateway tests protos && $(VENV)/bin/ruff format gateway tests protos

protos:
	$(PY) protos/generate.py

bench:
	$(PY) tests/bench_gateway.py

bench-fleet:
	$(PY) -m tests.bench_fleet
