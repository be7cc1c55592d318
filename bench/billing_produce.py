"""Billing's producing, against a real broker: the client CPU per node-window of handing its ~97 cost records to
Kafka one ``Outbox.send`` each (as billing did) or as one ``Outbox.send_many`` (one producer batch, as it does now).

``python -m bench.billing_produce [NODE_WINDOWS] [ROUNDS]``: starts a throwaway broker
(``gpumeter.devtools.kafka_broker``), prices ``NODE_WINDOWS`` bench node-windows (``bench.billing``'s template,
one node each), then alternates the two ways (``ROUNDS`` each, best kept), each sending every node-window's
``CostRecord``s through one ``Outbox`` over one ``RecordProducer`` and flushing. CPU is this process's
(encoding, outbox, aiokafka's accumulator, compression and sender), not the broker's.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

TOPIC = "bench.costs"


async def _measure(bootstrap: str, windows: list, rounds: int) -> dict[str, float]:
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    from gpumeter.kafka.outbox import Outbox
    from gpumeter.kafka.producer import RecordProducer
    from gpumeter.settings import KafkaSettings

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(TOPIC, 12, 1)])
    finally:
        await admin.close()
    producer = RecordProducer(KafkaSettings(bootstrap_servers=bootstrap))
    await producer.start()

    async def no_pause(_seconds: float) -> None:
        return None

    outbox = Outbox(producer, pause=no_pause)
    best = {"send": float("inf"), "send_many": float("inf")}
    try:
        for key, records in windows[:20]:  # warm: metadata, connections
            await outbox.send_many(TOPIC, key, records)
        await outbox.flush()
        for n in range(rounds):
            for mode in ("send", "send_many") if n % 2 == 0 else ("send_many", "send"):
                cpu = time.process_time()
                for key, records in windows:
                    if mode == "send":
                        for record in records:
                            await outbox.send(TOPIC, key, record)
                    else:
                        await outbox.send_many(TOPIC, key, records)
                await outbox.flush()
                best[mode] = min(best[mode], (time.process_time() - cpu) / len(windows) * 1000)
    finally:
        await producer.stop()
    return best


def main(argv: list[str]) -> int:
    from bench.billing import clone, template_shares
    from gpumeter.devtools.kafka_broker import KafkaBroker
    from gpumeter.entrypoint import tune_garbage_collector
    from services.billing.catalog import bundled_catalog
    from services.billing.costing import bill_node_window

    count = int(argv[0]) if argv else 200
    rounds = int(argv[1]) if len(argv) > 1 else 6
    tune_garbage_collector()  # as billing's main
    template, catalog = template_shares(), bundled_catalog()
    windows = []
    for node in range(count):
        record = clone(template, node, 0)
        windows.append((record.node_name.encode(), list(bill_node_window(record.rows(), catalog).costs)))
    with tempfile.TemporaryDirectory(prefix="gpumeter-bench-produce-") as state:
        broker = KafkaBroker(Path(state), heap_mb=768)
        broker.start()
        try:
            best = asyncio.run(_measure(broker.bootstrap_servers, windows, rounds))
        finally:
            broker.stop()
    print({"node_windows": count, "records_per_node_window": len(windows[0][1]),
           "best_cpu_ms_per_node_window": {k: round(v, 3) for k, v in best.items()},
           "ratio": round(best["send"] / best["send_many"], 2)})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
