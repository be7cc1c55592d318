"""``gpumeter record`` against the real broker: a scenario's input produced to the node-samples and pod-events
topics in bursts, recorded into rotated files, replays as a directory to the bills of the produced messages
themselves, and a later file alone to its windows, its pods known from its snapshot; a recorder stopped cleanly
and started again from its committed offsets, and one killed outright (its open file left ``.partial``), loses
nothing and doubles nothing in the bills.

Time: a frame's time is the message's Kafka timestamp, the broker's LogAppendTime, so in a fast test a burst of
the scenario's messages all fall within a second or two of received time. The recorder rotates every second
(``--rotation-seconds 1``, the smallest) and each burst is produced after the previous one's second has passed:
each burst its own file(s). Bursts are cut at window boundaries of the scenario's own time, so a later file holds
whole windows.

The baseline ("the produced messages directly") is every message on the two topics read back with its Kafka
timestamp into one recording, in replay's order: the same received times and bytes the recorder saw, so the two
replays are exactly comparable -- line for line (see ``_lines`` for why not in the same order).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from gpumeter.kafka.producer import RecordProducer
from pipeline.record import RecordSettings, serve
from pipeline.recording_store import PARTIAL_SUFFIX
from pipeline.recordings import (
    RECORDING_SUFFIX,
    RecordingWriter,
    decode_message,
    encode_message,
    iter_frames,
    scenario_records,
)
from pipeline.recorder import pod_state_of
from pipeline.replay import read_jsonl, replay
from schemas.records import PodEvent
from simulator.scenario import load_scenario
from tests.integration.test_allocation_api import free_port
from tests.integration.test_attributor_stream import gpumeter_command
from tests.integration.test_billing_stream import wait_until_committed_to_end
from tests.integration.test_stream_equals_replay import _produce_as_collected, _shifted_scenario
from tests.integration.topic_reading import end_offsets, read_messages

pytestmark = [pytest.mark.integration]

WINDOW_S, GRACE_S = 10, 2
# A burst reaches the broker up to a few minutes after its ticks were sampled (the scenario, shifted to end just
# before now, is produced in seconds): a collector's buffer draining, to the attributor. Its clock must not close
# those windows before their ticks are read (the default 30 s would, both replays alike, dead-lettering them LATE).
IDLE_CLOSE_S = 600
BURST_MS = 20_000  # scenario time per burst: two whole windows
OUTPUTS = ("bills.jsonl", "costs.jsonl", "shares.jsonl")


def _bursts(scenario_path: Path, burst_ms: int = BURST_MS) -> list[list]:
    """The scenario's input records cut at every ``burst_ms`` of its own time (window boundaries), in order."""
    bursts: dict[int, list] = {}
    for record in scenario_records(load_scenario(scenario_path)):
        bursts.setdefault(record.received_at_unix_ms // burst_ms, []).append(record)
    return [bursts[k] for k in sorted(bursts)]


async def _produce(kafka_settings, catalog, records, *, next_second: bool = True) -> None:
    """``records`` produced as the collector does, acknowledged; then (``next_second``) wait until the broker's
    clock is in the next second, so that what is produced next is appended (LogAppendTime) in a later one-second
    rotation bucket."""
    producer = RecordProducer(kafka_settings)
    await producer.start()
    try:
        for record in records:
            await _produce_as_collected(producer, catalog, record.message, encode_message(record.message))
        await producer.flush()
    finally:
        await producer.stop()
    if next_second:
        await asyncio.sleep(1.02 - time.time() % 1)


def _settings(kafka_settings, out: Path, group: str, **changes) -> RecordSettings:
    values = dict(out_dir=out, kafka=kafka_settings, consumer_group=group, rotation_seconds=1,
                  sync_interval_seconds=0.2, metrics_port=0)
    values.update(changes)
    return RecordSettings(**values)


async def _committed_to_end(kafka_settings, catalog, group: str) -> None:
    for topic in (catalog.node_samples, catalog.pod_events):
        await wait_until_committed_to_end(kafka_settings, group, topic, "the recorder")


async def _record_to_end(kafka_settings, catalog, settings: RecordSettings) -> None:
    """Run the recorder until it has committed both topics to their end, then stop it cleanly (exit code 0)."""
    stop = asyncio.Event()
    task = asyncio.create_task(serve(settings, stop=stop))
    try:
        await _committed_to_end(kafka_settings, catalog, settings.consumer_group)
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 30) == 0


