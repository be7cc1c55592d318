"""A SQLite ledger whose files fail under a running ``gpumeter billing`` (a real process, the session's broker).

SQLite maps the ledger's ``-shm`` (the WAL index) into memory; a fault on that mapping the file can no longer back
kills the process with SIGBUS, past every exception handler -- before this work billing died of it (exit 135)
without a log line. Found here: ``chattr +i`` on the ``-shm`` of a running billing (ext4 refuses the write fault
of an immutable file's mapping) and truncating it (pages past its end) both kill a process that then reads,
writes or closes the database.

* The ``-shm`` made immutable while billing runs: billing notices before SQLite touches it, says why, retries
  with backoff and bills nothing meanwhile; once the flag is lifted it bills on, every node-window once. Stopped
  while the file is still immutable it exits 0 with a log line, without closing the ledger (closing writes the
  index).
* The ``-shm`` cut to zero bytes under a running billing: it stops with exit code 1 and a log line, touching
  nothing; started again, it bills what it had not, each node-window once.
* A ``gpumeter report`` opening and closing the ledger of a running billing, and a second billing started on the
  same file: billing keeps SQLite's locks (its file checks never open SQLite's files: closing any descriptor of a
  file drops the process's POSIX locks on it, and before, the report then deleted billing's WAL), the second
  billing is refused at start, and every node-window is billed once, in the file and on the costs topic.

Needs root (``chattr +i`` needs CAP_LINUX_IMMUTABLE) on a filesystem with the immutable flag (ext4, xfs); the
truncation test needs neither.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from schemas.records import CostRecord
from tests.integration.test_billing_stream import produce_shares, wait_until_committed_to_end
from tests.integration.topic_reading import read_topic
from tests.unit.billing.conftest import posix_locks_held, sample_shares

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 40.0


def window_start_ms() -> int:
    """A minute boundary half an hour ago: windows billing accepts as closed and not from the future."""
    return (int(time.time() * 1000) // 60_000 - 30) * 60_000


class Billing:
    """``gpumeter billing`` as a subprocess with a SQLite ledger; its merged output is collected as it comes."""

    def __init__(self, kafka_settings, ledger: Path, group: str) -> None:
        self.env = {
            **os.environ,
            "KAFKA_BOOTSTRAP_SERVERS": kafka_settings.bootstrap_servers,
            "GPUMETER_KAFKA_TOPIC_PREFIX": kafka_settings.topic_prefix,
            "GPUMETER_LEDGER_URL": f"sqlite:///{ledger}",
            "GPUMETER_BILLING_CONSUMER_GROUP": group,
            "GPUMETER_BILLING_LEDGER_RETRY_INITIAL_SECONDS": "0.2",
            "GPUMETER_BILLING_LEDGER_RETRY_MAX_SECONDS": "1",
            "PYTHONPATH": str(REPO_ROOT),
        }
        self.process: asyncio.subprocess.Process | None = None
        self.lines: list[str] = []
        self._reader: asyncio.Task | None = None

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gpumeter.cli", "billing", "--metrics-port", "0", cwd=REPO_ROOT, env=self.env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        async for line in self.process.stdout:
            self.lines.append(line.decode(errors="replace").rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    async def wait_for_line(self, text: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while text not in self.output:
            assert self.process is not None
            if self.process.returncode is not None or time.monotonic() > deadline:
                pytest.fail(f"billing never logged {text!r} (exit code {self.process.returncode}):\n{self.output}")
            await asyncio.sleep(0.1)

    async def wait(self) -> int:
        assert self.process is not None and self._reader is not None
        code = await asyncio.wait_for(self.process.wait(), WAIT_S)
        await asyncio.wait_for(self._reader, WAIT_S)
        return code

    async def stop(self) -> int:
        assert self.process is not None
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
        return await self.wait()

    def kill(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.kill()


async def billed_windows(kafka_settings, topic: str) -> dict[tuple[str, int], int]:
    """(node, window start) -> cost records on the costs topic (billing publishes only after the ledger write)."""
    counts: dict[tuple[str, int], int] = {}
    for record in await read_topic(kafka_settings, topic, CostRecord):
        key = (record.node_name, record.window_start_unix_ms)
        counts[key] = counts.get(key, 0) + 1
    return counts


async def wait_for_windows(kafka_settings, topic: str, expected: set, billing: Billing) -> None:
    deadline = time.monotonic() + WAIT_S
    while set(await billed_windows(kafka_settings, topic)) != expected:
        if billing.process is not None and billing.process.returncode is not None:
            pytest.fail(f"billing exited with {billing.process.returncode}:\n{billing.output}")
        if time.monotonic() > deadline:
            pytest.fail(f"billed {sorted(await billed_windows(kafka_settings, topic))}, expected {sorted(expected)}"
                        f":\n{billing.output}")
        await asyncio.sleep(0.3)


def ledger_bills(ledger: Path) -> list[tuple[str, int]]:
    with sqlite3.connect(ledger) as connection:
        rows = connection.execute("SELECT node_name, window_start_unix_ms FROM node_bills").fetchall()
    return sorted(rows)


def chattr(flag: str, path: Path) -> None:
    result = subprocess.run(["chattr", flag, str(path)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.fail(f"chattr {flag} {path} failed ({result.stderr.strip()}): this test needs root on a filesystem "
                    "with the immutable flag (ext4, xfs)")


def cost_lines(windows) -> dict[tuple[str, int], int]:
    """(node, window start) -> how many cost records billing publishes for it."""
    from services.billing.catalog import PriceCatalog
    from services.billing.costing import bill_node_window

    catalog = PriceCatalog.load()
    return {(shares[0].node_name, shares[0].window_start_unix_ms): len(bill_node_window(shares, catalog).costs)
            for shares in windows}


def keys(windows) -> set[tuple[str, int]]:
    return {(shares[0].node_name, shares[0].window_start_unix_ms) for shares in windows}


async def test_an_shm_made_immutable_under_running_billing_is_waited_out_and_billed_once(
        kafka_settings, topic_catalog, group_id, tmp_path):
    ledger = tmp_path / "ledger.sqlite3"
    shm = ledger.with_name(ledger.name + "-shm")
    windows = sample_shares(2, start_ms=window_start_ms())
    first, second = windows[:2], windows[2:]
    billing = Billing(kafka_settings, ledger, group_id)
    await billing.start()
    try:
        await produce_shares(kafka_settings, topic_catalog.node_window_shares, first)
        await wait_for_windows(kafka_settings, topic_catalog.costs, keys(first), billing)
        # Idle (marked published, offsets committed): the fault comes between two uses, not inside one. Inside
        # one nothing can help; faulthandler at least prints the stack.
        await wait_until_committed_to_end(kafka_settings, group_id, topic_catalog.node_window_shares, "first windows")
        assert shm.exists()  # billing holds the ledger open: the WAL index is mapped

        chattr("+i", shm)
        try:
            await produce_shares(kafka_settings, topic_catalog.node_window_shares, second)
            await billing.wait_for_line("-shm is no longer writable")
            await billing.wait_for_line("store unavailable, retrying")  # the driver's retry, of the ledger's refusal
            assert "ledger unavailable writing" in billing.output
            await asyncio.sleep(2.0)  # a few retries with backoff: alive, and nothing billed meanwhile
            assert billing.process.returncode is None, billing.output
            assert set(await billed_windows(kafka_settings, topic_catalog.costs)) == keys(first)
        finally:
            chattr("-i", shm)
        await wait_for_windows(kafka_settings, topic_catalog.costs, keys(first) | keys(second), billing)
        await wait_until_committed_to_end(kafka_settings, group_id, topic_catalog.node_window_shares, "second windows")

        # Stopped while the -shm is immutable again: exit 0, a line saying why the ledger was left open.
        chattr("+i", shm)
        try:
            assert await billing.stop() == 0, billing.output
        finally:
            chattr("-i", shm)
        assert "exiting without closing the ledger" in billing.output
        assert "Fatal Python error" not in billing.output
    finally:
        billing.kill()
    assert await billed_windows(kafka_settings, topic_catalog.costs) == cost_lines(first + second)  # once each
    assert ledger_bills(ledger) == sorted(keys(first) | keys(second))


async def test_an_shm_cut_under_running_billing_stops_it_with_a_log_line_and_a_restart_bills_on(
        kafka_settings, topic_catalog, group_id, tmp_path):
    ledger = tmp_path / "ledger.sqlite3"
    shm = ledger.with_name(ledger.name + "-shm")
    windows = sample_shares(2, start_ms=window_start_ms())
    first, second = windows[:2], windows[2:]
    billing = Billing(kafka_settings, ledger, group_id)
    await billing.start()
    try:
        await produce_shares(kafka_settings, topic_catalog.node_window_shares, first)
        await wait_for_windows(kafka_settings, topic_catalog.costs, keys(first), billing)
        await wait_until_committed_to_end(kafka_settings, group_id, topic_catalog.node_window_shares, "first windows")
        os.truncate(shm, 0)
        await produce_shares(kafka_settings, topic_catalog.node_window_shares, second)
        code = await billing.wait()
        assert code == 1, f"exit code {code} (-7: SIGBUS):\n{billing.output}"
        assert "while billing had it mapped" in billing.output and "exiting without closing the ledger" in \
            billing.output
        assert set(await billed_windows(kafka_settings, topic_catalog.costs)) == keys(first)
    finally:
        billing.kill()
    again = Billing(kafka_settings, ledger, group_id)
    await again.start()
    try:
        await wait_for_windows(kafka_settings, topic_catalog.costs, keys(first) | keys(second), again)
        assert await again.stop() == 0, again.output
    finally:
        again.kill()
    assert ledger_bills(ledger) == sorted(keys(first) | keys(second))


def integrity(ledger: Path) -> list[tuple]:
    with sqlite3.connect(ledger) as connection:
        return connection.execute("PRAGMA integrity_check").fetchall()


async def gpumeter_report(ledger: Path, windows) -> str:
    """``gpumeter report`` over ``windows`` in a process of its own (it opens and closes the ledger); its output."""
    from datetime import datetime, timezone

    end_ms = max(shares[0].window_start_unix_ms for shares in windows) + 60_000
    end = datetime.fromtimestamp(end_ms / 1000, timezone.utc).isoformat()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("GPUMETER_", "KAFKA_"))},
           "PYTHONPATH": str(REPO_ROOT)}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpumeter.cli", "report", "--ledger-url", f"sqlite:///{ledger}", "--by", "node",
        "--window", "2h", "--end", end, cwd=REPO_ROOT, env=env, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT)
    output, _ = await asyncio.wait_for(process.communicate(), WAIT_S)
    assert process.returncode == 0, output.decode(errors="replace")
    return output.decode(errors="replace")


async def test_a_report_and_a_second_billing_leave_running_billing_its_sqlite_ledger_whole(
        kafka_settings, topic_catalog, group_id, tmp_path):
    """A ``gpumeter report`` opens and closes the ledger of a running billing, and a second billing (another
    group) is started on the same file: the second is refused at start (exit 2, naming the first), the first
    still holds SQLite's locks, bills every later node-window, each once, on the costs topic and in the file, and
    ``integrity_check`` is ok. Before: billing held no lock after its first file check, the report deleted its
    ``-wal``/``-shm``, the file froze while billing went on costing, and a second group re-billed the windows."""
    ledger = tmp_path / "ledger.sqlite3"
    shm = ledger.with_name(ledger.name + "-shm")
    windows = sample_shares(4, start_ms=window_start_ms())
    first, second = windows[:4], windows[4:]
    billing = Billing(kafka_settings, ledger, group_id)
    await billing.start()
    try:
        await produce_shares(kafka_settings, topic_catalog.node_window_shares, first)
        await wait_for_windows(kafka_settings, topic_catalog.costs, keys(first), billing)
        await wait_until_committed_to_end(kafka_settings, group_id, topic_catalog.node_window_shares, "first windows")
        assert posix_locks_held(billing.process.pid, shm), "billing holds no lock on its -shm"

        report = await gpumeter_report(ledger, first)
        assert "aws-node" in report and "gcp-node" in report
        assert shm.exists() and ledger.with_name(ledger.name + "-wal").exists(), "the report deleted the WAL"
        assert posix_locks_held(billing.process.pid, shm), "billing lost its lock on the -shm to the report"

        other = Billing(kafka_settings, ledger, f"{group_id}-second")
        await other.start()
        try:
            assert await other.wait() == 2, other.output
        finally:
            other.kill()
        assert "refusing to start: another billing holds the SQLite ledger" in other.output
        assert f"group {group_id}" in other.output  # names the holder
        assert "assigned [" not in other.output  # never joined its group, never billed

        await produce_shares(kafka_settings, topic_catalog.node_window_shares, second)
        await wait_for_windows(kafka_settings, topic_catalog.costs, keys(first) | keys(second), billing)
        await wait_until_committed_to_end(kafka_settings, group_id, topic_catalog.node_window_shares,
                                          "second windows")
        assert ledger_bills(ledger) == sorted(keys(first) | keys(second))  # another process sees them all
        assert posix_locks_held(billing.process.pid, shm)
        assert await billing.stop() == 0, billing.output
    finally:
        billing.kill()
    assert await billed_windows(kafka_settings, topic_catalog.costs) == cost_lines(first + second)  # once each
    assert ledger_bills(ledger) == sorted(keys(first) | keys(second))
    assert integrity(ledger) == [("ok",)]
