"""A node's pricing facts from its own Node object, with configuration as an override. Pure, plus one reader.

``node_facts_from_node(cluster, node_name, node, overrides)`` is the rule; ``read_node_object(api, name)`` fetches
the Node (read-only ``get`` on ``nodes``). What comes from where:

=================  =======================================================================================
fact               from the Node object (first that is set)
=================  =======================================================================================
``provider_id``    ``spec.providerID`` (``aws:///us-east-1a/i-0abc…``, ``gce://project/zone/name``,
                   ``azure:///subscriptions/…``): what the cloud bill names the machine by
``cloud_provider`` the providerID's scheme: ``aws``, ``gce`` → ``gcp``, ``azure``; any other scheme → ``custom``
``region``         ``topology.kubernetes.io/region``, ``failure-domain.beta.kubernetes.io/region``
``zone``           ``topology.kubernetes.io/zone``, ``failure-domain.beta.kubernetes.io/zone``
``instance_type``  ``node.kubernetes.io/instance-type``, ``beta.kubernetes.io/instance-type``
``price_model``    ``karpenter.sh/capacity-type`` (``spot``, ``on-demand``, ``reserved`` → committed),
                   ``eks.amazonaws.com/capacityType`` (``SPOT``, ``ON_DEMAND``, ``CAPACITY_BLOCK`` → committed),
                   ``cloud.google.com/gke-spot`` or ``cloud.google.com/gke-preemptible`` = ``true`` → spot,
                   ``kubernetes.azure.com/scalesetpriority`` = ``spot`` → spot; a node with none of these is
                   on-demand
=================  =======================================================================================

Every fact set in ``overrides`` (the collector's ConfigMap / ``GPUMETER_*`` environment) wins over the Node's:
that is how an operator corrects a label, prices a committed-use node the labels cannot tell apart, or names
the provider of an on-premises node. A fact neither gives is ``unknown`` (``on_demand`` for the price model).
``sources`` says, per fact, where it came from (``node``, ``config`` or ``default``), for the collector's log.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Mapping

from gpumeter.errors import ConfigError, GpumeterError
from schemas.provider_id import instance_id_of  # noqa: F401 - re-exported: its home is schemas (billing uses it)
from services.collector.assemble import NodeFacts

UNKNOWN = "unknown"
PRICE_MODELS = ("on_demand", "spot", "committed")

REGION_LABELS = ("topology.kubernetes.io/region", "failure-domain.beta.kubernetes.io/region")
ZONE_LABELS = ("topology.kubernetes.io/zone", "failure-domain.beta.kubernetes.io/zone")
INSTANCE_TYPE_LABELS = ("node.kubernetes.io/instance-type", "beta.kubernetes.io/instance-type")
KARPENTER_CAPACITY_TYPE = "karpenter.sh/capacity-type"
EKS_CAPACITY_TYPE = "eks.amazonaws.com/capacityType"
GKE_SPOT = "cloud.google.com/gke-spot"
GKE_PREEMPTIBLE = "cloud.google.com/gke-preemptible"
AKS_SCALESET_PRIORITY = "kubernetes.azure.com/scalesetpriority"

_PROVIDER_SCHEMES = {"aws": "aws", "gce": "gcp", "azure": "azure"}
_CAPACITY_TYPES = {
    KARPENTER_CAPACITY_TYPE: {"spot": "spot", "on-demand": "on_demand", "reserved": "committed"},
    EKS_CAPACITY_TYPE: {"spot": "spot", "on_demand": "on_demand", "capacity_block": "committed"},
}


@dataclass(frozen=True)
class NodeFactOverrides:
    """Facts the configuration sets explicitly (None: take the Node's)."""

    cloud_provider: str | None = None
    region: str | None = None
    zone: str | None = None
    instance_type: str | None = None
    price_model: str | None = None
    provider_id: str | None = None

    def __post_init__(self) -> None:
        if self.price_model is not None and self.price_model not in PRICE_MODELS:
            raise ConfigError(f"price model {self.price_model!r} is not one of {', '.join(PRICE_MODELS)}")


@dataclass(frozen=True)
class ResolvedNodeFacts:
    facts: NodeFacts
    sources: Mapping[str, str]  # fact -> "node" | "config" | "default"


def provider_of(provider_id: str) -> str | None:
    """The cloud provider a ``spec.providerID`` names (``aws``, ``gcp``, ``azure``, ``custom``), None when empty."""
    if not provider_id:
        return None
    scheme, sep, _rest = provider_id.partition("://")
    if not sep:
        return "custom"
    return _PROVIDER_SCHEMES.get(scheme.strip().lower(), "custom")


def price_model_from_labels(labels: Mapping[str, str]) -> str | None:
    """The price model the node's capacity-type labels say, None when they say nothing."""
    for label, values in _CAPACITY_TYPES.items():
        value = labels.get(label)
        if value:
            model = values.get(value.strip().lower())
            if model is not None:
                return model
    for label in (GKE_SPOT, GKE_PREEMPTIBLE):
        if labels.get(label, "").strip().lower() == "true":
            return "spot"
    if labels.get(AKS_SCALESET_PRIORITY, "").strip().lower() == "spot":
        return "spot"
    return None


def _first_label(labels: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    for name in names:
        value = labels.get(name)
        if isinstance(value, str) and value.strip():
            return value.strip()
    return None


def node_facts_from_node(
    cluster: str, node_name: str, node: Mapping[str, Any] | None, overrides: NodeFactOverrides
) -> ResolvedNodeFacts:
    """The node's facts by the module's rules. ``node`` is the Node object as the API serves it (JSON), or None
    when it could not be read."""
    from_node: dict[str, str | None] = dict.fromkeys(f.name for f in fields(NodeFactOverrides))
    if node is not None:
        metadata = node.get("metadata") if isinstance(node.get("metadata"), Mapping) else {}
        labels = metadata.get("labels") if isinstance(metadata.get("labels"), Mapping) else {}
        spec = node.get("spec") if isinstance(node.get("spec"), Mapping) else {}
        provider_id = spec.get("providerID") if isinstance(spec.get("providerID"), str) else ""
        from_node.update(
            provider_id=provider_id or None,
            cloud_provider=provider_of(provider_id),
            region=_first_label(labels, REGION_LABELS),
            zone=_first_label(labels, ZONE_LABELS),
            instance_type=_first_label(labels, INSTANCE_TYPE_LABELS),
            price_model=price_model_from_labels(labels) or "on_demand",
        )
    values: dict[str, str] = {}
    sources: dict[str, str] = {}
    defaults = {"cloud_provider": UNKNOWN, "region": UNKNOWN, "zone": "", "instance_type": UNKNOWN,
                "price_model": "on_demand", "provider_id": ""}
    for name, default in defaults.items():
        configured = getattr(overrides, name)
        if configured is not None:
            values[name], sources[name] = configured, "config"
        elif from_node[name] is not None:
            values[name], sources[name] = from_node[name], "node"  # type: ignore[assignment]
        else:
            values[name], sources[name] = default, "default"
    facts = NodeFacts(cluster, node_name, values["cloud_provider"], values["region"], values["instance_type"],
                      values["price_model"], zone=values["zone"], provider_id=values["provider_id"])
    return ResolvedNodeFacts(facts, sources)


async def read_node_object(api_client: Any, node_name: str, timeout_s: float = 10.0) -> Mapping[str, Any]:
    """``GET /api/v1/nodes/<name>`` through ``api_client`` (kubernetes-asyncio). Raises ``NodeReadError``."""
    import aiohttp
    from kubernetes_asyncio import client

    try:
        response = await client.CoreV1Api(api_client).read_node(
            node_name, _preload_content=False, _request_timeout=aiohttp.ClientTimeout(total=timeout_s))
        try:
            body = await response.read()
        finally:
            response.release()
    except Exception as exc:  # aiohttp, OS and the client's own ApiException: one failed read
        status = getattr(exc, "status", None)
        raise NodeReadError(f"reading node {node_name} failed: {type(exc).__name__}"
                            f"{f' HTTP {status}' if status else ''}: {getattr(exc, 'reason', exc)}") from None
    if not 200 <= response.status < 300:
        raise NodeReadError(f"reading node {node_name} failed: HTTP {response.status}")
    try:
        obj = json.loads(body)
    except ValueError as exc:
        raise NodeReadError(f"node {node_name} is not JSON: {exc}") from None
    if not isinstance(obj, Mapping):
        raise NodeReadError(f"node {node_name} is not a JSON object")
    return obj


class NodeReadError(GpumeterError):
    """The Node object could not be read (network, RBAC, a missing node): the configured facts apply."""
