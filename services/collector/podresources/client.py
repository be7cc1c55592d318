"""Async client of the kubelet PodResources v1 API: which container holds which GPU device ids.

The kubelet serves the API over a unix socket (``/var/lib/kubelet/pod-resources/kubelet.sock``; the collector
mounts ``/var/lib/kubelet/pod-resources`` read-only). Every call has a deadline (2 s by default) so a slow or hung
kubelet never stalls a collector tick, and every failure comes back as a typed error:

* ``KubeletUnavailable`` — no socket, nothing listening, deadline exceeded, rate-limited by the kubelet
  (RESOURCE_EXHAUSTED; it allows 100 QPS, burst 10) or the call cancelled by a stopping kubelet. Transient: the
  caller degrades to cgroup-only mapping and tries again next tick.
* ``PodResourcesError`` (the base) — any other gRPC status: a kubelet that answers but not as the API says.

``Get`` (kubelet feature KubeletPodResourcesGet) is used where served. Old kubelets answer UNIMPLEMENTED; kubelets
with the feature gate off answer UNKNOWN "PodResources API Get method disabled"; either way the client falls
back to ``List`` filtered to the pod and re-probes ``Get`` after ``GET_REPROBE_AFTER_CALLS`` fallbacks or after the
kubelet was unavailable (it may have restarted with other flags). The kubelet answers an unknown pod with UNKNOWN
"pod <name> in namespace <ns> not found": that is an empty result, not an error.

Only GPU resources (``schemas.devices.is_gpu_resource``) are returned, and the devices of DRA claims
(``dynamic_resources``, as ``ContainerClaimDevice``); device ids are passed through unparsed. A client
lives in one event loop (its gRPC channel is bound to it); ``close()`` it when done.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import grpc
import grpc.aio

from gpumeter.errors import ConfigError, GpumeterError

from . import api_pb2, api_pb2_grpc
from schemas.devices import is_gpu_resource

DEFAULT_SOCKET_PATH = "/var/lib/kubelet/pod-resources/kubelet.sock"
DEFAULT_TIMEOUT_S = 2.0
# The kubelet's own podresources client allows 16 MiB responses; a List on a dense node can pass gRPC's 4 MiB default.
MAX_RECEIVE_MESSAGE_BYTES = 16 * 1024 * 1024
# sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
MAX_UNIX_SOCKET_PATH_BYTES = 107
GET_REPROBE_AFTER_CALLS = 256

_TRANSIENT_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.CANCELLED,
    }
)
_CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES),
    # gRPC's default reconnect backoff grows to 120 s; a restarted kubelet should be found again within a tick or two.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 5000),
    ("grpc.enable_http_proxy", 0),
    # gRPC shares subchannels process-wide by default, so a new channel would inherit the old one's connect
    # backoff and fail at once with the old error; a local pool makes "close and reopen" a real reconnect.
    ("grpc.use_local_subchannel_pool", 1),
)


class PodResourcesError(GpumeterError):
    """The kubelet PodResources API failed. ``status_code`` is the gRPC status name, or None when no call was made."""

    def __init__(self, detail: str, *, status_code: str | None = None) -> None:
        super().__init__(detail)
        self.status_code = status_code


class KubeletUnavailable(PodResourcesError):
    """The kubelet could not be asked right now (no socket, not listening, too slow, rate-limited). Transient."""


@dataclass(frozen=True, slots=True)
class ContainerDeviceAssignment:
    """GPU device ids the kubelet assigned to one container for one resource name."""

    namespace: str
    pod_name: str
    container_name: str
    resource_name: str
    device_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class AllocatableDevices:
    """All device ids the kubelet knows for one GPU resource name (capacity, not what is free)."""

    resource_name: str
    device_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ContainerClaimDevice:
    """One device the kubelet lists for a container under ``dynamic_resources`` (DRA): the claim and the device by
    driver, pool and device name, with its CDI ids. What it is on the node is ``services.collector.dra``'s to say."""

    namespace: str
    pod_name: str
    container_name: str
    claim_namespace: str
    claim_name: str
    driver_name: str
    pool_name: str
    device_name: str
    cdi_ids: tuple[str, ...]

    @property
    def claim_key(self) -> tuple[str, str]:
        """(namespace, name) of the ResourceClaim; a claim is in its pod's namespace when the kubelet names none."""
        return (self.claim_namespace or self.namespace, self.claim_name)

    @property
    def fallback_id(self) -> str:
        """The id an unresolved device is published with: its first CDI id, else driver/pool/device."""
        return self.cdi_ids[0] if self.cdi_ids else f"{self.driver_name}/{self.pool_name}/{self.device_name}"


