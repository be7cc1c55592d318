"""The Alertmanager sink against a real Alertmanager (Debian's ``prometheus-alertmanager``) the test starts:
a firing violation shows up active with our labels and annotations; its resolution takes it out of the active
alerts; a re-send renews the lease. Then ``gpumeter guard`` itself (a subprocess on the session's Kafka broker)
raises and resolves an alert in it."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import aiohttp
import pytest

from gpumeter.clock import SystemClock
from gpumeter.devtools.alertmanager import AlertmanagerServer
from gpumeter.kafka.producer import RecordProducer
from schemas.catalog import partition_for_node, pod_event_key
from schemas.records import PodEvent, PodEventType, Violation
from services.guard.alertmanager import AlertmanagerSink, alert_labels
from tests.unit.attributor import pod_event
from tests.unit.guard.test_alertmanager_payload import firing, parse_ms, resolved

pytestmark = pytest.mark.alertmanager

WAIT_S = 15.0
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def alertmanager_url():
    with AlertmanagerServer() as server:
        yield server.url


async def get_alerts(url: str, **params: str) -> list[dict]:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/api/v2/alerts", params=params) as response:
            assert response.status == 200, await response.text()
            return await response.json()


def ours(alerts: list[dict], violation: Violation) -> list[dict]:
    return [a for a in alerts if a["labels"].get("fingerprint") == violation.fingerprint]


async def wait_for(predicate, what: str):
    deadline = time.monotonic() + WAIT_S
    while True:
        result = await predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"Alertmanager never showed {what}")
        await asyncio.sleep(0.1)


async def test_firing_then_resolved_in_a_real_alertmanager(alertmanager_url):
    clock = SystemClock()
    now_ms = clock.now_ms()
    violation = firing(first_seen_unix_ms=now_ms - 90_000, last_seen_unix_ms=now_ms - 1_000)
    async with AlertmanagerSink(alertmanager_url, 5.0, clock=clock, resend_interval_s=30.0) as sink:
        sink.update([violation])
        assert await sink.flush() == 1

        async def shown_active():
            found = ours(await get_alerts(alertmanager_url, active="true"), violation)
            return found if found and found[0]["status"]["state"] == "active" else None

        (alert,) = await wait_for(shown_active, "the firing alert as active")
        assert alert["labels"] == alert_labels(violation)
        assert alert["labels"]["alertname"] == violation.rule
        assert alert["labels"]["severity"] == violation.severity.value.lower()
        assert alert["annotations"]["summary"] == violation.summary
        assert violation.namespace in alert["annotations"]["description"]
        assert parse_ms(alert["startsAt"]) == violation.first_seen_unix_ms
        lease_end_ms = parse_ms(alert["endsAt"])
        assert lease_end_ms >= now_ms + int(sink.lease_s * 1000)  # a firing alert carries the lease

        # A re-send a little later moves the lease on.
        await asyncio.sleep(0.05)
        assert await sink.resend_active() == 1

        async def lease_moved():
            found = ours(await get_alerts(alertmanager_url), violation)
            return found if found and parse_ms(found[0]["endsAt"]) > lease_end_ms else None

        await wait_for(lease_moved, "a later endsAt after the re-send")

        # The resolution: Alertmanager matches it by labelset and the alert is no longer active.
        resolved_at_ms = clock.now_ms()
        sink.update([resolved(violation, resolved_at_ms)])
        assert await sink.flush() == 1

        async def gone_from_active():
            return not ours(await get_alerts(alertmanager_url, active="true"), violation)

        await wait_for(gone_from_active, "the alert leaving the active alerts")
        assert ours(await get_alerts(alertmanager_url), violation) == []
        assert sink.active == {}


@pytest.mark.integration
async def test_gpumeter_guard_raises_and_resolves_an_alert_in_a_real_alertmanager(alertmanager_url, kafka_settings,
                                                                                 topic_catalog, group_id, tmp_path):
    """``gpumeter guard`` as a subprocess: a leaky pod spec on the broker → the alert active in Alertmanager with
    the violation's labels; the pod deleted → after the hold-down the alert is no longer active; SIGTERM → 0."""
    password = f"pw-{uuid.uuid4().hex[:8]}"  # Alertmanager ignores it; it must never be printed
    authed_url = alertmanager_url.replace("http://", f"http://guard:{password}@")
    env = {
        **os.environ,
        "KAFKA_BOOTSTRAP_SERVERS": kafka_settings.bootstrap_servers,
        "GPUMETER_KAFKA_TOPIC_PREFIX": kafka_settings.topic_prefix,
        "GPUMETER_GUARD_CONSUMER_GROUP": group_id,
        "GPUMETER_GUARD_HOLD_DOWN_SECONDS": "1",
        "GPUMETER_GUARD_ALERTMANAGER_URL": authed_url,
        "PYTHONPATH": str(REPO_ROOT),
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpumeter.cli", "guard", "--metrics-port", "0", "--partitions", "3",
        "--clock-interval", "0.2", "--state", str(tmp_path / "guard.state"), cwd=REPO_ROOT, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    try:
        now_ms = SystemClock().now_ms()
        pod = leaky_pod_event(now_ms)
        await produce_pod_event(kafka_settings, topic_catalog, pod)

        async def leak_active():
            found = [a for a in await get_alerts(alertmanager_url, active="true")
                     if a["labels"].get("alertname") == "visibility_leak"
                     and a["labels"].get("pod") == pod.name and a["status"]["state"] == "active"]
            return found or None

        (alert,) = await wait_for(leak_active, "the guard's visibility_leak alert")
        labels = alert["labels"]
        assert (labels["severity"], labels["namespace"], labels["node"], labels["cluster"]) == (
            "critical", pod.namespace, pod.node_name, pod.cluster)
        assert len(labels["fingerprint"]) == 16
        assert "NVIDIA_VISIBLE_DEVICES=all" in alert["annotations"]["description"]

        await produce_pod_event(kafka_settings, topic_catalog,
                                dataclasses.replace(pod, event_type=PodEventType.DELETED,
                                                    observed_at_unix_ms=now_ms + 1_000, resource_version="2"))

        async def leak_gone():
            return not [a for a in await get_alerts(alertmanager_url, active="true")
                        if a["labels"].get("fingerprint") == labels["fingerprint"]]

        await wait_for(leak_gone, "the alert resolved after the pod was deleted")
        process.send_signal(signal.SIGTERM)
        output, _ = await asyncio.wait_for(process.communicate(), WAIT_S)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    log = output.decode()
    assert process.returncode == 0, log
    assert password not in log
    config_line = next(line for line in log.splitlines() if line.startswith("gpumeter guard {"))
    config = json.loads(config_line[len("gpumeter guard "):])
    assert config["alertmanager_url"] == alertmanager_url.replace("http://", "http://guard:***@")
    assert config["consumer_group"] == group_id


def leaky_pod_event(now_ms: int) -> PodEvent:
    """A pod that requests no GPU and whose container sets NVIDIA_VISIBLE_DEVICES=all."""
    event = pod_event(f"uid-{uuid.uuid4().hex[:8]}", namespace="research", name="notebook-7", node="gpu-node-9",
                      cluster="am-it", observed_at_unix_ms=now_ms, resource_version="1")
    (container,) = event.containers
    return dataclasses.replace(event, containers=(dataclasses.replace(container, visible_devices_env="all"),))


async def produce_pod_event(kafka_settings, topics, event: PodEvent) -> None:
    producer = RecordProducer(kafka_settings)
    await producer.start()
    try:
        await producer.send(topics.pod_events, event, key=pod_event_key(event.node_name, event.uid),
                            partition=partition_for_node(event.node_name, 3))
        await producer.flush()
    finally:
        await producer.stop()
