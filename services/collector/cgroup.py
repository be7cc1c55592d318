"""PID → Kubernetes pod and container, from ``/proc/<pid>/cgroup``.

NVML reports host PIDs of the processes on a GPU; the kubelet puts every container in a cgroup whose path names
the pod UID and the container id. This module reads that path back. It understands:

* cgroup v2 (one ``0::<path>`` line) and v1 (several ``N:controllers:<path>`` lines; hybrid hosts have both);
* the systemd driver: ``/kubepods.slice/kubepods-<qos>.slice/kubepods-<qos>-pod<uid with _>.slice/<scope>``
  and, for guaranteed pods, ``/kubepods.slice/kubepods-pod<uid>.slice/<scope>``, with container scopes
  ``cri-containerd-<cid>.scope`` (containerd), ``crio-<cid>.scope`` (CRI-O) and ``docker-<cid>.scope`` (docker);
* the systemd driver's ``<pod slice>:<cri-containerd|crio|docker>:<cid>`` unit name used as a literal directory
  (``/system.slice/containerd.service/kubepods-burstable-pod<uid>.slice:cri-containerd:<cid>``), seen on nested
  and some cgroup v1 hosts;
* the cgroupfs driver: ``/kubepods/<qos>/pod<uid>/<cid>`` and ``/kubepods/pod<uid>/<cid>`` (guaranteed), where
  the leaf is a bare id (containerd, docker: runtime unknown) or ``crio-<cid>`` (CRI-O);
* any prefix before the kubepods hierarchy: a kubelet ``--cgroup-root`` (kind's ``/kubelet.slice/kubelet-kubepods
  .slice/kubelet-kubepods-<qos>.slice/kubelet-kubepods-<qos>-pod<uid>.slice/...``), a nested runtime
  (``/system.slice/containerd.service/kubepods-...``) and the ``/../..`` a private cgroup namespace shows for
  processes outside it (the collector's own container usually has one).

Pod UIDs are returned in the API's dashed lowercase form (systemd slice names carry ``_`` for ``-``). A UID must be
a UUID: the dashed 8-4-4-4-12 form, or the 32-hex form the kubelet gives static pods (an md5 of the manifest; the
mirror pod in the API has another UID, so match static pods by container id). Container ids are 64 lowercase hex,
as in ``status.containerStatuses[].containerID`` after the ``<runtime>://`` prefix.

Parsing never raises: text that names no pod gives ``None``.
"""

from __future__ import annotations

import errno
import os
import re
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from gpumeter.errors import GpumeterError

QOS_GUARANTEED = "guaranteed"
QOS_BURSTABLE = "burstable"
QOS_BESTEFFORT = "besteffort"

RUNTIME_CONTAINERD = "containerd"
RUNTIME_CRIO = "cri-o"
RUNTIME_DOCKER = "docker"

_DASHED_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_STATIC_POD_UID = re.compile(r"[0-9a-f]{32}")
_CONTAINER_ID = re.compile(r"[0-9a-f]{64}")

# systemd driver pod slice. The optional prefix covers a --cgroup-root ("kubelet-kubepods-...").
_SYSTEMD_POD_SLICE = re.compile(r"(?:[A-Za-z0-9_.-]*-)?kubepods(?:-(burstable|besteffort))?-pod([0-9A-Za-z_-]+)\.slice")
# The systemd driver's unit name "<pod slice>:<prefix>:<cid>" used literally as a directory, which is what hosts
# show when the runtime could not hand the cgroup to systemd (nested/kind nodes, some cgroup v1 hosts).
_SYSTEMD_UNIT_PREFIXES = {"cri-containerd": RUNTIME_CONTAINERD, "crio": RUNTIME_CRIO, "docker": RUNTIME_DOCKER}
# cgroupfs driver pod directory; its parent names the QoS class.
_CGROUPFS_POD_DIR = re.compile(r"pod([0-9A-Za-z_-]+)")

# Container leaf under a pod. CRI-O's conmon monitor gets its own "crio-conmon-<cid>" scope beside the
# container's: it belongs to the pod but is not inside the container, so it yields no container id.
_CONTAINER_LEAVES: tuple[tuple[re.Pattern[str], str | None], ...] = (
    (re.compile(r"cri-containerd-([0-9a-f]{64})(?:\.scope)?"), RUNTIME_CONTAINERD),
    (re.compile(r"crio-([0-9a-f]{64})(?:\.scope)?"), RUNTIME_CRIO),
    (re.compile(r"docker-([0-9a-f]{64})(?:\.scope)?"), RUNTIME_DOCKER),
    (re.compile(r"([0-9a-f]{64})"), None),
)

# v1 controllers whose hierarchy the kubelet always manages per container; the unified v2 line (hierarchy 0,
# empty controller list) counts as one of them.
_PREFERRED_V1_CONTROLLERS = frozenset({"pids", "memory", "cpu", "cpuacct"})


