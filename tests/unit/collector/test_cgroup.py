"""PID → pod/container from /proc/<pid>/cgroup: every path form the kubelet and runtimes produce, and fuzz."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.collector.cgroup import (
    CgroupIdentity,
    CgroupReadError,
    ProcessIdentityCache,
    parse_cgroup,
    parse_cgroup_path,
    read_process_identity,
    read_process_start_ticks,
)

UID = "6b0b2a52-3c4e-4f7a-9d21-0e5f1c2b3a4d"
CID = "3f4e5d6c7b8a9f0e1d2c3b4a5f6e7d8c9b0a1f2e3d4c5b6a7f8e9d0c1b2a3f4e"
OTHER_CID = "a" * 64


def _us(uid: str) -> str:
    return uid.replace("-", "_")


# (name, cgroup path built from UID/CID, qos, runtime, names a container)
PATH_FORMS = [
    (
        "systemd burstable containerd",
        f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{_us(UID)}.slice/cri-containerd-{CID}.scope",
        "burstable",
        "containerd",
        True,
    ),
    (
        "systemd besteffort containerd",
        f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{_us(UID)}.slice/cri-containerd-{CID}.scope",
        "besteffort",
        "containerd",
        True,
    ),
    (
        "systemd guaranteed containerd",
        f"/kubepods.slice/kubepods-pod{_us(UID)}.slice/cri-containerd-{CID}.scope",
        "guaranteed",
        "containerd",
        True,
    ),
    (
        "systemd burstable cri-o",
        f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{_us(UID)}.slice/crio-{CID}.scope",
        "burstable",
        "cri-o",
        True,
    ),
    (
        "systemd guaranteed docker",
        f"/kubepods.slice/kubepods-pod{_us(UID)}.slice/docker-{CID}.scope",
        "guaranteed",
        "docker",
        True,
    ),
    (
        "systemd pod cgroup only",
        f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{_us(UID)}.slice",
        "burstable",
        None,
        False,
    ),
    (
        "systemd cri-o conmon is the pod's, not the container's",
        f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{_us(UID)}.slice/crio-conmon-{CID}.scope",
        "besteffort",
        None,
        False,
    ),
    ("cgroupfs burstable", f"/kubepods/burstable/pod{UID}/{CID}", "burstable", None, True),
    ("cgroupfs besteffort", f"/kubepods/besteffort/pod{UID}/{CID}", "besteffort", None, True),
    ("cgroupfs guaranteed", f"/kubepods/pod{UID}/{CID}", "guaranteed", None, True),
    ("cgroupfs cri-o", f"/kubepods/burstable/pod{UID}/crio-{CID}", "burstable", "cri-o", True),
    ("cgroupfs pod only", f"/kubepods/besteffort/pod{UID}", "besteffort", None, False),
    (
        "kind systemd cgroup-root kubelet",
        f"/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
        f"kubelet-kubepods-besteffort-pod{_us(UID)}.slice/cri-containerd-{CID}.scope",
        "besteffort",
        "containerd",
        True,
    ),
    (
        "kind guaranteed under kubelet root",
        f"/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-pod{_us(UID)}.slice/cri-containerd-{CID}.scope",
        "guaranteed",
        "containerd",
        True,
    ),
    (
        "nested under containerd.service, colon unit name",
        f"/system.slice/containerd.service/kubepods-burstable-pod{_us(UID)}.slice:cri-containerd:{CID}",
        "burstable",
        "containerd",
        True,
    ),
    (
        "colon unit name, guaranteed, kuberuntime.slice",
        f"/kuberuntime.slice/containerd.service/kubepods-pod{_us(UID)}.slice:cri-containerd:{CID}",
        "guaranteed",
        "containerd",
        True,
    ),
    (
        "colon unit name at the root (v1 controller view)",
        f"/kubepods-besteffort-pod{_us(UID)}.slice:crio:{CID}",
        "besteffort",
        "cri-o",
        True,
    ),
    (
        "nested runtime prefix, container scope",
        f"/system.slice/containerd.service/kubepods.slice/kubepods-burstable.slice/"
        f"kubepods-burstable-pod{_us(UID)}.slice/cri-containerd-{CID}.scope",
        "burstable",
        "containerd",
        True,
    ),
    ("kind cgroupfs root", f"/kubelet/kubepods/burstable/pod{UID}/{CID}", "burstable", None, True),
    (
        "private cgroup namespace shows ../",
        f"/../../../kubepods-besteffort.slice/kubepods-besteffort-pod{_us(UID)}.slice/cri-containerd-{CID}.scope",
        "besteffort",
        "containerd",
        True,
    ),
    (
        "trailing slash",
        f"/kubepods.slice/kubepods-pod{_us(UID)}.slice/cri-containerd-{CID}.scope/",
        "guaranteed",
        "containerd",
        True,
    ),
]


@pytest.mark.parametrize(("name", "path", "qos", "runtime", "has_container"), PATH_FORMS, ids=[f[0] for f in PATH_FORMS])
def test_cgroup_v2_path_forms(name, path, qos, runtime, has_container):
    identity = parse_cgroup(f"0::{path}\n")
    assert identity == CgroupIdentity(
        pod_uid=UID, container_id=CID if has_container else None, qos_class=qos, runtime=runtime
    )


@pytest.mark.parametrize(("name", "path", "qos", "runtime", "has_container"), PATH_FORMS, ids=[f[0] for f in PATH_FORMS])
def test_cgroup_v1_lines_give_the_same_identity(name, path, qos, runtime, has_container):
    text = "\n".join(
        [
            f"12:pids:{path}",
            f"11:memory:{path}",
            f"10:cpu,cpuacct:{path}",
            "9:rdma:/",
            f"1:name=systemd:{path}",
        ]
    )
    assert parse_cgroup(text) == parse_cgroup(f"0::{path}")


def test_v1_prefers_line_naming_container_over_pod_only_line():
    pod_only = f"/kubepods/burstable/pod{UID}"
    with_container = f"/kubepods/burstable/pod{UID}/{CID}"
    text = f"5:cpu,cpuacct:{pod_only}\n4:devices:{with_container}\n3:freezer:/\n"
    assert parse_cgroup(text).container_id == CID


def test_v1_prefers_pids_memory_cpu_over_other_controllers():
    # Same level of detail, different containers: the pids line decides.
    text = (
        f"7:devices:/kubepods/pod{UID}/{OTHER_CID}\n"
        f"6:pids:/kubepods/pod{UID}/{CID}\n"
        f"2:blkio:/kubepods/pod{UID}/{OTHER_CID}\n"
    )
    assert parse_cgroup(text).container_id == CID


def test_v1_uses_any_line_that_names_a_pod():
    text = f"12:pids:/\n11:memory:/user.slice\n3:perf_event:/kubepods/besteffort/pod{UID}/{CID}\n"
    assert parse_cgroup(text) == CgroupIdentity(UID, CID, "besteffort", None)


def test_hybrid_host_with_unified_line():
    path = f"/kubepods.slice/kubepods-pod{_us(UID)}.slice/cri-containerd-{CID}.scope"
    text = f"12:pids:{path}\n1:name=systemd:{path}\n0::{path}\n"
    assert parse_cgroup(text) == CgroupIdentity(UID, CID, "guaranteed", "containerd")


@pytest.mark.parametrize(
    "text",
    [
        "",
        "0::/\n",
        "0::/system.slice/sshd.service\n",
        "0::/user.slice/user-1000.slice/session-3.scope\n",
        "0::/init.scope\n",
        "12:pids:/docker/" + CID + "\n",
        "0::/kubepods.slice\n",
        "0::/kubepods.slice/kubepods-burstable.slice\n",
        "0::/kubepods/burstable\n",
    ],
)
def test_processes_outside_pods_give_none(text):
    assert parse_cgroup(text) is None


def test_pod_uid_underscores_become_dashes():
    identity = parse_cgroup_path(f"/kubepods.slice/kubepods-pod{_us(UID)}.slice")
    assert identity.pod_uid == UID
    assert "_" not in identity.pod_uid


def test_static_pod_hash_uid_is_accepted():
    static_uid = uuid.uuid5(uuid.NAMESPACE_DNS, "kube-apiserver").hex
    identity = parse_cgroup(f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{static_uid}.slice/cri-containerd-{CID}.scope")
    assert identity == CgroupIdentity(static_uid, CID, "burstable", "containerd")


@pytest.mark.parametrize(
    "bad_uid",
    [
        "not-a-uid",
        UID[:-1],
        UID + "0",
        UID.replace("6b0b", "6g0b"),
        "12345",
        "",
    ],
)
def test_invalid_pod_uid_gives_none(bad_uid):
    assert parse_cgroup(f"0::/kubepods/pod{bad_uid}/{CID}") is None
    assert parse_cgroup(f"0::/kubepods.slice/kubepods-pod{_us(bad_uid)}.slice/cri-containerd-{CID}.scope") is None


@pytest.mark.parametrize("bad_cid", [CID[:-1], CID + "0", CID.upper(), CID[:-1] + "g", "sandbox"])
def test_invalid_container_id_keeps_pod_but_no_container(bad_cid):
    for leaf in (f"cri-containerd-{bad_cid}.scope", bad_cid, f"crio-{bad_cid}"):
        identity = parse_cgroup(f"0::/kubepods/burstable/pod{UID}/{leaf}")
        assert identity == CgroupIdentity(UID, None, "burstable", None)


def test_colon_unit_with_bad_container_id_keeps_pod():
    slice_name = f"kubepods-burstable-pod{_us(UID)}.slice"
    assert parse_cgroup(f"0::/{slice_name}:cri-containerd:{CID[:-2]}") == CgroupIdentity(UID, None, "burstable", None)
    assert parse_cgroup(f"0::/{slice_name}:runc:{CID}") == CgroupIdentity(UID, None, "burstable", None)
    assert parse_cgroup(f"0::/kubepods-burstable-podnotauid.slice:cri-containerd:{CID}") is None


def test_garbage_lines_are_skipped():
    text = "\n".join(
        [
            "garbage",
            ":::",
            "x:pids:/kubepods/pod" + UID + "/" + OTHER_CID,
            "\x00\xff",
            f"0::/kubepods/pod{UID}/{CID}",
            "12",
        ]
    )
    assert parse_cgroup(text) == CgroupIdentity(UID, CID, "guaranteed", None)


def test_cgroupfs_pod_dir_needs_kubepods_parent():
    assert parse_cgroup(f"0::/something/pod{UID}/{CID}") is None
    assert parse_cgroup(f"0::/other/burstable/pod{UID}/{CID}") is None


_TOKENS = st.sampled_from(
    [
        "/", ":", "0", "12", "::", "\n", "kubepods", ".slice", ".scope", "-pod", "pod", "_", "-", "burstable",
        "besteffort", "cri-containerd-", "crio-", "docker-", "..", UID, _us(UID), CID, "kubepods-", "pids",
        "memory", "cpu,cpuacct", "name=systemd", "\x00", "é", ":cri-containerd:", ":crio:",
    ]
)


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_random_text_never_raises(text):
    result = parse_cgroup(text)
    assert result is None or isinstance(result, CgroupIdentity)


@settings(max_examples=300, deadline=None)
@given(st.lists(_TOKENS, max_size=40).map("".join))
def test_near_miss_text_never_raises_and_any_result_is_valid(text):
    result = parse_cgroup(text)
    if result is not None:
        assert result.pod_uid is not None and uuid.UUID(result.pod_uid)
        assert result.qos_class in ("guaranteed", "burstable", "besteffort")
        assert result.container_id is None or (
            len(result.container_id) == 64 and set(result.container_id) <= set("0123456789abcdef")
        )


@settings(max_examples=150, deadline=None)
@given(
    pod_uuid=st.uuids(),
    cid_bytes=st.binary(min_size=32, max_size=32),
    qos=st.sampled_from(["guaranteed", "burstable", "besteffort"]),
    leaf_form=st.sampled_from(["cri-containerd-{}.scope", "crio-{}.scope", "docker-{}.scope"]),
    prefix=st.sampled_from(["", "/kubelet.slice/kubelet-kubepods.slice", "/../..", "/system.slice/containerd.service"]),
)
def test_systemd_paths_round_trip(pod_uuid, cid_bytes, qos, leaf_form, prefix):
    uid = str(pod_uuid)
    cid = cid_bytes.hex()
    kubepods = "kubelet-kubepods" if prefix.startswith("/kubelet.slice") else "kubepods"
    if qos == "guaranteed":
        pod_path = f"{prefix}/{kubepods}.slice/{kubepods}-pod{_us(uid)}.slice"
    else:
        pod_path = f"{prefix}/{kubepods}.slice/{kubepods}-{qos}.slice/{kubepods}-{qos}-pod{_us(uid)}.slice"
    identity = parse_cgroup(f"0::{pod_path}/{leaf_form.format(cid)}\n")
    runtime = {"cri-containerd-": "containerd", "crio-": "cri-o", "docker-": "docker"}[leaf_form.split("{")[0]]
    assert identity == CgroupIdentity(uid, cid, qos, runtime)


# ---- reading /proc ----


def _fake_proc(root: Path, pid: int, cgroup_text: str | None, start_ticks: int | None, comm: str = "python") -> None:
    proc = root / str(pid)
    proc.mkdir(parents=True, exist_ok=True)
    if cgroup_text is not None:
        (proc / "cgroup").write_text(cgroup_text)
    if start_ticks is not None:
        # Fields 3..21 are placeholders; field 22 is the start time.
        fields = ["S"] + [str(n) for n in range(4, 22)] + [str(start_ticks)] + ["0"] * 30
        (proc / "stat").write_text(f"{pid} ({comm}) " + " ".join(fields) + "\n")


def _line(uid: str, cid: str) -> str:
    return f"0::/kubepods.slice/kubepods-pod{_us(uid)}.slice/cri-containerd-{cid}.scope\n"


def test_read_process_identity_from_proc_root(tmp_path):
    _fake_proc(tmp_path, 4242, _line(UID, CID), 1000)
    assert read_process_identity(4242, tmp_path) == CgroupIdentity(UID, CID, "guaranteed", "containerd")


def test_exited_process_gives_none(tmp_path):
    assert read_process_identity(999999, tmp_path) is None


def test_unreadable_cgroup_raises_typed_error(tmp_path):
    (tmp_path / "77" / "cgroup").mkdir(parents=True)
    with pytest.raises(CgroupReadError):
        read_process_identity(77, tmp_path)


def test_read_own_process_matches_parse_of_its_file():
    own = Path("/proc/self/cgroup")
    assert read_process_identity(os.getpid()) == parse_cgroup(own.read_text())


@pytest.mark.parametrize("comm", ["python", "my proc", "a) b (c", ")", "((("])
def test_start_ticks_survive_odd_comm(tmp_path, comm):
    _fake_proc(tmp_path, 10, None, 123456789, comm=comm)
    assert read_process_start_ticks(10, tmp_path) == 123456789


def test_start_ticks_of_real_process_are_stable():
    first = read_process_start_ticks(os.getpid())
    assert first is not None and first >= 0
    assert read_process_start_ticks(os.getpid()) == first


def test_start_ticks_missing_or_malformed(tmp_path):
    assert read_process_start_ticks(1, tmp_path) is None
    (tmp_path / "2").mkdir()
    (tmp_path / "2" / "stat").write_text("2 (x) S 1 2")
    assert read_process_start_ticks(2, tmp_path) is None


def test_cache_does_not_reread_cgroup_for_same_process(tmp_path):
    _fake_proc(tmp_path, 100, _line(UID, CID), 5000)
    cache = ProcessIdentityCache(tmp_path)
    first = cache.lookup(100)
    # Rewriting the file proves the second answer came from the cache, not from disk.
    (tmp_path / "100" / "cgroup").write_text(_line(UID, OTHER_CID))
    assert cache.lookup(100) == first
    assert first.container_id == CID
    assert (cache.stats.hits, cache.stats.misses) == (1, 1)


def test_cache_sees_reused_pid_as_new_process(tmp_path):
    _fake_proc(tmp_path, 100, _line(UID, CID), 5000)
    cache = ProcessIdentityCache(tmp_path)
    assert cache.lookup(100).container_id == CID
    other_uid = str(uuid.uuid4())
    _fake_proc(tmp_path, 100, _line(other_uid, OTHER_CID), 9000)
    assert cache.lookup(100) == CgroupIdentity(other_uid, OTHER_CID, "guaranteed", "containerd")
    assert cache.stats.misses == 2


def test_cache_caches_host_processes_too(tmp_path):
    _fake_proc(tmp_path, 1, "0::/init.scope\n", 1)
    cache = ProcessIdentityCache(tmp_path)
    assert cache.lookup(1) is None
    assert cache.lookup(1) is None
    assert (cache.stats.hits, cache.stats.misses, len(cache)) == (1, 1, 1)


def test_cache_without_start_time_reads_fresh_and_stores_nothing(tmp_path):
    _fake_proc(tmp_path, 55, _line(UID, CID), None)
    cache = ProcessIdentityCache(tmp_path)
    assert cache.lookup(55).container_id == CID
    (tmp_path / "55" / "cgroup").write_text(_line(UID, OTHER_CID))
    assert cache.lookup(55).container_id == OTHER_CID
    assert (cache.stats.uncacheable, len(cache)) == (2, 0)


def test_cache_of_exited_process(tmp_path):
    cache = ProcessIdentityCache(tmp_path)
    assert cache.lookup(31337) is None
    assert len(cache) == 0


def test_cache_is_bounded_lru(tmp_path):
    max_entries = 8
    pids = list(range(200, 200 + max_entries + 5))
    for pid in pids:
        _fake_proc(tmp_path, pid, _line(UID, CID), pid * 10)
    cache = ProcessIdentityCache(tmp_path, max_entries=max_entries)
    cache.lookup(pids[0])
    for pid in pids[1:]:
        cache.lookup(pids[0])  # keep the first one recently used
        cache.lookup(pid)
    assert len(cache) == max_entries
    assert cache.stats.evictions == len(pids) - max_entries
    hits_before = cache.stats.hits
    cache.lookup(pids[0])
    assert cache.stats.hits == hits_before + 1
    misses_before = cache.stats.misses
    cache.lookup(pids[1])
    assert cache.stats.misses == misses_before + 1


def test_cache_retain_only_drops_vanished_pids(tmp_path):
    for pid in (1, 2, 3):
        _fake_proc(tmp_path, pid, _line(UID, CID), pid)
    cache = ProcessIdentityCache(tmp_path)
    for pid in (1, 2, 3):
        cache.lookup(pid)
    assert cache.retain_only([2]) == 2
    assert len(cache) == 1


def test_cache_rejects_zero_size():
    with pytest.raises(ValueError):
        ProcessIdentityCache(max_entries=0)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_reads_take_the_root_as_str_or_path_alike(tmp_path):
    _fake_proc(tmp_path, 4242, _line(UID, CID), 1000)
    for root in (tmp_path, str(tmp_path), f"{tmp_path}/"):
        assert read_process_identity(4242, root) == CgroupIdentity(UID, CID, "guaranteed", "containerd")
        assert read_process_start_ticks(4242, root) == 1000
        assert ProcessIdentityCache(root).lookup(4242).container_id == CID


@pytest.mark.parametrize("size_bytes", [4095, 4096, 4097, 8192, 3 * 4096 + 17])
def test_a_cgroup_file_of_any_length_is_read_whole(tmp_path, size_bytes):
    # cgroup v1 hosts list a line per controller; the pod's line comes last, after kilobytes of others.
    pod_line = f"12:pids:/kubepods/burstable/pod{UID}/{CID}\n"
    filler = "".join(f"{n}:controller-{n}:/system.slice/some-daemon-{n:04d}.service\n" for n in range(1, 400))
    head = filler[: size_bytes - len(pod_line) - 1]
    text = head + "\n" + pod_line
    assert len(text.encode()) == size_bytes
    _fake_proc(tmp_path, 88, text, 1)
    assert read_process_identity(88, tmp_path) == CgroupIdentity(UID, CID, "burstable", None)


def test_reads_close_their_file_on_success_and_on_error(tmp_path):
    _fake_proc(tmp_path, 5, _line(UID, CID), 50)
    (tmp_path / "6" / "cgroup").mkdir(parents=True)  # opens, then the read fails (a directory)
    (tmp_path / "6" / "stat").mkdir()
    before = _open_fds()
    for _ in range(50):
        assert read_process_identity(5, tmp_path) is not None
        assert read_process_start_ticks(5, tmp_path) == 50
        with pytest.raises(CgroupReadError):
            read_process_identity(6, tmp_path)
        assert read_process_start_ticks(6, tmp_path) is None
        assert read_process_identity(7, tmp_path) is None
    assert _open_fds() == before


def test_a_vanished_process_reads_as_exited_whatever_the_errno(tmp_path, monkeypatch):
    import errno

    from services.collector import cgroup

    _fake_proc(tmp_path, 9, _line(UID, CID), 90)
    real_read = os.read

    def vanished(fd, size):  # the kernel answers ESRCH when the task exits between open and read
        raise ProcessLookupError(errno.ESRCH, "No such process")

    monkeypatch.setattr(cgroup.os, "read", vanished)
    assert read_process_identity(9, tmp_path) is None
    assert read_process_start_ticks(9, tmp_path) is None
    monkeypatch.setattr(cgroup.os, "read", real_read)
    assert read_process_identity(9, tmp_path) is not None
