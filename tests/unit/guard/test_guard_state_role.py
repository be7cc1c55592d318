"""A guard restores only its own state file. The file records the role that wrote it and the input topics its
positions cover; a guard of another role, or reading other topics, moves the file aside (``<name>.foreign-<ms>``)
and starts without state -- the service then rebuilds from the violations topic, as after a damaged file -- instead
of judging nodes it does not watch or reading on from another topic set's positions. A file from before roles were
recorded was written by the ``all`` role: it restores there and is another guard's file anywhere else."""

from __future__ import annotations

import hashlib
import json

from gpumeter.clock import ManualClock
from schemas.catalog import TopicCatalog
from services.guard.config import GuardConfig
from services.guard.engine import GuardEngine
from services.guard.main import restore_engine
from services.guard.processor import ROLE_ALL, ROLE_BUDGETS, GuardProcessor, guard_topics
from services.guard.state import STATE_MAGIC, GuardStateStore, StateCheckpoint
from tests.unit.guard import NODE, T0, device, sample

S = 1000
TOPICS = TopicCatalog(prefix="unit.")
ALL_TOPICS = frozenset(guard_topics(TOPICS, ROLE_ALL).values())
BUDGETS_TOPICS = frozenset(guard_topics(TOPICS, ROLE_BUDGETS).values())
CONFIG = GuardConfig(hold_down_seconds=30, refresh_seconds=60, stale_node_intervals=3, stale_node_min_seconds=0)
# What an ``all`` guard had read: positions of three of its four topics.
ALL_POSITIONS = {(TOPICS.node_samples, 0): 5, (TOPICS.pod_events, 0): 9, (TOPICS.node_window_costs, 0): 3}
SILENT_LONG_AFTER_MS = T0 + 120 * S  # NODE, heard once at T0, is stale by then (3 intervals of 10 s)


def engine_that_heard_the_node() -> GuardEngine:
    """An engine that heard ``NODE`` once at ``T0``: its stale timer runs."""
    engine = GuardEngine(CONFIG)
    engine.on_sample(sample([device("GPU-0a0a0a0a-0000-4000-8000-00000000000a")], t=T0), T0)
    return engine


async def save_as(role: str, store: GuardStateStore, positions, engine: GuardEngine | None = None) -> None:
    """The state file a guard of ``role`` writes at a checkpoint (``StateCheckpoint``)."""
    clock = ManualClock(T0)
    processor = GuardProcessor(CONFIG, clock, engine=engine, role=role)
    topics = guard_topics(TOPICS, role).values()
    assert await StateCheckpoint(processor, store, clock, topics=topics)(positions) == positions


def write_legacy_file(store: GuardStateStore, engine_bytes: bytes, positions) -> bytes:
    """A state file as every guard wrote it before files recorded their role: no role, no topics."""
    header = {
        "saved_at_unix_ms": T0,
        "positions": [[topic, partition, offset] for (topic, partition), offset in sorted(positions.items())],
        "engine_bytes": len(engine_bytes),
        "engine_sha256": hashlib.sha256(engine_bytes).hexdigest(),
    }
    data = STATE_MAGIC + json.dumps(header, sort_keys=True).encode("utf-8") + b"\n" + engine_bytes
    store.path.write_bytes(data)
    return data


def stale_nodes(processor: GuardProcessor, now_ms: int) -> list[str]:
    return [emit.record.node_name for emit in processor.on_clock(now_ms).emits if emit.record.rule == "stale_node"]


async def test_the_checkpoint_records_the_role_and_the_input_topics(tmp_path):
    store = GuardStateStore(tmp_path / "guard.state")
    await save_as(ROLE_ALL, store, ALL_POSITIONS, engine_that_heard_the_node())
    state = store.load()
    assert (state.role, state.topics, state.positions) == (ROLE_ALL, ALL_TOPICS, ALL_POSITIONS)
    budgets = GuardStateStore(tmp_path / "budgets.state")
    await save_as(ROLE_BUDGETS, budgets, {(TOPICS.node_window_costs, 0): 3})
    assert (budgets.load().role, budgets.load().topics) == (ROLE_BUDGETS, BUDGETS_TOPICS)


