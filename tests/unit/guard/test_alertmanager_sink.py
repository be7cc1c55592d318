"""AlertmanagerSink against a loopback HTTP peer the test starts: retries on 5xx and connection errors, no retry
on 4xx, pending alerts kept while Alertmanager is down (latest state per fingerprint), periodic re-sends with a
fresh lease, and an explicit resolution of a labelset a fingerprint no longer has."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import socket

import pytest
from aiohttp import web

from gpumeter.clock import ManualClock
from schemas.records import Severity
from services.guard.alertmanager import (
    AlertmanagerRejected,
    AlertmanagerSink,
    AlertmanagerUnavailable,
    alert_labels,
    to_alertmanager,
)
from tests.unit.guard.test_alertmanager_payload import FIRST_SEEN_MS, LAST_SEEN_MS, firing, parse_ms, resolved

pytestmark = pytest.mark.network


class FakeAlertmanager:
    """Answers POST /api/v2/alerts with the next scripted status (200 once the script is used up)."""

    def __init__(self, statuses=()) -> None:
        self.statuses = list(statuses)
        self.bodies: list[list[dict]] = []
        self.authorizations: list[str | None] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def _alerts(self, request: web.Request) -> web.Response:
        self.bodies.append(await request.json())
        self.authorizations.append(request.headers.get("Authorization"))
        status = self.statuses.pop(0) if self.statuses else 200
        return web.Response(status=status, text="" if status == 200 else f"scripted {status}")

    async def __aenter__(self) -> "FakeAlertmanager":
        app = web.Application()
        app.router.add_post("/api/v2/alerts", self._alerts)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc_info) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


async def no_sleep(_seconds: float) -> None:
    return None


def sink_for(url: str, clock: ManualClock, **kwargs) -> AlertmanagerSink:
    return AlertmanagerSink(url, 5.0, clock=clock, resend_interval_s=60.0, sleep=no_sleep, **kwargs)


async def test_retries_5xx_until_accepted():
    clock = ManualClock(LAST_SEEN_MS)
    violation = firing()
    async with FakeAlertmanager([503, 502]) as server:
        async with sink_for(server.url, clock, max_attempts=4) as sink:
            sink.update([violation])
            assert await sink.flush() == 1
    assert len(server.bodies) == 3  # two refusals, then accepted
    assert all(body == [to_alertmanager(violation, now_ms=clock.now_ms(), lease_seconds=240.0)]
               for body in server.bodies)
    assert sink.pending_count == 0


async def test_a_4xx_is_not_retried_and_the_batch_is_dropped():
    clock = ManualClock(LAST_SEEN_MS)
    async with FakeAlertmanager([400]) as server:
        async with sink_for(server.url, clock, max_attempts=4) as sink:
            sink.update([firing()])
            with pytest.raises(AlertmanagerRejected) as caught:
                await sink.flush()
    assert caught.value.status == 400
    assert len(server.bodies) == 1
    assert sink.pending_count == 0


async def test_unavailable_keeps_the_latest_state_pending_until_it_is_back():
    clock = ManualClock(LAST_SEEN_MS)
    violation = firing()
    attempts = 3
    async with FakeAlertmanager([503] * attempts) as server:
        async with sink_for(server.url, clock, max_attempts=attempts) as sink:
            sink.update([violation])
            with pytest.raises(AlertmanagerUnavailable):
                await sink.flush()
            assert len(server.bodies) == attempts
            assert sink.pending_count == 1
            # It resolves while Alertmanager is down: only the resolution goes out when it is back.
            resolved_at_ms = LAST_SEEN_MS + 20_000
            clock.set_ms(resolved_at_ms + 5_000)
            sink.update([resolved(violation, resolved_at_ms)])
            assert await sink.flush() == 1
    (alert,) = server.bodies[-1]
    assert alert["labels"] == alert_labels(violation)
    assert parse_ms(alert["endsAt"]) == resolved_at_ms
    assert sink.active == {}


async def test_connection_refused_is_unavailable():
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with sink_for(f"http://127.0.0.1:{port}", ManualClock(LAST_SEEN_MS), max_attempts=2) as sink:
        sink.update([firing()])
        with pytest.raises(AlertmanagerUnavailable, match="after 2 attempts"):
            await sink.flush()
        assert sink.pending_count == 1


async def test_resend_posts_only_firing_alerts_with_a_fresh_lease():
    clock = ManualClock(LAST_SEEN_MS)
    burning = firing()
    over = firing(fingerprint="0000aaaa1111bbbb", pod_name="trainer-1")
    async with FakeAlertmanager() as server:
        async with sink_for(server.url, clock) as sink:
            sink.update([burning, over])
            sink.update([resolved(over, LAST_SEEN_MS + 1_000)])
            await sink.flush()
            clock.advance_ms(60_000)
            assert await sink.resend_active() == 1
    (resent,) = server.bodies[-1]
    assert resent["labels"] == alert_labels(burning)
    assert parse_ms(resent["endsAt"]) == clock.now_ms() + int(sink.lease_s * 1000)


async def test_a_changed_labelset_resolves_the_old_one():
    clock = ManualClock(LAST_SEEN_MS)
    warning = firing(rule="budget_exceeded", severity=Severity.WARNING)
    async with FakeAlertmanager() as server:
        async with sink_for(server.url, clock) as sink:
            sink.update([warning])
            await sink.flush()
            clock.advance_ms(30_000)
            critical = dataclasses.replace(warning, severity=Severity.CRITICAL, last_seen_unix_ms=clock.now_ms())
            sink.update([critical])
            await sink.flush()
    old, new = server.bodies[-1]
    assert old["labels"] == alert_labels(warning)
    assert parse_ms(old["endsAt"]) == clock.now_ms()
    assert new["labels"] == alert_labels(critical)
    assert new["labels"]["severity"] == "critical"


async def test_run_flushes_updates_and_stops_cleanly():
    clock = ManualClock(LAST_SEEN_MS)
    violation = firing()
    async with FakeAlertmanager() as server:
        async with sink_for(server.url, clock) as sink:
            stop = asyncio.Event()
            task = asyncio.create_task(sink.run(stop))
            sink.update([violation])
            for _ in range(200):
                if server.bodies:
                    break
                await asyncio.sleep(0.01)
            stop.set()
            await asyncio.wait_for(task, 5)
    assert server.bodies[0][0]["labels"] == alert_labels(violation)
    assert parse_ms(server.bodies[0][0]["startsAt"]) == FIRST_SEEN_MS
    assert sink.active == {violation.fingerprint: violation}
    assert sink.pending_count == 0


async def test_credentials_in_the_url_become_basic_auth_and_stay_out_of_errors():
    clock = ManualClock(LAST_SEEN_MS)
    secret = "s3cr3t-pw"
    async with FakeAlertmanager([503, 503]) as server:
        authed = server.url.replace("http://", f"http://guard:{secret}@")
        async with sink_for(authed, clock, max_attempts=2) as sink:
            assert secret not in sink.endpoint
            sink.update([firing()])
            with pytest.raises(AlertmanagerUnavailable) as caught:
                await sink.flush()
    assert secret not in str(caught.value)
    expected = "Basic " + base64.b64encode(f"guard:{secret}".encode()).decode()
    assert server.authorizations == [expected, expected]
