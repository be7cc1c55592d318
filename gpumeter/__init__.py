"""gpumeter: per-pod GPU shares, costs and guardrails for shared GPUs on Kubernetes."""

__version__ = "0.1.0"
