"""The attributor's agents take their input in batches that wait for data: ``take_batches``.

Faust's ``Stream.take_events(max_, within)`` wakes every ``within`` seconds whether anything arrived or not (its
loop waits for a full buffer with ``within`` as the timeout, then looks). At the 50 ms the attributor batches
within, that is 20 wakeups a second for each of its two agents -- each through ``Service.wait_first``, which
makes a task and a future -- and it is most of what an idle worker spends: 1.95 % of a core idle, 1.25 % with the
wakeups gone (``docs/performance.md``, 2026-12-05 third session). Every worker of a group pays it, so it is also
most of what an added worker costs at a fleet's steady load.

``take_batches`` is ``take_events`` with one change: while its buffer is empty it waits for the first event with
no timeout, and only then gives the batch up to ``within`` seconds to fill. A batch is handed out when it holds
``max_events`` events, or ``within`` seconds after its first event arrived: the same bound on how long an event
waits in the buffer, and no wakeups while there is nothing to wait for. Everything else is ``take_events``'s:
the buffer is filled by a processor of the stream, which is consumed passively; the events of a batch are
acknowledged once the batch's consumer resumes the generator (so Faust never commits past a batch in hand); the
stream's ``enable_acks`` is restored and the processor removed when the generator ends.

It reaches into the stream as ``take_events`` does (``add_processor``, ``_enable_passive``, ``_processors``,
``current_event``, ``ack``): ``check_stream`` raises ``ConfigError`` at start when a Faust upgrade removed any of
them, rather than the agents failing on their first event.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncGenerator

from mode.utils.aiter import aiter
from mode.utils.futures import notify

from gpumeter.errors import ConfigError

_STREAM_MEMBERS = ("add_processor", "_enable_passive", "_processors", "current_event", "ack", "wait", "wait_for_stopped",
                   "should_stop", "enable_acks", "channel", "loop", "log", "crash")


def check_stream(stream: Any) -> None:
    """Raise ``ConfigError`` when ``stream`` lacks a member ``take_batches`` uses (a Faust that changed them)."""
    missing = [name for name in _STREAM_MEMBERS if not hasattr(stream, name)]
    if missing:
        raise ConfigError(f"this Faust's Stream has no {', '.join(missing)}: the attributor's batches cannot be "
                          "taken from it")


def take_batches(stream: Any, max_events: int, within_seconds: float) -> AsyncGenerator[list[Any], None]:
    """Yield the events of ``stream`` in lists of at most ``max_events``: a list once it is full, or
    ``within_seconds`` after its first event arrived. Waits without waking while no event is buffered. The
    events of a list are acknowledged when the generator is resumed after it (or closed). Registered with the
    stream as its own buffering generators are (``Stream.on_stop`` closes those left open)."""
    if max_events < 1 or within_seconds <= 0:
        raise ValueError("max_events must be >= 1 and within_seconds > 0")
    check_stream(stream)
    batches = _take_batches(stream, max_events, within_seconds)
    active = getattr(stream, "_active_agens", None)
    if active is not None:
        active.add(batches)
    return batches


async def _take_batches(stream: Any, max_events: int, within_seconds: float) -> AsyncGenerator[list[Any], None]:
    buffer: list[Any] = []
    buffer_full = asyncio.Event()
    buffer_started = asyncio.Event()  # the buffer holds its first event
    buffer_consumed = asyncio.Event()
    buffer_consuming: asyncio.Future | None = None
    enable_acks = stream.enable_acks
    channel_it = aiter(stream.channel)

    async def add_to_buffer(value: Any) -> Any:
        nonlocal buffer_consuming
        try:
            if buffer_consuming is not None:  # the consumer has the buffer's events in hand: wait until it is done
                try:
                    await buffer_consuming
                finally:
                    buffer_consuming = None
            event = stream.current_event
            if event is None:
                raise RuntimeError("take_batches found no current event")
            buffer.append(event)
            if len(buffer) == 1:
                buffer_started.set()
            if len(buffer) >= max_events:
                buffer_full.set()
                buffer_consumed.clear()
                # Never more than max_events in one list: the stream waits until this one was handed out.
                await stream.wait(buffer_consumed)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            stream.log.exception("Error adding to take buffer: %r", exc)
            await stream.crash(exc)
        return value

    stream.enable_acks = False  # acknowledged here, after the batch's consumer is done with it
    stream.add_processor(add_to_buffer)
    stream._enable_passive(channel_it)
    try:
        while not stream.should_stop:
            # (``wait_for_stopped`` also says "stopped" when it timed out: ``should_stop`` tells them apart.)
            await stream.wait_for_stopped(buffer_started)  # no timeout: nothing to hand out until an event came
            if not buffer_started.is_set():
                break  # woken by the stream stopping or crashing, with nothing in hand
            if not buffer_full.is_set():
                await stream.wait_for_stopped(buffer_full, timeout=within_seconds)
            if not buffer:
                continue
            buffer_consuming = stream.loop.create_future()
            try:
                yield list(buffer)
            finally:
                events = list(buffer)
                buffer.clear()
                buffer_started.clear()
                buffer_full.clear()
                for event in events:
                    await stream.ack(event)
                notify(buffer_consuming)
                buffer_consumed.set()
    finally:
        stream.enable_acks = enable_acks
        stream._processors.remove(add_to_buffer)
