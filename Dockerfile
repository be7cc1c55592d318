# syntax=docker/dockerfile:1
# One image for every gpumeter role: the entrypoint is the `gpumeter` command, the first argument picks the role
# (`collector`, `attributor`, `billing`, `guard`, `topics create`, `report`, `replay`, ...).
#
# * Dependencies are installed with the project's pins (`-c constraints.txt`) into a virtual environment in a
#   build stage; the runtime stage copies only that environment and the scenarios, so no compiler, pip cache or
#   source tree ends up in the image.
# * Package data (Avro schemas, price CSVs, ledger migrations) travels inside the installed package, as
#   pyproject.toml's package-data declares; scenarios/ is not a package and is copied to /app/scenarios for
#   simulate mode (`gpumeter collector --simulate /app/scenarios/demo.yaml`).
# * Runs as the unprivileged user 10001:10001. The Kubernetes collector overrides this with runAsUser 0 (it must
#   connect to the kubelet's root-owned pod-resources socket); see deploy/kubernetes/collector.yaml.
# * The root filesystem can be mounted read-only: services write only under /tmp (simulated nodes, the
#   attributor's Faust data folder) and /var/lib/gpumeter (the guard's state file); both are made writable for
#   10001 here, so a fresh named volume mounted there inherits that owner.
# * No HEALTHCHECK: the metrics port differs per role. Every long-running role serves Prometheus /metrics over
#   HTTP; probe it with the interpreter that is already here, e.g.
#   python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9404/metrics', timeout=4)"

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/gpumeter
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY gpumeter ./gpumeter
COPY services ./services
COPY schemas ./schemas
COPY pipeline ./pipeline
COPY simulator ./simulator
# Not editable: the package (and its data files) is copied into the environment, so the source tree stays here.
RUN /opt/gpumeter/bin/pip install -c constraints.txt .

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="gpumeter" \
      org.opencontainers.image.description="Per-pod GPU shares, costs and guardrails for shared GPUs on Kubernetes, as Kafka streams" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PATH=/opt/gpumeter/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp
RUN groupadd --system --gid 10001 gpumeter \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin gpumeter \
    && install -d -o 10001 -g 10001 -m 0750 /var/lib/gpumeter
COPY --from=build /opt/gpumeter /opt/gpumeter
COPY scenarios /app/scenarios
WORKDIR /app
# Smoke test of the installed package alone (no source tree here): the topic catalog and its Avro schemas, the
# ledger migrations, and an offline replay of the demo scenario through the simulator, attribution and pricing.
RUN gpumeter topics list >/dev/null \
    && python -c "from services.billing.ledger import MIGRATIONS_DIR as m; assert (m / 'env.py').is_file(), m" \
    && gpumeter replay /app/scenarios/demo.yaml --out /tmp/gpumeter-smoke >/dev/null \
    && rm -rf /tmp/gpumeter-smoke
USER 10001:10001
# Every role stops cleanly on SIGTERM (offsets committed, buffers flushed); give it the orchestrator's grace period.
STOPSIGNAL SIGTERM
ENTRYPOINT ["gpumeter"]
CMD ["--help"]
