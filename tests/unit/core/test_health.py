"""Liveness: the heartbeat, /healthz next to /metrics, and the beats of the services' loops."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from gpumeter.clock import ManualClock
from gpumeter.errors import ConfigError
from gpumeter.health import HEALTH_PATH, Heartbeat
from gpumeter.metrics import ServiceMetrics


def call(app, path: str) -> tuple[str, dict[str, str], bytes]:
    seen = {}

    def start_response(status, headers):
        seen["status"], seen["headers"] = status, dict(headers)

    body = b"".join(app({"PATH_INFO": path, "REQUEST_METHOD": "GET", "QUERY_STRING": ""}, start_response))
    return seen["status"], seen["headers"], body


def test_alive_until_the_loop_is_silent_longer_than_the_limit():
    clock = ManualClock(0)
    heartbeat = Heartbeat(clock, max_silence_seconds=60)
    assert heartbeat.check().alive  # the start counts as a beat
    clock.advance_ms(60_000)
    assert heartbeat.check().alive
    clock.advance_ms(1)
    liveness = heartbeat.check()
    assert not liveness.alive and liveness.silent_seconds == pytest.approx(60.001)
    heartbeat.beat()
    assert heartbeat.check().alive and heartbeat.check().silent_seconds == 0


@pytest.mark.parametrize("limit", [0, -1, float("nan")])
def test_a_limit_that_is_not_positive_is_refused(limit):
    with pytest.raises(ConfigError):
        Heartbeat(ManualClock(0), limit)


def test_healthz_answers_from_the_heartbeat_and_every_other_path_is_the_exposition():
    clock = ManualClock(0)
    metrics = ServiceMetrics("collector", clock=clock, max_silence_seconds=30)
    metrics.get("gpumeter_collector_ticks_total").inc(3)
    app = metrics.wsgi_app()

    status, headers, body = call(app, HEALTH_PATH)
    assert status == "200 OK" and headers["Content-Type"] == "application/json"
    assert json.loads(body) == {"alive": True, "silent_seconds": 0.0, "max_silence_seconds": 30.0}

    clock.advance_ms(45_000)
    status, _, body = call(app, HEALTH_PATH)
    assert status.startswith("503") and json.loads(body)["silent_seconds"] == 45.0
    metrics.beat()
    assert call(app, HEALTH_PATH)[0] == "200 OK"

    status, _, body = call(app, "/metrics")
    assert status.startswith("200") and b"gpumeter_collector_ticks_total 3.0" in body


async def test_the_collector_loop_beats_once_per_tick():
    from services.collector.service import CollectorService

    clock = ManualClock(0)
    metrics = ServiceMetrics("collector", clock=clock, max_silence_seconds=5)
    ticks = 0

    class Ticking(CollectorService):
        def __init__(self):  # only what run_ticks touches
            self.metrics = metrics
            self.sequence = 0

        async def tick(self):
            nonlocal ticks
            ticks += 1
            self.sequence += 1
            clock.advance_ms(4_000)  # each tick is 4 s of silence: alive only if the loop beats after it

    service = Ticking()
    await service.run_ticks(asyncio.Event(), real_interval_s=0, max_ticks=3)
    assert ticks == 3
    assert metrics.heartbeat.check().alive
    clock.advance_ms(5_001)
    assert not metrics.heartbeat.check().alive


@pytest.mark.network
def test_the_server_answers_healthz_and_metrics_on_one_port():
    clock = ManualClock(0)
    metrics = ServiceMetrics("guard", clock=clock, max_silence_seconds=10)
    assert metrics.serve(0) is None  # port 0 disables serving
    server = _serve_on_a_free_port(metrics)
    try:
        port = server.server_address[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{HEALTH_PATH}", timeout=5) as response:
            assert response.status == 200 and json.loads(response.read())["alive"] is True
        clock.advance_ms(11_000)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{port}{HEALTH_PATH}", timeout=5)
        assert refused.value.code == 503
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            assert b"gpumeter_guard_violations_firing" in response.read()
    finally:
        server.shutdown()
        server.server_close()


def _serve_on_a_free_port(metrics: ServiceMetrics):
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return metrics.serve(port, addr="127.0.0.1")
