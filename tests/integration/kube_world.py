"""What the tests against the real kube-apiserver play: the controllers, the scheduler and the kubelet that the
test cluster does not run, and a network in between that a test can cut.

* ``new_namespace``: a Namespace (labels as given) and its ``default`` ServiceAccount (the ServiceAccount
  controller's job; the admission plugin refuses pods without it).
* ``create_running_pod``: a pod as the scheduler and kubelet would bring it about: created already bound
  (``spec.nodeName``; status is the server's own, Pending), then its status written as the kubelet reports a
  running pod (``PUT .../status``). ``create_body`` / ``pending_form`` say what is sent and what the server keeps
  of the status on create, so the peer can be given the same sequence.
* ``delete_pod_now``: ``gracePeriodSeconds=0``, what the kubelet sends once the containers have stopped.
* ``TcpGate``: a loopback TCP forwarder to the API server that a test can close (every connection cut, new ones
  refused at once) and open again: a network partition between the collector and the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import uuid
from typing import Any, Mapping

from gpumeter.devtools.kube_apiserver import KubeApiServer

SERVER_OWNED_METADATA = ("uid", "resourceVersion", "creationTimestamp", "generation", "managedFields")


def new_namespace(server: KubeApiServer, labels: Mapping[str, str] | None = None, *, name: str | None = None) -> str:
    name = name or f"t-{uuid.uuid4().hex[:10]}"
    server.must("POST", "/api/v1/namespaces",
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": dict(labels or {})}})
    server.must("POST", f"/api/v1/namespaces/{name}/serviceaccounts",
                {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}})
    return name


def create_body(obj: Mapping[str, Any]) -> dict[str, Any]:
    """What a client sends to create ``obj``: no status, no server-owned metadata."""
    body = copy.deepcopy(dict(obj))
    body.pop("status", None)
    for key in SERVER_OWNED_METADATA:
        body.get("metadata", {}).pop(key, None)
    return body


def pending_form(obj: Mapping[str, Any], created: Mapping[str, Any]) -> dict[str, Any]:
    """``obj`` with the status the server gives a pod on create (phase Pending, its QoS class), as ``created``
    (the server's answer) shows it."""
    pending = copy.deepcopy(dict(obj))
    pending["status"] = copy.deepcopy(dict(created.get("status") or {}))
    return pending


def create_running_pod(server: KubeApiServer, obj: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Create ``obj`` bound to its node, then report it running with ``obj``'s status: (as created, as running)."""
    namespace = obj["metadata"]["namespace"]
    created = server.must("POST", f"/api/v1/namespaces/{namespace}/pods", create_body(obj))
    running = copy.deepcopy(created)
    running["status"] = copy.deepcopy(dict(obj["status"]))
    running["status"]["qosClass"] = created["status"].get("qosClass", running["status"].get("qosClass"))
    running = server.must("PUT", f"/api/v1/namespaces/{namespace}/pods/{obj['metadata']['name']}/status", running)
    return created, running


def delete_pod_now(server: KubeApiServer, namespace: str, name: str) -> dict[str, Any]:
    return server.must("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}",
                       {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})


class TcpGate:
    """127.0.0.1:<port> forwarding to ``target_port``; ``close()`` cuts every connection and refuses new ones
    (accepted and closed at once), ``open()`` lets them through again."""

    def __init__(self, target_port: int) -> None:
        self._target_port = target_port
        self._open = True
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    async def start(self) -> "TcpGate":
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        self.close()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    def close(self) -> None:
        self._open = False
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    def open(self) -> None:
        self._open = True

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._forward(reader, writer)
        except asyncio.CancelledError:
            writer.transport.abort()  # the test is over; asyncio's server callback must not see the cancellation

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._open:
            writer.transport.abort()
            return
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self._target_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, upstream_writer))

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                sink.transport.abort()

        try:
            await asyncio.gather(pipe(reader, upstream_writer), pipe(upstream_reader, writer))
        finally:
            self._writers.discard(writer)
            self._writers.discard(upstream_writer)
