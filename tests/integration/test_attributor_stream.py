"""The streaming attributor against the real broker, as a subprocess (``gpumeter attributor``).

Two nodes, four 10 s windows each. Phase 1: pod events and the first ticks; once the first windows are out, the
worker is killed with SIGKILL. Phase 2: the rest of the ticks plus three bad inputs (undecodable bytes, an
impossible tick, a late tick) go in while nothing runs; a second worker (same app id, so same group and
changelogs) restores from the changelogs, works through the backlog and, once caught up, closes the last windows by
its clock. Every node-window must come out with exactly the rows ``attribute_node_window`` gives on the same
input (duplicates from the crash allowed, counted, and identical), and the three bad inputs must be dead letters.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient

from gpumeter.clock import SystemClock
from gpumeter.kafka.producer import RecordProducer
from schemas.catalog import partition_for_node, pod_event_key
from schemas.records import DeadLetter, GpuShare, NodeSample, NodeWindowShares
from schemas.typed import codec_for
from services.attributor.attribution import AttributionPolicy, attribute_node_window
from services.attributor.pod_index import PodIndex, apply_pod_events
from services.attributor.settings import AttributorSettings
from services.attributor.windows import NodeWindow
from tests.unit.attributor import CLUSTER, GIB, device, node_sample, pod_event

pytestmark = pytest.mark.integration

WINDOW_S = 10
GRACE_S = 2
WINDOW_MS = WINDOW_S * 1000
PARTITIONS = 3
NODES = ("gpu-node-a", "gpu-node-b")
READY_LINE = "Worker ready"


def gpumeter_command() -> list[str]:
    script = Path(sys.executable).with_name("gpumeter")
    return [str(script)] if script.exists() else [sys.executable, "-m", "gpumeter.cli"]


class AttributorProcess:
    """One ``gpumeter attributor`` worker; its output goes to a log file kept for failures."""

    def __init__(self, kafka_settings, workdir: Path, name: str, *extra: str) -> None:
        self.log_path = workdir / f"{name}.log"
        self.command = gpumeter_command() + [
            "attributor",
            "--bootstrap-servers", kafka_settings.bootstrap_servers,
            "--topic-prefix", kafka_settings.topic_prefix,
            "--window-seconds", str(WINDOW_S),
            "--grace-seconds", str(GRACE_S),
            "--pod-linger-seconds", "600",
            "--session-timeout-seconds", "6",
            "--metrics-port", "0",
            "--data-dir", str(workdir / f"{name}-data"),
            *extra,
        ]
        self.process: subprocess.Popen | None = None

    def start(self) -> "AttributorProcess":
        log = self.log_path.open("w")
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMETER_")}
        self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    async def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while READY_LINE not in self.log():
            assert self.process is not None and self.process.poll() is None, f"attributor exited:\n{self.log()[-4000:]}"
            assert time.monotonic() < deadline, f"attributor not ready in {timeout_s} s:\n{self.log()[-4000:]}"
            await asyncio.sleep(0.2)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        return self.process.returncode


# ----------------------------------------------------------------------------------------------------------------
# Input


def pods_of(node: str, base_ms: int):
    return [
        pod_event(f"{node}-{p}", node=node, namespace=f"ns-{p}",
                  devices=[("nvidia.com/gpu.shared", [f"GPU-{node}::{i}"])],
                  observed_at_unix_ms=base_ms - 60_000, started_at_unix_ms=base_ms - 120_000,
                  labels={"team": f"team-{p}", "node": node})
        for i, p in enumerate("ab")
    ]


def tick(node: str, base_ms: int, k: int, *, at_ms: int | None = None, used_bytes: int | None = None) -> NodeSample:
    mem_a, mem_b = (3 + (k * 7 + len(node)) % 11) * GIB, (1 + k % 5) * GIB
    sm_a, sm_b = 5 + (k * 3) % 41, 2 + k % 13
    used = mem_a + mem_b + GIB if used_bytes is None else used_bytes
    dev = device(f"GPU-{node}", used=used, util=min(sm_a + sm_b + 10, 100), replicas=2,
                 procs=[(0, mem_a, sm_a), (1, mem_b, sm_b)])
    return node_sample(base_ms + k * 1000 if at_ms is None else at_ms, [dev], node=node,
                       pod_uids=[f"{node}-a", f"{node}-b"], sequence=k, collector_started_at_unix_ms=base_ms - 60_000)


def expected_windows(samples, pods) -> dict[tuple[str, int], tuple[GpuShare, ...]]:
    # The pod state as ``gpumeter attributor`` keeps it by default: only the grouping labels (team, model).
    index = apply_pod_events(PodIndex.empty(600_000, AttributorSettings().engine_config().pod_fields), pods)
    groups: dict[tuple[str, int], list[NodeSample]] = {}
    for s in samples:
        groups.setdefault((s.node_name, s.sampled_at_unix_ms // WINDOW_MS * WINDOW_MS), []).append(s)
    result = {}
    for (node, start), group in groups.items():
        group.sort(key=lambda s: (s.sampled_at_unix_ms, s.collector_started_at_unix_ms, s.sequence))
        result[(node, start)] = attribute_node_window(NodeWindow(CLUSTER, node, start, WINDOW_S, tuple(group)), index,
                                                      AttributionPolicy())
    return result


# ----------------------------------------------------------------------------------------------------------------
# Output


class Outputs:
    """Everything on the node-window-shares (as rows) and dead-letters topics, read continuously from the
    beginning."""

    def __init__(self, kafka_settings, catalog, group_id: str) -> None:
        self.catalog = catalog
        self.consumer = AIOKafkaConsumer(catalog.node_window_shares, catalog.dead_letters,
                                         **kafka_settings.client_kwargs(),
                                         group_id=group_id, auto_offset_reset="earliest", enable_auto_commit=False)
        self.shares: list[GpuShare] = []
        self.dead_letters: list[DeadLetter] = []
        self.share_keys: set[bytes] = set()

    async def poll_until(self, done, timeout_s: float, what: str, logs=lambda: "") -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, f"timed out waiting for {what}\n{logs()[-6000:]}"
            batch = await self.consumer.getmany(timeout_ms=100)
            for tp, records in batch.items():
                for record in records:
                    if tp.topic == self.catalog.node_window_shares:
                        window = codec_for(NodeWindowShares).decode(record.value)
                        assert record.key == window.node_name.encode()
                        self.shares.extend(window.rows())
                    else:
                        self.dead_letters.append(codec_for(DeadLetter).decode(record.value))

    async def drain(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        await self.poll_until(lambda: time.monotonic() >= deadline, seconds + 5, "the drain")

    def emissions(self, expected) -> dict[tuple[str, int], list[tuple[GpuShare, ...]]]:
        """Rows per node-window, cut into emissions of the expected length (in arrival order)."""
        rows: dict[tuple[str, int], list[GpuShare]] = {}
        for share in self.shares:
            rows.setdefault((share.node_name, share.window_start_unix_ms), []).append(share)
        result = {}
        for key, got in rows.items():
            size = len(expected[key]) if key in expected else len(got)
            result[key] = [tuple(got[i:i + size]) for i in range(0, len(got), size)]
        return result


async def _produce(producer: RecordProducer, catalog, items) -> dict[int, int]:
    """Send (topic, key, record-or-bytes, node) items in order; returns id(item) -> offset."""
    offsets = {}
    for topic, key, payload, node in items:
        partition = partition_for_node(node, PARTITIONS)
        if isinstance(payload, bytes):
            future = await producer.send_bytes(topic, payload, key=key, partition=partition)
        else:
            future = await producer.send(topic, payload, key=key, partition=partition)
        offsets[id(payload)] = (await future).offset
    await producer.flush()
    return offsets


async def test_shares_through_the_broker_equal_direct_attribution_across_a_crash(kafka_settings, topic_catalog,
                                                                                 group_id, tmp_path):
    now_ms = SystemClock().now_ms()
    base = now_ms // WINDOW_MS * WINDOW_MS - 4 * WINDOW_MS  # four whole windows, all in the recent past
    pods = [p for n in NODES for p in pods_of(n, base)]
    first_ticks = [tick(n, base, k) for k in range(25) for n in NODES]
    rest_ticks = [tick(n, base, k) for k in range(25, 30) for n in NODES]
    closing_ticks = [tick(n, base, 32) for n in NODES]  # W2 + grace: closes the third window; alone in the fourth
    garbage = b"not avro at all"
    impossible = tick("gpu-node-b", base, 100, at_ms=base + 25_500, used_bytes=81 * GIB)  # used > 80 GiB total
    late = tick("gpu-node-a", base, 101, at_ms=base + 500)  # first window, long closed
    good_samples = first_ticks + rest_ticks + closing_ticks
    expected = expected_windows(good_samples, pods)
    assert sorted(expected) == sorted((n, base + w * WINDOW_MS) for n in NODES for w in range(4))

    samples_topic, pods_topic = topic_catalog.node_samples, topic_catalog.pod_events
    producer = RecordProducer(kafka_settings)
    outputs = Outputs(kafka_settings, topic_catalog, group_id)
    await producer.start()
    await outputs.consumer.start()
    first = AttributorProcess(kafka_settings, tmp_path, "first", "--idle-close-seconds", "600")
    second = AttributorProcess(kafka_settings, tmp_path, "second", "--idle-close-seconds", "1")
    try:
        # Phase 1: the first worker, pods, then the first 25 ticks of each node.
        first.start()
        await first.wait_ready(45)
        await _produce(producer, topic_catalog, [(pods_topic, pod_event_key(p.node_name, p.uid), p, p.node_name)
                                                 for p in pods])
        await asyncio.sleep(1.0)  # pods ahead of samples, as a running collector has them
        await _produce(producer, topic_catalog, [(samples_topic, s.node_name.encode(), s, s.node_name)
                                                 for s in first_ticks])
        # Killed as soon as the first rows show: the worker is mid-run, further windows are closing or open.
        await outputs.poll_until(lambda: bool(outputs.shares), 30, "the first shares", first.log)
        first.kill()

        # Phase 2, while nothing runs: the rest, with three bad inputs among it.
        phase2 = [(samples_topic, b"gpu-node-a", garbage, "gpu-node-a")]
        phase2 += [(samples_topic, s.node_name.encode(), s, s.node_name) for s in rest_ticks[:6]]
        phase2 += [(samples_topic, b"gpu-node-b", impossible, "gpu-node-b"),
                   (samples_topic, b"gpu-node-a", late, "gpu-node-a")]
        phase2 += [(samples_topic, s.node_name.encode(), s, s.node_name) for s in rest_ticks[6:] + closing_ticks]
        offsets = await _produce(producer, topic_catalog, phase2)

        second.start()

        def complete() -> bool:
            got = outputs.emissions(expected)
            return set(expected) <= set(got) and len(outputs.dead_letters) >= 3

        await outputs.poll_until(complete, 60, "every window and the dead letters", second.log)
        await outputs.drain(2.0)  # a moment more, so that a stray extra output would show below
        assert second.stop() == 0, second.log()[-4000:]
    finally:
        first.kill()
        second.kill()
        await outputs.consumer.stop()
        await producer.stop()

    emissions = outputs.emissions(expected)
    assert set(emissions) == set(expected), sorted(set(emissions) ^ set(expected))
    duplicates = 0
    for key, rows in expected.items():
        assert emissions[key], key
        for emission in emissions[key]:
            assert emission == rows, key  # a re-emission after the crash is the same window, whole
        duplicates += len(emissions[key]) - 1
    print(f"node-windows re-emitted after the crash: {duplicates}")
    # Pods' names and labels travelled with the shares.
    pod_rows = [s for s in outputs.shares if s.pod_uid is not None]
    assert {(s.pod_uid, s.namespace, s.labels["team"]) for s in pod_rows} == {
        (f"{n}-{p}", f"ns-{p}", f"team-{p}") for n in NODES for p in "ab"
    }

    letters = {d.reason_code: d for d in outputs.dead_letters}
    assert len(outputs.dead_letters) == 3, [(d.reason_code, d.reason) for d in outputs.dead_letters]
    wanted = {"CORRUPT": (garbage, garbage), "OUT_OF_RANGE": (impossible, codec_for(NodeSample).encode(impossible)),
              "LATE": (late, codec_for(NodeSample).encode(late))}
    assert set(letters) == set(wanted), [(d.reason_code, d.reason) for d in outputs.dead_letters]
    for reason_code, (payload, raw) in wanted.items():
        letter = letters[reason_code]
        assert (letter.raw_bytes, letter.source_topic, letter.source_offset, letter.service) == (
            raw, samples_topic, offsets[id(payload)], "attributor"), reason_code
        assert letter.source_partition == partition_for_node(letter.source_key.decode(), PARTITIONS)

    # The changelog topics exist (gpumeter attributor creates them before Faust subscribes) on a broker that
    # creates none by itself.
    admin = AIOKafkaAdminClient(**kafka_settings.client_kwargs())
    await admin.start()
    try:
        topics = set(await admin.list_topics())
    finally:
        await admin.close()
    app_id = f"{kafka_settings.topic_prefix}gpumeter-attributor"
    assert {f"{app_id}-open_samples-changelog", f"{app_id}-pods-changelog"} <= topics
