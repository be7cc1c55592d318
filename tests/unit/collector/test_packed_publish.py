"""The collector's tick on the wire: NodeSample v4 on the packed topic."""

from __future__ import annotations

from gpumeter.clock import ManualClock
from schemas.catalog import TopicCatalog
from schemas.records import NodeSample
from schemas.typed import codec_for
from services.collector.assemble import NodeFacts
from services.collector.publisher import OutboundRecord
from services.collector.service import CollectorService


async def test_a_tick_is_published_as_node_sample_v4_on_the_packed_topic():
    """The collector writes NodeSample v4 (packed columns) to gpumeter.node-samples.v3, which v3 readers do not
    read (docs/migration-v4.md); it decodes back to the tick it assembled."""
    offered: list[OutboundRecord] = []

    class _Publisher:
        def offer(self, record):
            offered.append(record)

    class _Backend:
        def read(self):
            return [], []

    class _Identities:
        def retain_only(self, pids):
            return 0

    service = CollectorService(
        facts=NodeFacts("c", "node-1", "aws", "r", "t", "on_demand"), interval_seconds=1.0, clock=ManualClock(1_000),
        backend=_Backend(), identities=_Identities(), publisher=_Publisher(), catalog=TopicCatalog(prefix="p."),
    )
    sample = await service.tick()
    (record,) = offered
    assert record.topic == "p.gpumeter.node-samples.v3" and record.key == b"node-1"
    writer = codec_for(NodeSample).packed.writer_of(record.value)
    assert (writer.full_name, writer.version) == ("gpumeter.NodeSample", 4)
    assert codec_for(NodeSample).decode(record.value) == sample
