"""``take_batches`` over a real Faust stream (an agent in Faust's own ``test_context``: no broker): batches cut by
size and by time after their first event, no wakeups while idle, events acknowledged after their batch was
handled, the stream left as it was found."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import faust
import pytest

from gpumeter.errors import ConfigError
from services.attributor.faust_batches import check_stream, take_batches

WITHIN_S = 0.05


def _app_with_agent(take: Callable[[Any], Any]) -> tuple[Any, dict[str, Any]]:
    """A Faust app with one agent that takes its stream's events through ``take(stream)`` and records each
    batch's values, every ``wait_for_stopped`` call, every acknowledgement (with the batches handled by then)."""
    app = faust.App("take-batches-test", broker="kafka://localhost:1", store="memory://")
    seen: dict[str, Any] = {"batches": [], "waits": 0, "acks": [], "stream": None}

    @app.agent(value_type=bytes)
    async def agent(stream: Any) -> None:
        seen["stream"] = stream
        wait_for_stopped, ack = stream.wait_for_stopped, stream.ack

        async def counting_wait(*args: Any, **kwargs: Any) -> Any:
            seen["waits"] += 1
            return await wait_for_stopped(*args, **kwargs)

        async def recording_ack(event: Any) -> Any:
            seen["acks"].append((event.value, len(seen["batches"])))
            return await ack(event)

        stream.wait_for_stopped, stream.ack = counting_wait, recording_ack
        async for events in take(stream):
            seen["batches"].append([event.value for event in events])

    seen["agent"] = agent
    return app, seen


async def _feed(seen: dict[str, Any], idle_s: float) -> int:
    """Idle ``idle_s``, then five events at once, a pause, one more. The waits counted while idle."""
    async with seen["agent"].test_context() as agent:
        await asyncio.sleep(idle_s)
        idle_waits = seen["waits"]
        for n in range(5):
            await agent.put(str(n).encode())
        await asyncio.sleep(0.3)
        await agent.put(b"99")
        await asyncio.sleep(WITHIN_S * 4)
    return idle_waits


async def test_batches_are_cut_by_size_and_a_late_event_is_not_held_for_a_full_batch():
    _app, seen = _app_with_agent(lambda stream: take_batches(stream, 3, WITHIN_S))
    await _feed(seen, 0.0)
    assert seen["batches"] == [[b"0", b"1", b"2"], [b"3", b"4"], [b"99"]]


async def test_an_idle_stream_is_not_woken_until_an_event_comes():
    _app, seen = _app_with_agent(lambda stream: take_batches(stream, 3, WITHIN_S))
    idle_waits = await _feed(seen, 0.5)
    assert idle_waits == 1  # the one wait for a first event, however long the idle
    # Faust's own take_events, on the same feed, wakes every WITHIN_S while idle (what this module removes).
    _app, theirs = _app_with_agent(lambda stream: stream.take_events(3, within=WITHIN_S))
    assert await _feed(theirs, 0.5) >= 4
    assert theirs["batches"] == seen["batches"]


async def test_events_are_acknowledged_once_their_batch_was_handled_and_the_stream_is_left_as_found():
    _app, seen = _app_with_agent(lambda stream: take_batches(stream, 3, WITHIN_S))
    await _feed(seen, 0.0)
    # Each value acknowledged after the batch holding it was recorded (never before: a commit would pass it).
    handled_by = {value: index + 1 for index, batch in enumerate(seen["batches"]) for value in batch}
    assert sorted(value for value, _ in seen["acks"]) == sorted(handled_by)
    assert all(batches_then >= handled_by[value] for value, batches_then in seen["acks"])
    stream = seen["stream"]
    assert stream.enable_acks is True
    assert not any(getattr(p, "__name__", "") == "add_to_buffer" for p in stream._processors)


def test_bad_arguments_and_a_stream_without_the_members_it_uses_are_refused():
    with pytest.raises(ValueError):
        take_batches(object(), 0, WITHIN_S)
    with pytest.raises(ValueError):
        take_batches(object(), 3, 0)

    class NoPassive:
        add_processor = ack = current_event = None

    with pytest.raises(ConfigError, match="_enable_passive"):
        check_stream(NoPassive())