async def _direct_recording(kafka_settings, catalog, path: Path) -> int:
    """Every message on the two topics, with its Kafka timestamp, as one recording in replay's order (time, pod
    events before samples, then partition and offset). Returns how many."""
    frames = []
    for rank, topic in ((0, catalog.pod_events), (1, catalog.node_samples)):
        for message in await read_messages(kafka_settings, topic):
            frames.append((message.timestamp, rank, message.partition, message.offset, message.value))
    frames.sort(key=lambda f: f[:4])
    with RecordingWriter(path, version=2) as writer:
        for timestamp, _rank, _partition, _offset, payload in frames:
            writer.write_frame(timestamp, payload)
    return len(frames)


def _replay(path: Path, out: Path):
    return replay(path, out, window_seconds=WINDOW_S, grace_seconds=GRACE_S, idle_close_seconds=IDLE_CLOSE_S)


def _recorded_files(folder: Path) -> list[Path]:
    return sorted(folder.glob(f"*{RECORDING_SUFFIX}"))


async def test_a_recorded_scenario_replays_as_a_directory_to_the_produced_messages_bills_and_a_later_file_alone(
        kafka_settings, topic_catalog, tmp_path):
    scenario = _shifted_scenario(tmp_path, "two_nodes")
    bursts = _bursts(scenario)
    assert len(bursts) >= 3
    folder = tmp_path / "rec"
    port = free_port()
    settings = _settings(kafka_settings, folder, f"r{uuid.uuid4().hex[:8]}", metrics_port=port,
                         metrics_address="127.0.0.1")
    stop = asyncio.Event()
    recorder = asyncio.create_task(serve(settings, stop=stop))
    try:
        for burst in bursts:  # live: the recorder reads each burst as it comes
            await _produce(kafka_settings, topic_catalog, burst)
        await _committed_to_end(kafka_settings, topic_catalog, settings.consumer_group)
        # What it serves meanwhile: every message read is a frame written (committed to the end: all of them),
        # the files rotated so far, its syncs; and it is alive.
        metrics = await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/metrics")
        health = await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/healthz")
    finally:
        stop.set()
        assert await asyncio.wait_for(recorder, 30) == 0
    produced_count = sum(len(b) for b in bursts)
    assert _sample(metrics, "gpumeter_record_frames_total") == produced_count
    assert _sample(metrics, "gpumeter_record_payload_bytes_total") == sum(
        len(encode_message(r.message)) for b in bursts for r in b)
    assert _sample(metrics, "gpumeter_record_files_finished_total") >= len(bursts) - 1
    assert _sample(metrics, "gpumeter_record_syncs_total") >= 1
    assert sum(v for k, v in _samples(metrics).items()
               if k.startswith("gpumeter_messages_consumed_total{")) == produced_count
    assert json.loads(health)["status"] == "ok", health

    files = _recorded_files(folder)
    assert not list(folder.glob(f"*{PARTIAL_SUFFIX}"))
    assert len(files) >= len(bursts)
    framed = [list(iter_frames(path)) for path in files]
    snapshots = [sum(f.snapshot for f in frames) for frames in framed]
    # Each later file starts with the pod state its predecessor ended with (its snapshot and own pod events, in
    # order), which is what lets it be replayed alone. How many files a burst spans (and so which file opens before
    # the recorder has read any pod event: an empty snapshot, rightly) depends on the broker's clock and the
    # order the two topics are read in; the state each snapshot carries does not.
    assert snapshots[0] == 0 and any(n > 0 for n in snapshots[1:]), snapshots
    for before, frames in zip(framed, framed[1:]):
        expected = sorted(pod_state_of(before).values(), key=lambda f: (f.received_at_unix_ms, f.payload))
        assert [(f.received_at_unix_ms, f.payload) for f in frames if f.snapshot] == [
            (f.received_at_unix_ms, f.payload) for f in expected]

    # The directory replays to the bills, costs and shares of the produced messages themselves, line for line.
    direct = tmp_path / "direct.gmrec"
    produced = await _direct_recording(kafka_settings, topic_catalog, direct)
    assert produced == sum(len(b) for b in bursts)
    expected = _replay(direct, tmp_path / "direct")
    summary = _replay(folder, tmp_path / "dir")
    assert (summary.samples, summary.pod_events) == (expected.samples, expected.pod_events)
    assert expected.bills > 0 and summary.bills == expected.bills
    for name in OUTPUTS:
        assert _lines(tmp_path / "dir" / name) == _lines(tmp_path / "direct" / name), name
    assert _letters(tmp_path / "dir") == _letters(tmp_path / "direct")
    assert set(expected.dead_letters) <= {"NO_PRICE"}  # two_nodes' spot node has no price, in both
    # And they are the bills of the scenario itself (its own clock: the same ticks, the same pods).
    _replay(scenario, tmp_path / "scenario")
    assert sorted(read_jsonl(tmp_path / "dir" / "bills.jsonl"), key=repr) == sorted(
        read_jsonl(tmp_path / "scenario" / "bills.jsonl"), key=repr)

    # A later file alone: nothing refused for want of a pod, and its windows are the run's row for row -- the
    # pods alive at its start (its snapshot) are named (POD rows), not left unattributed.
    later = files[-2]
    snapshot_pods = {decode_message(f.payload).uid for f in iter_frames(later) if f.snapshot}
    alone = _replay(later, tmp_path / "alone")
    assert set(alone.dead_letters) <= {"NO_PRICE"}
    shares = read_jsonl(tmp_path / "alone" / "shares.jsonl")
    windows = {s["window_start_unix_ms"] for s in shares}
    assert shares and windows
    run_shares = read_jsonl(tmp_path / "dir" / "shares.jsonl")
    in_windows = lambda rows: sorted((r for r in rows if r["window_start_unix_ms"] in windows), key=repr)  # noqa
    assert in_windows(shares) == in_windows(run_shares)
    # The rows equal the run's (above): without its snapshot the file alone would have left its pods' use
    # UNATTRIBUTED. A pod alive at rotation but with neither a process nor a device in the file's windows has no
    # row in the run either (which pods those are depends on where the bursts' seconds fell: CI saw one), so the
    # check is that the snapshot named pods that do have rows, and every one of them.
    pod_rows = {s["pod_uid"] for s in shares if s["subject_kind"] == "pod"}
    run_pod_rows = {r["pod_uid"] for r in run_shares
                    if r["window_start_unix_ms"] in windows and r["subject_kind"] == "pod"}
    assert snapshot_pods & pod_rows and snapshot_pods & run_pod_rows <= pod_rows


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def _samples(text: str) -> dict[str, float]:
    """``name{labels}`` (or ``name``) -> value of every sample in a Prometheus exposition."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _sample(text: str, name: str) -> float:
    return _samples(text)[name]


def _lines(path: Path) -> list[bytes]:
    """The lines of an output file, byte for byte, in sorted order: messages of two partitions appended in the same
    millisecond are replayed in the order the recorder read them (which partition first is the fetch's), so windows
    closed by them may come out in another order; every line is the same."""
    return sorted(path.read_bytes().splitlines())


def _letters(out: Path) -> list[tuple[str, str, str]]:
    return sorted((d["service"], d["reason_code"], d["payload_sha256"]) for d in read_jsonl(out / "dead_letters.jsonl"))


class RecorderProcess:
    """``gpumeter record`` as its own process, to be killed outright (SIGKILL: no stop path, no last sync or
    commit). Logs at DEBUG, to a file: the driver's ``batch of N messages`` lines tell what it has read."""

    def __init__(self, kafka_settings, out: Path, group: str, log_path: Path, *extra: str) -> None:
        self.log_path = log_path
        self.command = gpumeter_command() + [
            "record", "--out", str(out), "--group", group,
            "--bootstrap-servers", kafka_settings.bootstrap_servers, "--topic-prefix", kafka_settings.topic_prefix,
            "--log-level", "DEBUG", *extra]
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMETER_")}
        with log_path.open("w") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=env)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def messages_read(self) -> int:
        return sum(int(n) for n in re.findall(r"recorder: batch of (\d+) messages", self.log()))

    async def wait_read(self, count: int, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.messages_read() < count:
            assert self.process.poll() is None, f"the recorder exited:\n{self.log()[-4000:]}"
            assert time.monotonic() < deadline, f"the recorder did not read {count} messages:\n{self.log()[-4000:]}"
            await asyncio.sleep(0.1)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)


