"""A real Kubernetes control plane's API half on loopback, for tests: etcd and kube-apiserver (``gpumeter.devtools.
kube`` builds them), configured as a cluster runs them, with no kubelet, scheduler or controller manager.

Contract:

* ``KubeApiServer(binaries).start()`` writes a fresh PKI into a temporary folder under ``/tmp`` with ``kube-pki``
  (a CA; the serving certificate for 127.0.0.1 and localhost; a client certificate in ``system:masters`` for the
  tests, ``admin``; the service-account signing key pair), starts etcd on two free loopback ports and
  kube-apiserver on a third, and returns once ``/readyz`` answers 200 (about 3 s after the start on 2 cores).
* kube-apiserver runs as kubeadm configures one: ``--authorization-mode=Node,RBAC``, client certificates and
  service-account tokens (``TokenRequest``, issuer ``SERVICE_ACCOUNT_ISSUER``) as the ways in, the default
  admission plugins plus ``NodeRestriction``, ``--allow-privileged``, the API groups of the release
  (``resource.k8s.io/v1`` among them, asked for explicitly in ``--runtime-config``). Nothing plays the controllers:
  a namespace has no ``default`` ServiceAccount until a test creates it (the ServiceAccount admission plugin
  refuses pods without one), a deleted namespace stays Terminating, and a pod bound to a node stays until it is
  deleted with ``gracePeriodSeconds=0`` (what the kubelet does once its containers have stopped).
* ``stop_apiserver()`` / ``start_apiserver()`` / ``restart_apiserver()`` stop and start kube-apiserver alone, on
  the same port with the same etcd (its watch cache starts afresh: a watch from before the restart gets
  ``410 Gone``); ``stop()`` ends both and removes the folder. Also a context manager.
* ``request(method, path, body)`` is a blocking call as the admin (``(status, JSON body)``), for set-up outside an
  event loop; ``admin_configuration()`` a kubernetes-asyncio ``Configuration`` for the same identity.
* Logs: ``etcd.log`` and ``kube-apiserver.log`` in the folder; a start that fails raises ``KubeApiServerError``
  with their tails.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from gpumeter.devtools.kube import KubeBinaries

SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
SERVICE_CLUSTER_IP_RANGE = "10.96.0.0/16"
ADMIN_USER = "gpumeter-test-admin"


class KubeApiServerError(RuntimeError):
    """etcd or kube-apiserver could not be set up, started or stopped."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class KubeApiServer:
    """etcd + kube-apiserver on loopback (module doc)."""

    def __init__(self, binaries: KubeBinaries, *, base_dir: Path | None = None) -> None:
        self.binaries = binaries
        self._base_dir = base_dir
        self.folder: Path | None = None
        self.port = 0
        self._etcd_client_port = 0
        self._etcd_peer_port = 0
        self._etcd: subprocess.Popen[bytes] | None = None
        self._apiserver: subprocess.Popen[bytes] | None = None

    # --- paths and identities ------------------------------------------------------------------------------

    def _path(self, name: str) -> Path:
        if self.folder is None:
            raise KubeApiServerError("the API server is not started")
        return self.folder / name

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def ca_file(self) -> Path:
        return self._path("pki") / "ca.crt"

    @property
    def admin_cert_file(self) -> Path:
        return self._path("pki") / "admin.crt"

    @property
    def admin_key_file(self) -> Path:
        return self._path("pki") / "admin.key"

    def admin_configuration(self) -> Any:
        """A kubernetes-asyncio ``Configuration`` authenticating as the admin (client certificate)."""
        from kubernetes_asyncio import client

        configuration = client.Configuration(host=self.url)
        configuration.ssl_ca_cert = str(self.ca_file)
        configuration.cert_file = str(self.admin_cert_file)
        configuration.key_file = str(self.admin_key_file)
        configuration.verify_ssl = True
        return configuration

    def ssl_context(self, *, admin: bool = True) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca_file))
        if admin:
            context.load_cert_chain(str(self.admin_cert_file), str(self.admin_key_file))
        return context

    # --- lifecycle -----------------------------------------------------------------------------------------

    def start(self, timeout_s: float = 120.0) -> str:
        """Set up the PKI, start etcd and kube-apiserver, wait until ready; returns ``url``."""
        self.folder = Path(tempfile.mkdtemp(prefix="gpumeter-kube-", dir=self._base_dir or "/tmp"))
        try:
            result = subprocess.run([str(self.binaries.kube_pki), "-dir", str(self.folder / "pki"),
                                     "-hosts", "127.0.0.1,localhost,kubernetes.default.svc"],
                                    capture_output=True, text=True, timeout=60)
            if result.returncode != 0:
                raise KubeApiServerError(f"kube-pki failed: {result.stderr.strip()}")
            self._etcd_client_port, self._etcd_peer_port, self.port = free_port(), free_port(), free_port()
            self._start_etcd(timeout_s)
            self.start_apiserver(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.url

    def _start_etcd(self, timeout_s: float) -> None:
        client_url = f"http://127.0.0.1:{self._etcd_client_port}"
        peer_url = f"http://127.0.0.1:{self._etcd_peer_port}"
        command = [
            str(self.binaries.etcd), "--name", "gpumeter-test", "--data-dir", str(self._path("etcd")),
            "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"gpumeter-test={peer_url}", "--initial-cluster-state", "new",
            # The data is thrown away: no fsync (a shared 2-core machine's disk stalls the test otherwise).
            "--unsafe-no-fsync", "--log-level", "warn",
        ]
        self._etcd = self._spawn(command, "etcd.log")
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{client_url}/health", timeout=2) as response:
                    if json.loads(response.read()).get("health") == "true":
                        return
            except (OSError, ValueError):
                pass
            self._check_alive(self._etcd, "etcd", "etcd.log")
            if time.monotonic() > deadline:
                raise KubeApiServerError(f"etcd not healthy within {timeout_s:.0f} s:\n{self._tail('etcd.log')}")
            time.sleep(0.1)

    def apiserver_command(self) -> list[str]:
        pki = self._path("pki")
        return [
            str(self.binaries.kube_apiserver),
            f"--etcd-servers=http://127.0.0.1:{self._etcd_client_port}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={self.port}",
            f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
            "--authorization-mode=Node,RBAC",
            # kubeadm's: the defaults plus NodeRestriction.
            "--enable-admission-plugins=NodeRestriction",
            "--allow-privileged=true",
            # The endpoint reconciler refuses a loopback advertise address; nothing in the test cluster reaches the
            # API through the kubernetes Service, so it keeps no endpoints.
            "--endpoint-reconciler-type=none",
            "--runtime-config=resource.k8s.io/v1=true",
            "--profiling=false",
            f"--cert-dir={self._path('apiserver-certs')}",
        ]

    def start_apiserver(self, timeout_s: float = 120.0) -> None:
        """Start kube-apiserver (again) and wait until ``/readyz`` answers 200."""
        if self._apiserver is not None and self._apiserver.poll() is None:
            raise KubeApiServerError("kube-apiserver is already running")
        self._apiserver = self._spawn(self.apiserver_command(), "kube-apiserver.log")
        deadline = time.monotonic() + timeout_s
        context = self.ssl_context()
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/readyz", timeout=5, context=context) as response:
                    if response.status == 200:
                        return
            except (OSError, ssl.SSLError):
                pass
            self._check_alive(self._apiserver, "kube-apiserver", "kube-apiserver.log")
            if time.monotonic() > deadline:
                raise KubeApiServerError(f"kube-apiserver not ready within {timeout_s:.0f} s:\n"
                                         f"{self._tail('kube-apiserver.log')}")
            time.sleep(0.1)

    def stop_apiserver(self) -> None:
        """Stop kube-apiserver (SIGTERM, as the kubelet stops a static pod); etcd keeps running."""
        self._terminate(self._apiserver)
        self._apiserver = None

    def restart_apiserver(self, timeout_s: float = 120.0) -> None:
        self.stop_apiserver()
        self.start_apiserver(timeout_s)

    def stop(self) -> None:
        self._terminate(self._apiserver)
        self._apiserver = None
        self._terminate(self._etcd)
        self._etcd = None
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    def __enter__(self) -> "KubeApiServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- requests as the admin -----------------------------------------------------------------------------

    def request(self, method: str, path: str, body: Any = None, *, content_type: str = "application/json",
                token: str | None = None, timeout_s: float = 30.0) -> tuple[int, Any]:
        """One request to the API server, as the admin (or with ``token`` as a bearer token instead); returns the
        HTTP status and the JSON body (errors are ``Status`` objects, returned, not raised)."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = content_type
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        request = urllib.request.Request(f"{self.url}{path}", data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s,
                                        context=self.ssl_context(admin=token is None)) as response:
                return response.status, json.loads(response.read() or b"null")
        except urllib.error.HTTPError as error:
            raw = error.read()
            try:
                return error.code, json.loads(raw)
            except ValueError:
                return error.code, raw.decode("utf-8", errors="replace")

    def must(self, method: str, path: str, body: Any = None, **kwargs: Any) -> Any:
        """``request`` that raises ``KubeApiServerError`` unless the status is 2xx; returns the body."""
        status, answer = self.request(method, path, body, **kwargs)
        if not 200 <= status < 300:
            raise KubeApiServerError(f"{method} {path}: HTTP {status}: {answer}")
        return answer

    # --- internals -----------------------------------------------------------------------------------------

    def _spawn(self, command: list[str], log_name: str) -> subprocess.Popen[bytes]:
        log = open(self._path(log_name), "ab")
        try:
            return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        finally:
            log.close()

    def _check_alive(self, process: subprocess.Popen[bytes] | None, what: str, log_name: str) -> None:
        if process is None or process.poll() is not None:
            code = None if process is None else process.returncode
            raise KubeApiServerError(f"{what} exited ({code}):\n{self._tail(log_name)}")

    def _tail(self, log_name: str, lines: int = 40) -> str:
        with contextlib.suppress(OSError, KubeApiServerError):
            return "\n".join(self._path(log_name).read_text(errors="replace").splitlines()[-lines:])
        return ""

    @staticmethod
    def _terminate(process: subprocess.Popen[bytes] | None, timeout_s: float = 20.0) -> None:
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
