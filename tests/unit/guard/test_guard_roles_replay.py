"""The guard split in its scale-out roles publishes what the single guard publishes: ``gpumeter replay`` of every
guard scenario with its guard replaced by a ``nodes``-role processor (every rule but budgets, an engine per
partition) beside a ``budgets``-role one (the cost lines only) gives the same ``violations.jsonl`` records per
fingerprint, in the same order, as the ``all`` role -- every rule but ``budget_exceeded`` needs one node's input
only, and budgets need the cost lines only."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from pipeline import replay as replay_module
from pipeline.replay import read_jsonl, replay
from services.guard.config import GuardConfig
from services.guard.nodes import NodeGuardProcessor
from services.guard.processor import ROLE_BUDGETS, SERVICE_NAME, WINDOW_COSTS, GuardProcessor

REPO = Path(__file__).resolve().parents[3]
SCENARIOS = REPO / "scenarios"
CONFIG = GuardConfig.load(SCENARIOS / "guard" / "thresholds.yaml", {})


class SplitGuard:
    """A ``nodes``-role and a ``budgets``-role processor fed as the stream feeds them: every record to the first,
    the cost lines to the second too; both clocks run."""

    service = SERVICE_NAME

    def __init__(self, config, clock, **_) -> None:
        self.nodes = NodeGuardProcessor(config, clock, partitions=1)
        self.budgets = GuardProcessor(config, clock, role=ROLE_BUDGETS)
        self.inputs = self.nodes.inputs
        self.engine = self

    def active(self):
        return self.nodes.active() + self.budgets.engine.active()

    def handle(self, event, position):
        result = self.nodes.handle(event, position)
        if event.input == WINDOW_COSTS:
            result = result + self.budgets.handle(event, position)
        return result

    def on_clock(self, now_ms, caught_up=True):
        return self.nodes.on_clock(now_ms, caught_up) + self.budgets.on_clock(now_ms, caught_up)


def by_fingerprint(rows):
    groups = defaultdict(list)
    for row in rows:
        groups[row["fingerprint"]].append(row)
    return dict(groups)


@pytest.mark.parametrize("name", ["guard_visibility", "guard_idle", "guard_pressure", "guard_budget",
                                  "guard_gpu_error"])
def test_the_nodes_and_budgets_roles_together_publish_what_the_all_role_publishes(name, tmp_path, monkeypatch):
    replay(SCENARIOS / f"{name}.yaml", tmp_path / "all", guard_config=CONFIG)
    single = read_jsonl(tmp_path / "all" / "violations.jsonl")
    monkeypatch.setattr(replay_module, "GuardProcessor", SplitGuard)
    replay(SCENARIOS / f"{name}.yaml", tmp_path / "split", guard_config=CONFIG)
    split = read_jsonl(tmp_path / "split" / "violations.jsonl")
    assert single and by_fingerprint(split) == by_fingerprint(single)
    if name == "guard_budget":
        assert {r["rule"] for r in single} >= {"budget_exceeded"}
