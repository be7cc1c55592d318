"""A node's ``spec.providerID`` and the resource ids of cloud billing exports: the one owner of their parsing. Pure.

The collector reads the provider id from the Node object (``services.collector.nodefacts``); billing stores it on
every node bill and ``gpumeter reconcile`` matches a billing export's line items to nodes by it. Both import from
here, so the rule is written once.

Forms of ``spec.providerID``:

* AWS ``aws:///us-east-1a/i-0abc…`` (the instance id is the last segment; ``aws://us-east-1a/i-0abc`` also seen),
* GCP ``gce://<project>/<zone>/<instance name>``,
* Azure ``azure:///subscriptions/<sub>/resourceGroups/<rg>/providers/Microsoft.Compute/virtualMachineScaleSets/
  <vmss>/virtualMachines/<index>`` or ``…/virtualMachines/<vm name>`` for a plain VM.

Forms of a billing export's resource id for the same machine:

* AWS CUR ``line_item_resource_id`` and AWS FOCUS ``ResourceId``: the instance id ``i-0abc…`` (an ARN
  ``arn:aws:ec2:<region>:<account>:instance/i-0abc…`` is accepted too),
* GCP FOCUS ``ResourceId``: ``//compute.googleapis.com/projects/<project>/zones/<zone>/instances/<name>`` (or the
  bare name),
* Azure FOCUS ``ResourceId``: the ARM id ``/subscriptions/…/virtualMachines/<index>``, in any letter case.

``resource_matches(provider_id, resource_id)``: the resource id names the machine when its last path segment is
the machine's instance id (case-insensitive) -- for Azure, whose scale-set instance index alone says nothing, when
it ends with the provider id's whole ARM path; for GCP, whose instance names are unique per project and zone,
when the project and zone it names (if any) are the machine's.
"""

from __future__ import annotations

_PROVIDER_SCHEMES = {"aws": "aws", "gce": "gcp", "azure": "azure"}


def provider_of(provider_id: str) -> str | None:
    """The cloud provider a ``spec.providerID`` names (``aws``, ``gcp``, ``azure``, ``custom``), None when empty."""
    if not provider_id:
        return None
    scheme, sep, _rest = provider_id.partition("://")
    if not sep:
        return "custom"
    return _PROVIDER_SCHEMES.get(scheme.strip().lower(), "custom")


def instance_id_of(provider_id: str) -> str:
    """The machine's id within its provider: the last path segment of the providerID (``i-0abc…`` on AWS, the
    VM name on GCP, the scale-set VM index path's last part on Azure); empty when there is none."""
    _scheme, sep, rest = provider_id.partition("://")
    return rest.rstrip("/").rsplit("/", 1)[-1] if sep and rest.strip("/") else ""


def _segments(text: str) -> list[str]:
    return [part for part in text.strip().lower().replace(":", "/").split("/") if part]


def resource_matches(provider_id: str, resource_id: str) -> bool:
    """Whether a billing export's ``resource_id`` names the machine of ``provider_id`` (see the module docstring).
    False when either is empty."""
    instance = instance_id_of(provider_id).lower()
    resource = _segments(resource_id)
    if not instance or not resource or resource[-1] != instance:
        return False
    provider = provider_of(provider_id)
    path = _segments(provider_id.partition("://")[2])
    if provider == "azure":
        return len(resource) >= len(path) and resource[-len(path):] == path
    if provider == "gcp" and len(path) == 3:
        # //compute.googleapis.com/projects/<project>/zones/<zone>/instances/<name>: a name is unique per project
        # and zone only, so where the resource id names them they must be the machine's.
        named = dict(zip(resource, resource[1:]))
        return all(named.get(key, value) == value for key, value in (("projects", path[0]), ("zones", path[1])))
    return True


def resource_key(resource_id: str) -> str:
    """The last path segment of a billing export's resource id, lower case: what ``resource_matches`` compares
    with a node's instance id first (an index key for matching many line items to many nodes)."""
    segments = _segments(resource_id)
    return segments[-1] if segments else ""
