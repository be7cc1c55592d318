"""Liveness: the heartbeat, /healthz next to /metrics, and the beats of the services' loops."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from gpumeter.clock import ManualClock
from gpumeter.errors import ConfigError
from gpumeter.config import load
from gpumeter.health import HEALTH_PATH, DeadLetterWindow, Heartbeat
from gpumeter.metrics import ServiceMetrics
from schemas.records import NodeWindowShares


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


def test_a_position_standing_still_while_input_waits_is_a_stall_whatever_the_beats_say():
    clock = ManualClock(0)
    heartbeat = Heartbeat(clock, max_silence_seconds=60, max_stall_seconds=300)
    heartbeat.progress("outbox", 7, waiting=True)
    for _ in range(30):  # a retry loop: beats every 10 s, the same record still unacknowledged
        clock.advance_ms(10_000)
        heartbeat.beat()
        heartbeat.progress("outbox", 7, waiting=True)
    assert heartbeat.check().alive  # 300 s is the limit, not yet beyond it
    clock.advance_ms(1)
    heartbeat.beat()
    liveness = heartbeat.check()
    assert not liveness.alive and liveness.stalled == {"outbox": pytest.approx(300.001)}
    assert liveness.silent_seconds == 0
    assert json.loads(liveness.as_json())["stalled"] == {"outbox": 300.001}
    heartbeat.progress("outbox", 8, waiting=True)  # it moved on
    assert heartbeat.check().alive and heartbeat.check().stalled == {}


def test_a_quiet_input_is_not_a_stall_and_waiting_restarts_the_count():
    clock = ManualClock(0)
    heartbeat = Heartbeat(clock, max_silence_seconds=60, max_stall_seconds=30)
    heartbeat.progress("input", (("t", 0), 5), waiting=False)
    clock.advance_ms(50_000)
    heartbeat.beat()
    assert heartbeat.check().alive  # nothing waiting: standing still is right
    heartbeat.progress("input", (("t", 0), 5), waiting=True)
    clock.advance_ms(20_000)
    heartbeat.progress("input", (("t", 0), 5), waiting=False)
    heartbeat.progress("input", (("t", 0), 5), waiting=True)
    clock.advance_ms(20_000)
    heartbeat.beat()
    assert heartbeat.check().alive  # 20 s each time, never 30 s in a row
    clock.advance_ms(10_001)
    heartbeat.beat()
    assert heartbeat.check().stalled == {"input": pytest.approx(30.001)}


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
    assert json.loads(body) == {"alive": True, "silent_seconds": 0.0, "max_silence_seconds": 30.0, "stalled": {},
                                "max_stall_seconds": 300.0, "status": "ok",
                                "dead_letters": {"ratio": 0.0, "inputs_count": 0, "dead_letters_count": 0,
                                                 "window_seconds": 300.0, "max_ratio": 0.1, "min_inputs": 100}}

    clock.advance_ms(45_000)
    status, _, body = call(app, HEALTH_PATH)
    assert status.startswith("503") and json.loads(body)["silent_seconds"] == 45.0
    assert json.loads(body)["status"] == "unhealthy"
    metrics.beat()
    assert call(app, HEALTH_PATH)[0] == "200 OK"

    status, _, body = call(app, "/metrics")
    assert status.startswith("200") and b"gpumeter_collector_ticks_total 3.0" in body


# ----------------------------------------------------------------------------------------------------------------
# Degraded: a large share of recent input dead-lettered (liveness unaffected)


def test_the_dead_letter_ratio_is_over_the_recent_window_and_needs_the_minimum_count():
    clock = ManualClock(0)
    window = DeadLetterWindow(clock, window_seconds=60, max_ratio=0.25, min_inputs=8)
    window.record(4)
    window.record(3, dead_letters=3)
    rate = window.rate()
    assert (rate.inputs, rate.dead_letters) == (7, 3) and not rate.degraded  # 3/7 is above 0.25, but only 7 inputs
    window.record(1)
    assert window.rate().degraded and window.rate().ratio == pytest.approx(3 / 8)
    # Good input dilutes it: 3 of 12 is the limit, not above it.
    window.record(4)
    assert not window.rate().degraded and window.rate().ratio == pytest.approx(0.25)
    # Inputs leave the window as the clock moves: 61 s later only what came since counts.
    clock.advance_ms(61_000)
    assert (window.rate().inputs, window.rate().dead_letters) == (0, 0) and window.rate().ratio == 0.0
    window.record(10, dead_letters=10)
    clock.advance_ms(30_000)
    window.record(10)
    assert window.rate().ratio == pytest.approx(0.5) and window.rate().degraded
    clock.advance_ms(31_000)  # the bad ten are older than 60 s
    assert (window.rate().inputs, window.rate().dead_letters) == (10, 0) and not window.rate().degraded


def test_a_store_refusal_counts_its_message_dead_lettered_once_and_never_above_one():
    clock = ManualClock(0)
    window = DeadLetterWindow(clock, window_seconds=10, max_ratio=0.5, min_inputs=1)
    window.record(1)
    window.record(0, dead_letters=1)  # settled later: refused by the store
    window.record(0, dead_letters=1)  # a second refusal of the same input
    assert window.rate().ratio == 1.0 and window.rate().degraded


@pytest.mark.parametrize("kwargs", [dict(window_seconds=0), dict(window_seconds=float("nan")), dict(max_ratio=1.0),
                                    dict(max_ratio=-0.1), dict(min_inputs=0), dict(min_inputs=True)])
def test_unusable_dead_letter_limits_are_refused(kwargs):
    with pytest.raises(ConfigError):
        DeadLetterWindow(ManualClock(0), **kwargs)


def test_healthz_says_degraded_with_the_rate_and_stays_200_while_alive_then_recovers():
    from gpumeter.settings import DeadLetterHealthSettings

    clock = ManualClock(0)
    limits = DeadLetterHealthSettings(window_seconds=120, max_ratio=0.5, min_inputs=4)
    metrics = ServiceMetrics("billing", ("gpumeter_recent_dead_letter_ratio",), clock=clock, dead_letters=limits)
    app = metrics.wsgi_app()
    metrics.inputs(1)
    metrics.inputs(3, dead_letters=3)
    status, _, body = call(app, HEALTH_PATH)
    health = json.loads(body)
    assert status == "200 OK" and health["alive"] and health["status"] == "degraded"
    assert health["dead_letters"] == {"ratio": 0.75, "inputs_count": 4, "dead_letters_count": 3,
                                      "window_seconds": 120.0, "max_ratio": 0.5, "min_inputs": 4}
    exposition = call(app, "/metrics")[2].decode()
    assert 'gpumeter_recent_dead_letter_ratio{service="billing"} 0.75' in exposition
    # Not alive wins over degraded (and answers 503).
    clock.advance_ms(61_000)
    status, _, body = call(app, HEALTH_PATH)
    assert status.startswith("503") and json.loads(body)["status"] == "unhealthy"
    metrics.beat()
    clock.advance_ms(60_000)
    metrics.beat()
    status, _, body = call(app, HEALTH_PATH)
    assert status == "200 OK" and json.loads(body)["status"] == "ok"  # the bad input left the window


def test_the_consumers_read_the_dead_letter_limits_from_the_environment():
    from services.attributor.settings import AttributorSettings
    from services.billing.settings import BillingSettings
    from services.guard.settings import GuardSettings

    env = {"GPUMETER_DEAD_LETTER_WINDOW_SECONDS": "600", "GPUMETER_DEAD_LETTER_MAX_RATIO": "0.3",
           "GPUMETER_DEAD_LETTER_MIN_INPUTS": "20"}
    for cls in (AttributorSettings, BillingSettings, GuardSettings):
        limits = load(cls, None, env).dead_letters
        assert (limits.window_seconds, limits.max_ratio, limits.min_inputs) == (600.0, 0.3, 20), cls.__name__
        with pytest.raises(ConfigError, match="GPUMETER_DEAD_LETTER_MAX_RATIO"):
            load(cls, None, {"GPUMETER_DEAD_LETTER_MAX_RATIO": "1.5"})


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


# ----------------------------------------------------------------------------------------------------------------
# The services' loops: retrying the same thing beats, but is not progress


class AdvancingSleep:
    """A retry pause that moves ``clock`` by the pause instead of waiting."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.pauses = 0

    async def __call__(self, seconds: float) -> None:
        self.pauses += 1
        self.clock.advance_ms(int(seconds * 1000))
        await asyncio.sleep(0)


