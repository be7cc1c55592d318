"""Simulated peers of the collector (Kubernetes API server, kubelet, GPUs) for tests and simulate mode."""
