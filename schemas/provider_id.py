"""What a Kubernetes Node's ``spec.providerID`` says about the machine: shared by the collector (which reads it)
and billing (which matches bills and names the resource by it). Imports nothing of the services."""

from __future__ import annotations


def instance_id_of(provider_id: str) -> str:
    """The machine's id within its provider: the last path segment of the providerID (``i-0abc…`` on AWS, the
    VM name on GCP, the scale-set VM index path's last part on Azure); empty when there is none."""
    _scheme, sep, rest = provider_id.partition("://")
    return rest.rstrip("/").rsplit("/", 1)[-1] if sep and rest.strip("/") else ""