class RefusingProducer:
    """A producer that never gets a record acknowledged (e.g. one the broker refuses, every time)."""

    async def send(self, topic, record, *, key=None):
        from gpumeter.kafka.producer import DeliveryError

        future = asyncio.get_running_loop().create_future()
        future.set_exception(DeliveryError("MessageSizeTooLargeError"))
        return future


async def _stall_of(processor, clock: ManualClock, metrics: ServiceMetrics, name: str, work) -> None:
    """Run ``work`` (a retry loop) until the clock passed the stall limit: /healthz must then say 503 and name the
    loop ``name``, although the loop beat on every pause."""
    started_s = clock.monotonic_s()
    task = asyncio.ensure_future(work())
    try:
        while clock.monotonic_s() - started_s <= 301 and not task.done():
            await asyncio.sleep(0)
        assert not task.done(), "the retry loop ended"
        liveness = metrics.heartbeat.check()
        assert liveness.silent_seconds < 60, "the loop beat all along"
        assert not liveness.alive and set(liveness.stalled) == {name}
        status, _, body = call(metrics.wsgi_app(), HEALTH_PATH)
        assert status.startswith("503") and name in json.loads(body)["stalled"]
    finally:
        processor.stop()
        try:
            await task
        except Exception:  # ServiceStopping out of the pause
            pass