async def test_a_budgets_guard_moves_an_all_state_file_aside_and_judges_no_node_of_it(tmp_path):
    store = GuardStateStore(tmp_path / "guard.state")
    await save_as(ROLE_ALL, store, ALL_POSITIONS, engine_that_heard_the_node())
    written = store.path.read_bytes()
    clock = ManualClock(T0 + 60 * S)

    engine, state = restore_engine(CONFIG, store, clock, role=ROLE_BUDGETS, topics=BUDGETS_TOPICS)

    assert state is None  # no positions adopted: the service rebuilds from the violations topic
    assert not store.path.exists()
    moved = tmp_path / f"guard.state.foreign-{clock.now_ms()}"
    assert moved.read_bytes() == written  # kept for a post-mortem
    budgets = GuardProcessor(CONFIG, clock, engine=engine, role=ROLE_BUDGETS)
    assert stale_nodes(budgets, SILENT_LONG_AFTER_MS) == []
    assert json.loads(engine.snapshot())["nodes"] == []

    # The same file, restored by the role that wrote it, carries that node's stale timer and its positions.
    moved.rename(store.path)
    engine, state = restore_engine(CONFIG, store, clock, role=ROLE_ALL, topics=ALL_TOPICS)
    assert state is not None and state.positions == ALL_POSITIONS
    assert stale_nodes(GuardProcessor(CONFIG, clock, engine=engine), SILENT_LONG_AFTER_MS) == [NODE]


async def test_an_all_guard_moves_a_budgets_state_file_aside(tmp_path):
    """Restored, it would take the node-keyed topics as covered by a state that never read them."""
    store = GuardStateStore(tmp_path / "guard.state")
    await save_as(ROLE_BUDGETS, store, {(TOPICS.node_window_costs, 0): 3})
    clock = ManualClock(T0 + 60 * S)

    engine, state = restore_engine(CONFIG, store, clock, role=ROLE_ALL, topics=ALL_TOPICS)

    assert state is None and engine.snapshot() == GuardEngine(CONFIG).snapshot()
    assert (tmp_path / f"guard.state.foreign-{clock.now_ms()}").exists() and not store.path.exists()


def test_a_state_file_without_a_role_restores_as_the_all_role(tmp_path):
    store = GuardStateStore(tmp_path / "guard.state")
    write_legacy_file(store, engine_that_heard_the_node().snapshot(), ALL_POSITIONS)
    clock = ManualClock(T0 + 60 * S)

    engine, state = restore_engine(CONFIG, store, clock, role=ROLE_ALL, topics=ALL_TOPICS)

    assert state is not None and state.positions == ALL_POSITIONS and state.role is None
    assert store.path.exists()
    assert stale_nodes(GuardProcessor(CONFIG, clock, engine=engine), SILENT_LONG_AFTER_MS) == [NODE]


def test_a_state_file_without_a_role_is_another_guards_for_the_budgets_role(tmp_path):
    store = GuardStateStore(tmp_path / "guard.state")
    written = write_legacy_file(store, engine_that_heard_the_node().snapshot(), ALL_POSITIONS)
    clock = ManualClock(T0 + 60 * S)

    engine, state = restore_engine(CONFIG, store, clock, role=ROLE_BUDGETS, topics=BUDGETS_TOPICS)

    assert state is None
    assert (tmp_path / f"guard.state.foreign-{clock.now_ms()}").read_bytes() == written
    assert stale_nodes(GuardProcessor(CONFIG, clock, engine=engine, role=ROLE_BUDGETS), SILENT_LONG_AFTER_MS) == []


async def test_a_state_file_covering_other_topics_is_moved_aside(tmp_path):
    """Same role, other topics (another prefix): its positions would be read as nobody's, its input re-read."""
    other = TopicCatalog(prefix="other.")
    other_positions = {(other.node_samples, 0): 5}
    clock = ManualClock(T0 + 60 * S)
    store = GuardStateStore(tmp_path / "guard.state")
    processor = GuardProcessor(CONFIG, clock, engine=engine_that_heard_the_node())
    await StateCheckpoint(processor, store, clock, topics=guard_topics(other).values())(other_positions)

    engine, state = restore_engine(CONFIG, store, clock, role=ROLE_ALL, topics=ALL_TOPICS)

    assert state is None and json.loads(engine.snapshot())["nodes"] == []
    assert (tmp_path / f"guard.state.foreign-{clock.now_ms()}").exists()

    # A file without the topics recorded is judged by its positions.
    write_legacy_file(store, engine_that_heard_the_node().snapshot(), other_positions)
    clock.advance_ms(1)
    assert restore_engine(CONFIG, store, clock, role=ROLE_ALL, topics=ALL_TOPICS)[1] is None
    assert (tmp_path / f"guard.state.foreign-{clock.now_ms()}").exists()


def test_a_damaged_file_is_still_moved_aside_as_corrupt(tmp_path):
    store = GuardStateStore(tmp_path / "guard.state")
    store.path.write_bytes(b"garbage")
    clock = ManualClock(T0)
    assert restore_engine(CONFIG, store, clock, role=ROLE_ALL, topics=ALL_TOPICS)[1] is None
    assert (tmp_path / f"guard.state.corrupt-{clock.now_ms()}").read_bytes() == b"garbage"
