# Shortcuts; the README's commands work without make.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test lint typecheck format protos docs docs-pictures bench bench-fleet bench-peers bench-vllm constraints

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
	$(PY) protos/generate.py && $(PY) protos/document.py

# The docs site on http://127.0.0.1:8001 (mkdocs.yml), rebuilt as its pages change.
docs:
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve -a 127.0.0.1:8001

# The docs' pictures: benchmark plots from committed results, and the dashboard's panels
# from a real Prometheus scraping a demo gateway under load (about a minute).
docs-pictures:
	$(PY) benchmarks/plots.py && $(PY) -m benchmarks.dashboard_pictures

bench:
	$(PY) benchmarks/bench_gateway.py

bench-fleet:
	$(PY) -m benchmarks.bench_fleet

# Side by side with vllm-router and smg (installed from PyPI into .tools/peers on first run).
bench-peers:
	$(PY) -m benchmarks.bench_peers

# Through a real engine (vLLM's CPU build from .tools/vllm, the tiny model): direct, the
# routers and furnace-gateway, HTTP and gRPC, 3 interleaved rounds (ARGS=--quick: 1 round).
bench-vllm:
	$(PY) -m benchmarks.bench_vllm $(ARGS)

# The pinned versions CI and the image install; run after changing a dependency (the venv
# holds the dev and otel extras, so the image's exporter is pinned too).
constraints: $(PY)
	$(VENV)/bin/pip install -q -e '.[dev,otel]'
	{ sed -n '1,3p' constraints.txt; $(VENV)/bin/pip freeze --exclude-editable | sed 's/+cpu$$//' | grep -v '^furnace'; } > constraints.new && mv constraints.new constraints.txt