PodAssignment = ContainerDeviceAssignment | ContainerClaimDevice


def assignments_from_pod(pod: api_pb2.PodResources) -> tuple[PodAssignment, ...]:
    """The GPU assignments of one PodResources message, in message order: device-plugin devices of GPU resources
    (empty device lists dropped), then per container the devices of its DRA claims (every driver's: which are
    GPUs is decided by the caller)."""
    out: list[PodAssignment] = []
    for container in pod.containers:
        for devices in container.devices:
            if not devices.device_ids or not is_gpu_resource(devices.resource_name):
                continue
            out.append(
                ContainerDeviceAssignment(
                    namespace=pod.namespace,
                    pod_name=pod.name,
                    container_name=container.name,
                    resource_name=devices.resource_name,
                    device_ids=tuple(devices.device_ids),
                )
            )
        for dynamic in container.dynamic_resources:
            for resource in dynamic.claim_resources:
                out.append(
                    ContainerClaimDevice(
                        namespace=pod.namespace,
                        pod_name=pod.name,
                        container_name=container.name,
                        claim_namespace=dynamic.claim_namespace,
                        claim_name=dynamic.claim_name,
                        driver_name=resource.driver_name,
                        pool_name=resource.pool_name,
                        device_name=resource.device_name,
                        cdi_ids=tuple(d.name for d in resource.cdi_devices),
                    )
                )
    return tuple(out)


def _is_get_not_served(error: grpc.aio.AioRpcError) -> bool:
    if error.code() == grpc.StatusCode.UNIMPLEMENTED:
        return True
    return error.code() == grpc.StatusCode.UNKNOWN and "method disabled" in (error.details() or "")


def _is_pod_not_found(error: grpc.aio.AioRpcError) -> bool:
    if error.code() == grpc.StatusCode.NOT_FOUND:
        return True
    return error.code() == grpc.StatusCode.UNKNOWN and (error.details() or "").endswith("not found")


