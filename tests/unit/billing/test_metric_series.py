"""``SeriesBook``: a label set goes once no node holds it; a late window lets nothing go; a forgotten node lets go
of everything it held."""

from __future__ import annotations

from services.billing.metric_series import SeriesBook


def test_a_label_set_goes_when_its_last_node_bills_a_newer_window_without_it():
    removed: list[tuple] = []
    book = SeriesBook(lambda *labels: removed.append(labels))
    a, b = ("c", "node-a"), ("c", "node-b")
    book.observe(a, 60_000, [("ns", "db-0"), ("ns", "web")])
    book.observe(b, 60_000, [("ns", "db-0")])  # the same pod name on another node (a StatefulSet pod moved)
    book.observe(a, 0, [("ns", "old")])  # billed late: adds, lets nothing go
    assert removed == [] and ("ns", "old") in book
    book.observe(a, 120_000, [("ns", "web")])  # db-0 and old left node-a; node-b still holds db-0
    assert removed == [("ns", "old")] and ("ns", "db-0") in book
    book.observe(b, 120_000, [])
    assert removed == [("ns", "old"), ("ns", "db-0")] and len(book) == 1
    book.observe(a, 180_000, [("ns", "web"), ("x", "y")], prune=False)
    book.observe(a, 240_000, [], prune=False)  # a node's own series stay until the node is forgotten
    assert len(book) == 2
    book.forget(a)
    assert sorted(removed[2:]) == [("ns", "web"), ("x", "y")] and len(book) == 0