@dataclass(frozen=True, slots=True)
class CgroupIdentity:
    """Who a process belongs to, as its cgroup path says.

    ``pod_uid`` is the dashed lowercase pod UID; ``container_id`` 64 lowercase hex or ``None`` for a process in
    the pod's cgroup but no container's (or under CRI-O's conmon); ``qos_class`` one of ``guaranteed``,
    ``burstable``, ``besteffort``; ``runtime`` ``containerd``, ``cri-o``, ``docker``, or ``None`` where the path
    does not say (cgroupfs driver with a bare container id).
    """

    pod_uid: str | None
    container_id: str | None
    qos_class: str | None
    runtime: str | None


class CgroupReadError(GpumeterError):
    """``/proc/<pid>/cgroup`` exists but could not be read (permissions: the collector needs hostPID and root)."""


def _normalise_pod_uid(raw: str) -> str | None:
    candidate = raw.replace("_", "-").lower()
    if _DASHED_UUID.fullmatch(candidate) or _STATIC_POD_UID.fullmatch(candidate):
        return candidate
    return None


def _container_from_leaf(leaf: str) -> tuple[str | None, str | None]:
    """(container_id, runtime) of a pod cgroup's child, or (None, None) when it is not a container cgroup."""
    for pattern, runtime in _CONTAINER_LEAVES:
        match = pattern.fullmatch(leaf)
        if match:
            return match.group(1), runtime
    return None, None


def _parse_colon_unit(part: str) -> CgroupIdentity | None:
    slice_name, _, rest = part.partition(":")
    prefix, _, container_id = rest.partition(":")
    systemd = _SYSTEMD_POD_SLICE.fullmatch(slice_name)
    if systemd is None:
        return None
    pod_uid = _normalise_pod_uid(systemd.group(2))
    if pod_uid is None:
        return None
    runtime = _SYSTEMD_UNIT_PREFIXES.get(prefix)
    if runtime is None or not _CONTAINER_ID.fullmatch(container_id):
        runtime, container_id = None, None
    return CgroupIdentity(
        pod_uid=pod_uid, container_id=container_id, qos_class=systemd.group(1) or QOS_GUARANTEED, runtime=runtime
    )


def parse_cgroup_path(path: str) -> CgroupIdentity | None:
    """The identity one cgroup path names, or ``None`` when it is not a (valid) Kubernetes pod cgroup."""
    parts = [p for p in path.split("/") if p and p not in (".", "..")]
    # The pod component is searched from the leaf upwards: a nested kubepods hierarchy (kind inside a pod)
    # names the innermost pod, which is the one that owns the process.
    for index in range(len(parts) - 1, -1, -1):
        part = parts[index]
        pod_uid: str | None = None
        qos: str | None = None
        if ":" in part:
            colon_identity = _parse_colon_unit(part)
            if colon_identity is not None:
                return colon_identity
            continue
        systemd = _SYSTEMD_POD_SLICE.fullmatch(part)
        if systemd:
            pod_uid = _normalise_pod_uid(systemd.group(2))
            qos = systemd.group(1) or QOS_GUARANTEED
        else:
            cgroupfs = _CGROUPFS_POD_DIR.fullmatch(part)
            if cgroupfs and index >= 1:
                parent = parts[index - 1]
                if parent in (QOS_BURSTABLE, QOS_BESTEFFORT) and index >= 2 and parts[index - 2] == "kubepods":
                    qos = parent
                elif parent == "kubepods":
                    qos = QOS_GUARANTEED
                if qos is not None:
                    pod_uid = _normalise_pod_uid(cgroupfs.group(1))
        if pod_uid is None:
            continue
        container_id: str | None = None
        runtime: str | None = None
        if index + 1 < len(parts):
            container_id, runtime = _container_from_leaf(parts[index + 1])
        return CgroupIdentity(pod_uid=pod_uid, container_id=container_id, qos_class=qos, runtime=runtime)
    return None


def parse_cgroup(text: str) -> CgroupIdentity | None:
    """The pod/container a ``/proc/<pid>/cgroup`` text names, or ``None`` when no line names a pod.

    Of several lines (cgroup v1, hybrid) the one naming a container wins over one naming only a pod, and a
    pids/memory/cpu (or unified) line wins over other controllers. Malformed lines are skipped; never raises.
    """
    best: CgroupIdentity | None = None
    best_rank = (-1, -1)
    for line in text.splitlines():
        fields = line.strip().split(":", 2)
        if len(fields) != 3 or not fields[0].isdigit():
            continue
        hierarchy, controllers, path = fields
        identity = parse_cgroup_path(path)
        if identity is None:
            continue
        controller_set = {c.strip() for c in controllers.split(",")}
        preferred = (hierarchy == "0" and controllers == "") or bool(controller_set & _PREFERRED_V1_CONTROLLERS)
        rank = (int(identity.container_id is not None), int(preferred))
        if rank > best_rank:
            best, best_rank = identity, rank
    return best


