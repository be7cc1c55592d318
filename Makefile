# gpumeter: the two commands are `make run` and `make test`. Each sets itself up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: deps kafka-jars deploy-tools test test-unit run stop bench clean

$(STAMP): pyproject.toml constraints.txt
	@echo "setting up $(VENV) (Python deps, pinned by constraints.txt)..."
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

deps: $(STAMP)

kafka-jars: deps
	@$(PY) -m gpumeter.devtools.kafka_broker fetch >/dev/null

## deploy-tools: helm and kustomize for the deployment tests, built from source with Go into .cache/ once (a few
## minutes the first time; without Go on PATH, a pinned Go toolchain is downloaded and checked first).
deploy-tools: deps
	@$(PY) -m gpumeter.devtools.gotools build >/dev/null

## test: unit tests, then integration tests against a real Kafka broker and PostgreSQL that the tests start.
test: deps kafka-jars deploy-tools
	$(PY) -m pytest $(PYTEST_ARGS)

test-unit: deps deploy-tools
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

## run: the whole pipeline on a simulated 3-node cluster with a live view (Ctrl-C stops it cleanly):
## the local Kafka broker, the topics, collectors, attributor, billing, guard, then the cost report.
## `make run DURATION=60` stops by itself after 60 s. The broker keeps running afterwards; `make stop` stops it.
run: deps kafka-jars
	$(VENV)/bin/gpumeter run $(if $(DURATION),--duration $(DURATION))

stop: deps
	$(PY) -m gpumeter.devtools.kafka_broker stop

## bench: the benchmarks (never part of `make test`): figures in bench/results/*.json and the table in
## docs/performance.md. Starts its own Kafka broker and PostgreSQL; about 10 minutes. `make bench BENCH_ARGS=--quick`
## is a fast smoke run; `BENCH_ARGS="--only attribution"` runs one.
bench: deps kafka-jars
	$(PY) -m bench.run $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .cache .pytest_cache .hypothesis
