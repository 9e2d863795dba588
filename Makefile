# Shortcuts; the README's commands work without make.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test lint typecheck format protos bench bench-fleet bench-peers constraints

$(PY):
	python3 -m venv $(VENV)

demo: $(PY)
	$(VENV)/bin/pip install -q -c constraints.txt -e . && $(VENV)/bin/furnace-gateway demo

test: $(PY)
	bash deploy/install-tools.sh && $(VENV)/bin/pip install -q -c constraints.txt -e '.[dev]' && $(PY) -m pytest

lint: typecheck
	$(VENV)/bin/ruff check gateway tests benchmarks protos && $(VENV)/bin/ruff format --check gateway tests benchmarks protos

# The type check: pyproject.toml's [tool.mypy] (strict, over gateway/).
typecheck:
	$(VENV)/bin/mypy

format:
	$(VENV)/bin/ruff check --fix gateway tests benchmarks protos && $(VENV)/bin/ruff format gateway tests benchmarks protos

protos:
	$(PY) protos/generate.py

bench:
	$(PY) benchmarks/bench_gateway.py

bench-fleet:
	$(PY) -m benchmarks.bench_fleet

# Side by side with vllm-router and smg (installed from PyPI into .tools/peers on first run).
bench-peers:
	$(PY) -m benchmarks.bench_peers

# The pinned versions CI and the image install; run after changing a dependency.
constraints: $(PY)
	{ sed -n '1,3p' constraints.txt; $(VENV)/bin/pip freeze --exclude-editable | sed 's/+cpu$$//' | grep -v '^furnace'; } > constraints.new && mv constraints.new constraints.txt
