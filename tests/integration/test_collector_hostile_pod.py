"""A pod with 30,000 labels on a node, through the real collector path: the simulated API server and kubelet
(``simulator/``), ``gpumeter collector --simulate`` in a subprocess, and the session's real broker.

Kubernetes accepts such a pod; copied whole it made a 1.28 MB PodEvent that the producer refused, and the
collector's buffer kept it at its head, retried it every few seconds and sent nothing behind it: the node's ticks
stopped. Now the collector cuts the pod's labels to size (``services.collector.podsize``), the event says what it
cut, and every tick of the node arrives.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from schemas.records import NodeSample, PodEvent
from services.collector.podsize import MAX_LABELS
from tests.integration.topic_reading import read_topic

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
LABELS = 30_000
TIME_SCALE = 10.0
INTERVAL_S = 5  # scenario seconds: two ticks per second of real time
SCENARIO_START_MS = 1_782_864_000_000  # 2026-07-01T00:00:00Z, the scenario's start


def scenario_with_a_label_flood(path: Path) -> Path:
    flood = {f"acme.io/label-{i:05d}": f"value-{i:05d}-abcdefghij" for i in range(LABELS)}
    scenario = {
        "cluster": "sim-hostile",
        "seed": 5,
        "start": "2026-07-01T00:00:00Z",  # SCENARIO_START_MS
        "interval_seconds": INTERVAL_S,
        "duration_seconds": 3600,
        "nodes": [{"name": "node-flood", "cloud_provider": "aws", "region": "us-east-1", "instance_type": "g5.xlarge",
                   "price_model": "on_demand",
                   "gpus": [{"model": "NVIDIA A10G", "memory_total_bytes": 24146608128,
                             "driver_reserved_bytes": 293601280, "sharing": {"mode": "time_slicing", "replicas": 2}}]}],
        "pods": [
            {"namespace": "team-a", "name": "good-0", "node": "node-flood", "labels": {"team": "a"},
             "containers": [{"devices": [{"resource": "nvidia.com/gpu.shared", "gpu": 0, "replica": 0}],
                             "processes": [{"name": "python", "memory": {"bytes": "2GiB"}, "compute": 0.5}]}]},
            # Appears 10 scenario seconds in (1 s of real time), after the first ticks went out.
            {"namespace": "tenant", "name": "label-flood", "node": "node-flood", "labels": flood,
             "start_seconds": 10,
             "containers": [{"devices": [{"resource": "nvidia.com/gpu.shared", "gpu": 0, "replica": 1}],
                             "processes": [{"name": "python", "memory": {"bytes": "1GiB"}, "compute": 0.3}]}]},
        ],
    }
    path.write_text(json.dumps(scenario))  # JSON is YAML
    return path


async def test_a_pod_with_30000_labels_no_longer_stops_its_nodes_ticks(kafka_settings, topic_catalog, tmp_path):
    scenario = scenario_with_a_label_flood(tmp_path / "flood.yaml")
    log_path = tmp_path / "collector.log"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GPUMETER_")}, "GPUMETER_LOG_LEVEL": "INFO"}
    with log_path.open("w") as log:
        collector = subprocess.Popen(
            [sys.executable, "-m", "gpumeter.cli", "collector", "--node", "node-flood", "--simulate", str(scenario),
             "--time-scale", str(TIME_SCALE), "--metrics-port", "0",
             "--bootstrap-servers", kafka_settings.bootstrap_servers, "--topic-prefix", kafka_settings.topic_prefix],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        await asyncio.sleep(14.0)
        collector.send_signal(signal.SIGTERM)
        collector.wait(timeout=60)
    finally:
        if collector.poll() is None:
            collector.kill()
            collector.wait()
    output = log_path.read_text(errors="replace")
    assert collector.returncode == 0, output[-4000:]

    samples = await read_topic(kafka_settings, topic_catalog.node_samples, NodeSample)
    events = await read_topic(kafka_settings, topic_catalog.pod_events, PodEvent)
    sequences = sorted({s.sequence for s in samples})
    # Every tick the collector says it made arrived, none missing: the bug kept the oversized event at the head of
    # the buffer and nothing behind it went out. The count is the collector's own, not the wall clock's: start-up
    # (interpreter, the 30,000-label scenario, the simulated peers) takes longer on a loaded machine.
    made = re.search(r"stopped after (\d+) ticks", output)
    assert made, output[-4000:]
    assert sequences == list(range(int(made.group(1)))), (sequences, output[-4000:])
    # And the node kept ticking once the flood pod was on it (it appears 10 scenario seconds in).
    flood_at_ms = SCENARIO_START_MS + 10_000
    assert sum(s.sampled_at_unix_ms > flood_at_ms for s in samples) >= 5, (sequences, output[-4000:])
    flood = [e for e in events if e.name == "label-flood"]
    assert flood, output[-4000:]
    for event in flood:
        assert len(event.labels) == MAX_LABELS and event.labels_dropped == LABELS - MAX_LABELS and event.truncated
    (good,) = {e.uid: e for e in events if e.name == "good-0"}.values()
    assert dict(good.labels) == {"team": "a"} and not good.truncated
    assert " 0 undelivered" in output, output[-4000:]
