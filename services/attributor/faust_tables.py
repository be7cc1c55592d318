"""Faust's table recovery with one race closed: a changelog partition assigned while a recovery pass is running.

faust-streaming 0.15.3 (``faust.tables.recovery.Recovery._restart_recovery``) builds the changelog offsets it will
seek to at the start of a pass, then seeks them much later. A rebalance that lands in between adds the newly
assigned partitions to the same dicts with the offset ``None`` ("nothing read yet") and the running pass seeks
them as they are: ``aiokafka`` refuses ``seek(tp, None)`` with ``ValueError('Offset must be a positive
integer')`` and the worker stops. Seen in ``make bench``'s two-worker phase, where the second worker's join
rebalances the group twice within a few seconds (``Starting standby partitions...`` then the crash).

``SafeSeekRecovery`` gives a partition that has no offset yet what ``_build_offsets`` gives one with nothing
persisted: ``-1``, read from the start. The rebalance has also set ``signal_recovery_start``, so the next pass
rebuilds every offset from the broker (the earliest retained offset wins over ``-1`` there) before anything
counts as recovered: the early seek only starts the read sooner, it never skips a record.

``GpumeterTableManager`` is what ``faust.App(TableManager=...)`` is given so that its recovery is this one.
"""

from __future__ import annotations

from typing import Any

from faust.tables.manager import TableManager
from faust.tables.recovery import Recovery

NOTHING_READ_OFFSET = -1
"""Faust's own mark for "no changelog record applied yet" (``_build_offsets`` writes it; a seek goes to 0)."""


class SafeSeekRecovery(Recovery):
    """``Recovery`` whose seeks never pass a ``None`` offset to the consumer (see the module's docstring)."""

    async def _seek_offsets(self, consumer: Any, tps: Any, offsets: Any, title: str) -> None:
        for tp in tps:
            if offsets.get(tp) is None:
                # Written back, not only seeked: standby_remaining() and the consistency check compare it with ints.
                offsets[tp] = NOTHING_READ_OFFSET
        await super()._seek_offsets(consumer, tps, offsets, title)


class GpumeterTableManager(TableManager):
    """Faust's table manager with ``SafeSeekRecovery`` as its recovery service."""

    @property
    def recovery(self) -> Recovery:
        if self._recovery is None:
            self._recovery = SafeSeekRecovery(self.app, self, beacon=self.beacon, loop=self.loop)
        return self._recovery