async def _committed(kafka_settings, group: str, topics) -> dict[tuple[str, int], int]:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(**kafka_settings.client_kwargs())
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(group)
    finally:
        await admin.close()
    return {(tp.topic, tp.partition): meta.offset for tp, meta in offsets.items() if tp.topic in topics}


async def _ends(kafka_settings, topics) -> dict[tuple[str, int], int]:
    return {(topic, p): end for topic in topics for p, end in (await end_offsets(kafka_settings, topic)).items()
            if end > 0}


async def test_a_recorder_stopped_or_killed_and_started_again_from_its_commit_loses_and_doubles_nothing(
        kafka_settings, topic_catalog, tmp_path):
    """Hourly files (the default rotation): each start is a new part. Stopped cleanly twice (everything read is
    committed at stop), then killed with SIGKILL between a sync (its open file fsynced, its offsets committed) and
    the next one, after it read more: the restart salvages the ``.partial`` file's synced frames, reads again
    from the commit, and the directory replays to the produced messages' bills, line for line."""
    scenario = _shifted_scenario(tmp_path, "two_nodes")
    bursts = _bursts(scenario, 10_000)
    assert len(bursts) >= 6
    folder = tmp_path / "rec"
    group = f"r{uuid.uuid4().hex[:8]}"
    topics = (topic_catalog.node_samples, topic_catalog.pod_events)
    settings = _settings(kafka_settings, folder, group, rotation_seconds=3600)

    # Stopped cleanly, twice, new input produced while it was down: --from committed starts where it stopped.
    for part, burst_group in enumerate((bursts[0] + bursts[1], bursts[2])):
        await _produce(kafka_settings, topic_catalog, burst_group, next_second=False)
        await _record_to_end(kafka_settings, topic_catalog, settings)
        assert await _committed(kafka_settings, group, topics) == await _ends(kafka_settings, topics)
        assert len(_recorded_files(folder)) == part + 1 and not list(folder.glob(f"*{PARTIAL_SUFFIX}"))

    # Killed: a sync and commit after it read bursts[3], then bursts[4] read (into the open file's buffers).
    await _produce(kafka_settings, topic_catalog, bursts[3], next_second=False)
    synced = await _ends(kafka_settings, topics)
    killed = RecorderProcess(kafka_settings, folder, group, tmp_path / "killed.log", "--sync-interval", "6")
    try:
        await _committed_to_end(kafka_settings, topic_catalog, group)  # its first sync and commit
        await _produce(kafka_settings, topic_catalog, bursts[4], next_second=False)
        await killed.wait_read(len(bursts[3]) + len(bursts[4]))
    finally:
        killed.kill()
    assert killed.process.returncode == -signal.SIGKILL
    # Nothing committed past what was synced: the kill came before the next sync (6 s later).
    assert await _committed(kafka_settings, group, topics) == synced != await _ends(kafka_settings, topics)
    partials = list(folder.glob(f"*{PARTIAL_SUFFIX}"))
    assert len(partials) == 1
    torn = list(iter_frames(partials[0], tolerate_torn_end=True))
    on_disk = [f for f in torn if not f.snapshot]
    assert len(on_disk) == len(bursts[3])  # what was synced, every frame of it; what followed, not on disk

    # Started again from its commit, with more input since: the partial salvaged, bursts[4] read again.
    await _produce(kafka_settings, topic_catalog, bursts[5] + [r for b in bursts[6:] for r in b], next_second=False)
    await _record_to_end(kafka_settings, topic_catalog, settings)
    assert not list(folder.glob(f"*{PARTIAL_SUFFIX}"))
    salvaged = partials[0].with_name(partials[0].name[: -len(PARTIAL_SUFFIX)])
    assert [(f.received_at_unix_ms, f.payload) for f in iter_frames(salvaged)] == [
        (f.received_at_unix_ms, f.payload) for f in torn]
    assert len(_recorded_files(folder)) == 4

    direct = tmp_path / "direct.gmrec"
    assert await _direct_recording(kafka_settings, topic_catalog, direct) == sum(len(b) for b in bursts)
    expected = _replay(direct, tmp_path / "direct")
    summary = _replay(folder, tmp_path / "dir")
    assert (summary.samples, summary.pod_events) == (expected.samples, expected.pod_events)
    assert expected.bills > 0 and summary.bills == expected.bills
    for name in OUTPUTS:
        assert _lines(tmp_path / "dir" / name) == _lines(tmp_path / "direct" / name), name
    assert _letters(tmp_path / "dir") == _letters(tmp_path / "direct")