class PodResourcesClient:
    """Client of one kubelet's PodResources v1 socket. Each call is bounded by ``timeout_s``."""

    def __init__(self, socket_path: str | Path = DEFAULT_SOCKET_PATH, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        path = os.path.abspath(os.fspath(socket_path))
        if len(os.fsencode(path)) > MAX_UNIX_SOCKET_PATH_BYTES:
            raise ConfigError(f"unix socket path longer than {MAX_UNIX_SOCKET_PATH_BYTES} bytes: {path}")
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s must be positive, got {timeout_s!r}")
        self._socket_path = path
        self._timeout_s = float(timeout_s)
        self._channel: grpc.aio.Channel | None = None
        self._stub: api_pb2_grpc.PodResourcesListerStub | None = None
        # The socket file the open channel was made for: (device, inode, change time). None: none, or the kubelet
        # was found unavailable since.
        self._channel_socket: tuple[int, int, int] | None = None
        self._get_served: bool | None = None
        self._fallbacks_since_probe = 0

    @property
    def socket_path(self) -> str:
        return self._socket_path

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    @property
    def get_served(self) -> bool | None:
        """Whether the kubelet served ``Get`` when last asked; None before the first ``get``."""
        return self._get_served

    async def list(self) -> tuple[PodAssignment, ...]:
        """Every GPU assignment (and DRA claim device) of every active pod on the node (List)."""
        response = await self._call("List", api_pb2.ListPodResourcesRequest())
        out: list[PodAssignment] = []
        for pod in response.pod_resources:
            out.extend(assignments_from_pod(pod))
        return tuple(out)

    async def get(self, namespace: str, pod_name: str) -> tuple[PodAssignment, ...]:
        """The GPU assignments of one pod (Get where served, else List filtered); empty for an unknown pod."""
        if not namespace or not pod_name:
            raise ValueError("namespace and pod_name must be non-empty")
        if self._get_served is False and self._fallbacks_since_probe < GET_REPROBE_AFTER_CALLS:
            return await self._get_by_list(namespace, pod_name)
        try:
            response = await self._call(
                "Get", api_pb2.GetPodResourcesRequest(pod_name=pod_name, pod_namespace=namespace)
            )
        except _GetNotServed:
            self._get_served = False
            self._fallbacks_since_probe = 0
            return await self._get_by_list(namespace, pod_name)
        except _PodNotFound:
            self._get_served = True
            return ()
        self._get_served = True
        if not response.HasField("pod_resources"):
            return ()
        return assignments_from_pod(response.pod_resources)

    async def allocatable(self) -> tuple[AllocatableDevices, ...]:
        """Every GPU device id the kubelet can allocate, per resource name (GetAllocatableResources)."""
        response = await self._call("GetAllocatableResources", api_pb2.AllocatableResourcesRequest())
        merged: dict[str, list[str]] = {}
        for devices in response.devices:
            if is_gpu_resource(devices.resource_name):
                merged.setdefault(devices.resource_name, []).extend(devices.device_ids)
        return tuple(AllocatableDevices(name, tuple(ids)) for name, ids in merged.items())

    async def close(self) -> None:
        """Close the channel; a later call opens a new one."""
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await channel.close()

    async def __aenter__(self) -> PodResourcesClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def _get_by_list(self, namespace: str, pod_name: str) -> tuple[PodAssignment, ...]:
        self._fallbacks_since_probe += 1
        return tuple(a for a in await self.list() if a.namespace == namespace and a.pod_name == pod_name)

    def _unavailable(self, detail: str, status_code: str | None = None) -> KubeletUnavailable:
        # The kubelet that comes back may be another version or have other feature gates: probe Get again. Its
        # socket will be another file too: an open channel is not reused for it (see ``_call``).
        self._get_served = None
        self._channel_socket = None
        return KubeletUnavailable(detail, status_code=status_code)

    def _check_socket(self) -> tuple[int, int, int]:
        """The socket file's identity (device, inode, change time); ``KubeletUnavailable`` if there is none."""
        # Without this, a missing socket costs a connect attempt and a backoff inside gRPC; stat is immediate.
        try:
            status = os.stat(self._socket_path)
        except FileNotFoundError:
            raise self._unavailable(f"no kubelet PodResources socket at {self._socket_path}") from None
        except OSError as exc:
            raise self._unavailable(f"cannot stat kubelet socket {self._socket_path}: {exc}") from exc
        if not stat.S_ISSOCK(status.st_mode):
            raise self._unavailable(f"{self._socket_path} exists but is not a unix socket")
        return (status.st_dev, status.st_ino, status.st_ctime_ns)

    def _ensure_stub(self) -> api_pb2_grpc.PodResourcesListerStub:
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(f"unix://{self._socket_path}", options=_CHANNEL_OPTIONS)
            self._stub = api_pb2_grpc.PodResourcesListerStub(self._channel)
        return self._stub

    async def _call(self, method: str, request):  # noqa: ANN001, ANN202 - the generated stubs are untyped
        socket_identity = self._check_socket()
        if self._channel is not None and socket_identity != self._channel_socket:
            # A restarted kubelet re-creates its socket. The open channel's connection went to the process that
            # is gone, and its next call would fail ("Stream removed") before gRPC reconnects: start afresh.
            await self.close()
        stub = self._ensure_stub()
        self._channel_socket = socket_identity
        try:
            return await getattr(stub, method)(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as error:
            if method == "Get" and _is_get_not_served(error):
                raise _GetNotServed() from error
            if method == "Get" and _is_pod_not_found(error):
                raise _PodNotFound() from error
            code = error.code()
            detail = f"kubelet PodResources {method} failed: {code.name} {error.details() or ''}".rstrip()
            if code in _TRANSIENT_CODES:
                # A fresh channel reconnects at once instead of waiting out gRPC's backoff.
                await self.close()
                raise self._unavailable(detail, code.name) from error
            raise PodResourcesError(detail, status_code=code.name) from error
        except grpc.aio.UsageError as error:
            await self.close()
            raise PodResourcesError(f"kubelet PodResources {method} failed: {error}") from error


class _GetNotServed(Exception):
    """Internal: the kubelet does not serve Get."""


class _PodNotFound(Exception):
    """Internal: Get answered that the pod is not on this node."""
