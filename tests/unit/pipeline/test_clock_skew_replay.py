"""A node whose clock is off, through ``gpumeter replay``: billed in the windows it was really sampled in, with full
coverage -- the same shares, cost lines and bills as the same scenario without the skew -- and reported.

The scenario option ``clock_offset_seconds`` stamps the node's ticks and pod events (its collector's and its
kubelet's clock) that far off, while replay's broker appends them at the scenario's time: the broker's clock, which
gpumeter trusts (``gpumeter.clockskew``). Before the correction a node 10 minutes behind had every tick dead-lettered
``LATE`` (its windows closed by the clock long before), and one 10 minutes ahead every tick ``OUT_OF_RANGE``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pipeline.replay import read_jsonl, replay

REPO = Path(__file__).resolve().parents[3]
SCENARIO = REPO / "scenarios" / "two_nodes.yaml"
SKEWED_NODE = "node-ts"  # its pods come and go during the scenario: pod times must be corrected too


def _scenario(tmp_path: Path, offset_seconds: int | None) -> Path:
    data = yaml.safe_load(SCENARIO.read_text())
    data["duration_seconds"] = 300  # several windows, pods starting within them
    if offset_seconds is not None:
        node = next(n for n in data["nodes"] if n["name"] == SKEWED_NODE)
        node["clock_offset_seconds"] = offset_seconds
    path = tmp_path / f"skew_{offset_seconds}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _outputs(out: Path) -> dict[str, list]:
    key = lambda row: repr(sorted(row.items()))  # noqa: E731
    return {name: sorted(read_jsonl(out / name), key=key)
            for name in ("shares.jsonl", "costs.jsonl", "bills.jsonl", "truth.jsonl")}


@pytest.fixture(scope="module")
def unskewed(tmp_path_factory) -> dict[str, list]:
    tmp = tmp_path_factory.mktemp("unskewed")
    summary = replay(_scenario(tmp, None), tmp / "out")
    assert set(summary.dead_letters) <= {"NO_PRICE"} and summary.bills > 0  # node-a100's spot price is unknown
    return _outputs(tmp / "out")


@pytest.mark.parametrize("offset_seconds", [-600, 600, -150, 30])
def test_a_node_whose_clock_is_off_is_billed_as_if_it_were_right(offset_seconds, unskewed, tmp_path):
    summary = replay(_scenario(tmp_path, offset_seconds), tmp_path / "out")
    letters = read_jsonl(tmp_path / "out" / "dead_letters.jsonl")
    assert {d["reason_code"] for d in letters} <= {"NO_PRICE"}
    assert not [d for d in letters if SKEWED_NODE in d["reason"]]
    skewed = _outputs(tmp_path / "out")
    # Full coverage: every window of the node covered as without the skew.
    covered = {(r["node"], r["window_start"]): r["node_covered_seconds"] for r in skewed["shares.jsonl"]}
    assert covered == {(r["node"], r["window_start"]): r["node_covered_seconds"] for r in unskewed["shares.jsonl"]}
    assert skewed == unskewed


def test_the_skew_is_reported_by_the_guard(tmp_path):
    replay(_scenario(tmp_path, -600), tmp_path / "out")
    violations = [v for v in read_jsonl(tmp_path / "out" / "violations.jsonl") if v["rule"] == "clock_skew"]
    assert violations and {v["node"] for v in violations} == {SKEWED_NODE}
    firing = [v for v in violations if v["state"] == "firing"]
    assert firing and firing[0]["evidence"]["clock_skew_seconds"] == pytest.approx(-600)
