"""The deployment tests' tools: helm, kustomize, promtool and prometheus, real binaries built from source once
(gpumeter.devtools.gotools): the session fixture ``go_tools`` of tests/conftest.py, shared with the Grafana
dashboard's tests and the Prometheus integration test."""