def _exited(exc: OSError) -> bool:
    # ESRCH: the /proc entry vanished while being read; ENOENT/ENOTDIR: it was already gone.
    return isinstance(exc, (FileNotFoundError, ProcessLookupError, NotADirectoryError)) or exc.errno in (
        errno.ESRCH,
        errno.ENOENT,
    )


# Both files are a few hundred bytes; one read usually returns all of it.
_READ_CHUNK_BYTES = 4096


def _read_file(path: str) -> bytes:
    """The whole file at ``path``, through ``os.open``/``os.read``: per process per tick, pathlib's path objects
    and buffered file object cost more than the read itself. Raises ``OSError`` like ``open`` does."""
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.read(fd, _READ_CHUNK_BYTES)
        if len(data) < _READ_CHUNK_BYTES:
            # procfs and local files only return a short read at the end of the file.
            return data
        chunks = [data]
        while chunk := os.read(fd, _READ_CHUNK_BYTES):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_process_identity(pid: int, proc_root: str | os.PathLike[str] = "/proc") -> CgroupIdentity | None:
    """The identity of host process ``pid``; ``None`` when it names no pod or the process has exited.

    Raises ``CgroupReadError`` when the file exists but cannot be read.
    """
    try:
        raw = _read_file(f"{os.fspath(proc_root)}/{pid}/cgroup")
    except OSError as exc:
        if _exited(exc):
            return None
        raise CgroupReadError(f"cannot read cgroup of pid {pid}: {exc}") from exc
    return parse_cgroup(raw.decode("utf-8", errors="replace"))


def read_process_start_ticks(pid: int, proc_root: str | os.PathLike[str] = "/proc") -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (start time in clock ticks since boot), ``None`` when unreadable.

    Together with the PID it names one process for the life of the host: PIDs are reused, start times are not.
    """
    try:
        raw = _read_file(f"{os.fspath(proc_root)}/{pid}/stat")
    except OSError:
        return None
    text = raw.decode("utf-8", errors="replace")
    # comm (field 2) is in parentheses and may itself hold spaces and parentheses: split after the last ')'.
    close = text.rfind(")")
    if close < 0:
        return None
    fields = text[close + 1 :].split()
    # fields[0] is field 3 (state), so field 22 is fields[19].
    if len(fields) < 20 or not fields[19].isdigit():
        return None
    return int(fields[19])


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Counters of a ``ProcessIdentityCache`` since it was made."""

    hits: int
    misses: int
    uncacheable: int
    evictions: int
    size: int


class ProcessIdentityCache:
    """A bounded LRU of ``read_process_identity`` results keyed by (pid, start time).

    The key's start time makes a reused PID a new entry. A process whose start time cannot be read is looked up
    afresh each time and not stored, since a stale answer for a reused PID would be wrong. ``None`` results
    (host processes) are cached like any other. Not thread-safe: one collector loop owns it.
    """

    def __init__(self, proc_root: str | os.PathLike[str] = "/proc", max_entries: int = 4096) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        # A str, converted once: the reads build their paths from it on every lookup.
        self._proc_root = os.fspath(proc_root)
        self._max_entries = max_entries
        self._entries: OrderedDict[tuple[int, int], CgroupIdentity | None] = OrderedDict()
        self._hits = 0
        self._misses = 0
        self._uncacheable = 0
        self._evictions = 0

    def lookup(self, pid: int) -> CgroupIdentity | None:
        """The identity of ``pid`` (see ``read_process_identity``, including its ``CgroupReadError``), from the
        cache when this very process (same start time) was looked up before."""
        start_ticks = read_process_start_ticks(pid, self._proc_root)
        if start_ticks is None:
            self._uncacheable += 1
            return read_process_identity(pid, self._proc_root)
        key = (pid, start_ticks)
        if key in self._entries:
            self._hits += 1
            self._entries.move_to_end(key)
            return self._entries[key]
        self._misses += 1
        identity = read_process_identity(pid, self._proc_root)
        # Re-check: a process that exited between the two reads must not leave an entry behind.
        if read_process_start_ticks(pid, self._proc_root) != start_ticks:
            return identity
        self._entries[key] = identity
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)
            self._evictions += 1
        return identity

    def retain_only(self, pids: Iterable[int]) -> int:
        """Drop entries of PIDs not in ``pids`` (those seen this tick); returns how many were dropped."""
        keep = set(pids)
        stale = [key for key in self._entries if key[0] not in keep]
        for key in stale:
            del self._entries[key]
        return len(stale)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def stats(self) -> CacheStats:
        return CacheStats(
            hits=self._hits,
            misses=self._misses,
            uncacheable=self._uncacheable,
            evictions=self._evictions,
            size=len(self._entries),
        )