async def test_billing_retrying_an_outbox_that_is_never_acknowledged_is_a_stall(tmp_path):
    from gpumeter.stream.deadletter import RawMessage
    from schemas.catalog import TopicCatalog
    from schemas.typed import codec_for
    from services.billing.ledger import Ledger
    from services.billing.service import BILLING_METRICS
    from tests.unit.billing.conftest import WINDOW_START_MS, BillingHarness, Unit, node_window, pod

    clock = ManualClock(WINDOW_START_MS + 90_000)
    metrics = ServiceMetrics("billing", BILLING_METRICS, clock=clock)  # the default limits
    sleep = AdvancingSleep(clock)
    topics = TopicCatalog(prefix="h.")
    with Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite3'}") as ledger:
        ledger.migrate()
        billing = BillingHarness(ledger, RefusingProducer(), topics=topics, clock=clock, metrics=metrics,
                                 sleep=sleep)
        window = NodeWindowShares.from_rows(node_window([Unit("GPU-0", [pod("a", 1.0, "ml")])]))
        await billing.handle(RawMessage(topics.node_window_shares, 0, 0, b"node-a",
                                        codec_for(NodeWindowShares).encode(window), None))
        await _stall_of(billing.driver, clock, metrics, "outbox", billing.flush)
    assert sleep.pauses > 10


async def test_billing_retrying_an_unreachable_ledger_with_input_waiting_is_a_stall(tmp_path):
    from sqlalchemy.exc import OperationalError

    from gpumeter.stream.deadletter import RawMessage
    from schemas.catalog import TopicCatalog
    from schemas.typed import codec_for
    from services.billing.ledger import LedgerError
    from services.billing.service import BILLING_METRICS
    from tests.unit.billing.conftest import WINDOW_START_MS, BillingHarness, Unit, node_window, pod

    class Unreachable:
        def write(self, costs, bills):
            raise LedgerError("writing failed") from OperationalError("INSERT", {}, Exception("connection refused"))

    clock = ManualClock(WINDOW_START_MS + 90_000)
    metrics = ServiceMetrics("billing", BILLING_METRICS, clock=clock)
    topics = TopicCatalog(prefix="h.")
    billing = BillingHarness(Unreachable(), RefusingProducer(), topics=topics, clock=clock, metrics=metrics,
                             sleep=AdvancingSleep(clock))
    window = NodeWindowShares.from_rows(node_window([Unit("GPU-0", [pod("a", 1.0, "ml")])]))
    message = RawMessage(topics.node_window_shares, 0, 0, b"node-a", codec_for(NodeWindowShares).encode(window),
                         None)
    billing.driver.note_input(tuple(sorted(billing.driver.taken.items())), True)  # what the loop says after a fetch
    await _stall_of(billing.driver, clock, metrics, "input", lambda: billing.handle(message))


async def test_the_guard_retrying_an_outbox_that_is_never_acknowledged_is_a_stall():
    import dataclasses

    from gpumeter.stream.deadletter import RawMessage
    from gpumeter.kafka.driver import KafkaDriver
    from gpumeter.settings import KafkaSettings
    from gpumeter.stream.runner import MessageRunner
    from schemas.catalog import TopicCatalog
    from schemas.typed import codec_for
    from services.guard.config import GuardConfig
    from services.guard.processor import GUARD_METRICS, GuardProcessor, guard_outputs, guard_topics
    from tests.unit.attributor import pod_event

    now_ms = 1_780_000_000_000
    clock = ManualClock(now_ms)
    metrics = ServiceMetrics("guard", GUARD_METRICS, clock=clock)
    topics = TopicCatalog(prefix="h.")
    processor = GuardProcessor(GuardConfig(), clock, metrics=metrics)
    runner = MessageRunner(processor, guard_topics(topics), clock, metrics=metrics)
    # The guard's driver, as services/guard/main.py wires it; settling and checkpointing need no broker.
    driver = KafkaDriver(runner, kafka=KafkaSettings(topic_prefix="h."), outputs=guard_outputs(topics),
                         producer=RefusingProducer(), clock=clock, consumer_group="g", metrics=metrics,
                         assignment="all", sleep=AdvancingSleep(clock))
    leaky = pod_event("leaky", observed_at_unix_ms=now_ms, started_at_unix_ms=now_ms)
    leaky = dataclasses.replace(leaky, containers=tuple(dataclasses.replace(c, visible_devices_env="all")
                                                        for c in leaky.containers))
    message = RawMessage(topics.pod_events, 0, 0, b"k", codec_for(type(leaky)).encode(leaky), None)
    step = runner.step(message)
    assert step.result.emits  # the violations to produce
    await driver.settle(((message, step.result),))
    # What the driver runs after every batch: flush the outbox (retrying), then commit.
    await _stall_of(driver, clock, metrics, "outbox", lambda: driver._checkpoint(retry=True))
