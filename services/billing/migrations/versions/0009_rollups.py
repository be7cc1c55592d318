"""Rollups: hourly and daily sums of the cost lines, the retention horizons, and each bill's GPU model.

* ``cost_rollup_hourly`` / ``cost_rollup_daily``: one row per period (UTC hour / day of the windows' starts) and
  (cluster, node, GPU model, sharing policy, namespace, team label key and value, subject kind, bucket shared,
  sharing method, carried label keys), with the lines' list cost, their trued-up-or-list cost, and the counts of
  lines and of trued lines (``services.billing.rollups``). Maintained by ``Ledger.write`` and ``apply_trueup``
  from here on; **backfilled** now from the existing lines (the team read under the migrating ledger's
  ``team_label``, default ``team``), so the rollups of an upgraded ledger equal its lines to the micro-dollar:
  the ``cost_lines`` rows with their label sets (revision 0008's layout) and the zero lines their bills list
  (``node_bills.zero_lines``, decoded by ``services.billing.line_storage``), so a rollup's ``cost_lines`` counts
  every line billing wrote, as every reader does; a zero line of a trued-up node-window is a trued line (its
  trued-up cost reads 0).
* ``ledger_retention``: per grain, the oldest period still kept (``services.billing.retention``); empty: nothing
  was dropped.
* ``node_bills.gpu_model``: the node-window's GPU model ('' for bills written before this revision, and so in
  their rollups).

Revision ID: 0009_rollups
Revises: 0008_compact_lines
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections import defaultdict

import sqlalchemy as sa
from alembic import context, op
from sqlalchemy.dialects import postgresql, sqlite

from services.billing.line_storage import decode_zero_lines

revision = "0009_rollups"
down_revision = "0008_compact_lines"
branch_labels = None
depends_on = None

_DIMENSIONS = ("period_start_unix_ms", "cluster", "node_name", "gpu_model", "sharing", "namespace", "team_key",
               "team", "has_team", "subject_kind", "shared_from", "sharing_method", "carried_label_keys")
_MEASURES = ("cost_micro_usd", "billed_micro_usd", "cost_lines", "trued_lines")
_HOUR_MS = 3_600_000
_DAY_MS = 86_400_000


def _create_rollup(name: str) -> None:
    op.create_table(
        name,
        sa.Column("period_start_unix_ms", sa.BigInteger(), nullable=False),
        sa.Column("cluster", sa.String(253), nullable=False),
        sa.Column("node_name", sa.String(253), nullable=False),
        sa.Column("gpu_model", sa.String(128), nullable=False),
        sa.Column("sharing", sa.String(255), nullable=False),
        sa.Column("namespace", sa.String(253), nullable=False),
        sa.Column("team_key", sa.String(317), nullable=False),
        sa.Column("team", sa.Text(), nullable=False),
        sa.Column("has_team", sa.Boolean(), nullable=False),
        sa.Column("subject_kind", sa.String(16), nullable=False),
        sa.Column("shared_from", sa.String(16), nullable=False),
        sa.Column("sharing_method", sa.String(16), nullable=False),
        sa.Column("carried_label_keys", sa.Text(), nullable=False),
        sa.Column("cost_micro_usd", sa.BigInteger(), nullable=False),
        sa.Column("billed_micro_usd", sa.BigInteger(), nullable=False),
        sa.Column("cost_lines", sa.BigInteger(), nullable=False),
        sa.Column("trued_lines", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint(*_DIMENSIONS, name=f"pk_{name}"),
    )


def _rollup(name: str):
    return sa.table(name, *(sa.column(n) for n in (*_DIMENSIONS, *_MEASURES)))


def _backfill(team_key: str) -> None:
    labels_type = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
    lines = sa.table("cost_lines", sa.column("window_start_unix_ms"), sa.column("cluster"), sa.column("node_name"),
                     sa.column("namespace"), sa.column("label_set_id"), sa.column("subject_kind"),
                     sa.column("shared_from"), sa.column("sharing_method"), sa.column("cost_micro_usd"),
                     sa.column("trued_cost_micro_usd"))
    label_sets = sa.table("label_sets", sa.column("label_set_id"), sa.column("labels", labels_type),
                          sa.column("carried_label_keys"))
    bills = sa.table("node_bills", sa.column("window_start_unix_ms"), sa.column("cluster"), sa.column("node_name"),
                     sa.column("sharing"), sa.column("gpu_model"), sa.column("trued_cost_micro_usd"),
                     sa.column("zero_lines"))
    c, l, b = lines.c, label_sets.c, bills.c
    team = l.labels[team_key].as_string()
    # Grouping over a subquery keeps PostgreSQL from seeing two differently-bound copies of an expression.
    inner = (
        sa.select((c.window_start_unix_ms - c.window_start_unix_ms % _HOUR_MS).label("period_start_unix_ms"),
                  c.cluster, c.node_name, b.gpu_model, b.sharing,
                  sa.func.coalesce(c.namespace, "").label("namespace"), sa.literal(team_key).label("team_key"),
                  sa.func.coalesce(team, "").label("team"),
                  sa.case((team.is_(None), sa.false()), else_=sa.true()).label("has_team"),
                  c.subject_kind, c.shared_from, c.sharing_method, l.carried_label_keys, c.cost_micro_usd,
                  sa.func.coalesce(c.trued_cost_micro_usd, c.cost_micro_usd).label("billed"),
                  c.trued_cost_micro_usd)
        .select_from(lines.join(label_sets, l.label_set_id == c.label_set_id)
                     .join(bills, (b.window_start_unix_ms == c.window_start_unix_ms) & (b.cluster == c.cluster)
                           & (b.node_name == c.node_name)))
        .subquery()
    )
    keys = [inner.c[n] for n in _DIMENSIONS]
    hourly = sa.select(*keys, sa.func.sum(inner.c.cost_micro_usd), sa.func.sum(inner.c.billed), sa.func.count(),
                       sa.func.count(inner.c.trued_cost_micro_usd)).group_by(*keys)
    op.execute(sa.insert(_rollup("cost_rollup_hourly")).from_select([*_DIMENSIONS, *_MEASURES], hourly))
    _backfill_zero_lines(bills, team_key)
    source = _rollup("cost_rollup_hourly").c
    inner = sa.select((source.period_start_unix_ms - source.period_start_unix_ms % _DAY_MS)
                      .label("period_start_unix_ms"), *(source[n] for n in (*_DIMENSIONS[1:], *_MEASURES))).subquery()
    keys = [inner.c[n] for n in _DIMENSIONS]
    daily = sa.select(*keys, *(sa.func.sum(inner.c[n]) for n in _MEASURES)).group_by(*keys)
    op.execute(sa.insert(_rollup("cost_rollup_daily")).from_select([*_DIMENSIONS, *_MEASURES], daily))


def _backfill_zero_lines(bills, team_key: str) -> None:
    """Add the zero lines the bills list (revision 0008: not ``cost_lines`` rows) to the hourly rollup: no cost,
    one line each, a trued line where their bill is trued up (their trued-up cost is 0 there, NULL elsewhere)."""
    b = bills.c
    counts: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    for start, cluster, node, gpu_model, sharing, trued, text in op.get_bind().execute(
            sa.select(b.window_start_unix_ms, b.cluster, b.node_name, b.gpu_model, b.sharing,
                      b.trued_cost_micro_usd, b.zero_lines).where(b.zero_lines.is_not(None))):
        for _gpu, kind, *_ in decode_zero_lines(text):
            # The dimensions of a line with no namespace, labels, carried keys or share (``rollups.line_key``).
            sums = counts[(start - start % _HOUR_MS, cluster, node, gpu_model, sharing, "", team_key, "", False,
                           kind, "", "", "")]
            sums[0] += 1
            sums[1] += trued is not None
    if not counts:
        return
    table = _rollup("cost_rollup_hourly")
    insert = (postgresql.insert if op.get_bind().dialect.name == "postgresql" else sqlite.insert)(table)
    statement = insert.on_conflict_do_update(
        index_elements=list(_DIMENSIONS),
        set_={n: table.c[n] + insert.excluded[n] for n in _MEASURES})
    op.get_bind().execute(statement, [
        {**dict(zip(_DIMENSIONS, key)), "cost_micro_usd": 0, "billed_micro_usd": 0, "cost_lines": lines,
         "trued_lines": trued} for key, (lines, trued) in sorted(counts.items())])


def upgrade() -> None:
    op.add_column("node_bills", sa.Column("gpu_model", sa.String(128), nullable=False, server_default=""))
    _create_rollup("cost_rollup_hourly")
    _create_rollup("cost_rollup_daily")
    op.create_table(
        "ledger_retention",
        sa.Column("grain", sa.String(16), nullable=False),
        sa.Column("kept_from_unix_ms", sa.BigInteger(), nullable=False),
        sa.Column("applied_at_unix_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("grain", name="pk_ledger_retention"),
    )
    _backfill(context.config.attributes.get("team_label") or "team")


def downgrade() -> None:
    # Dropping the rollups loses nothing the lines do not hold, unless retention dropped lines: then the rollups
    # are the only record of those periods by namespace and team, and going back would lose them.
    dropped = op.get_bind().execute(sa.text("SELECT count(*) FROM ledger_retention")).scalar()
    if dropped:
        raise RuntimeError("retention dropped cost lines that only the rollups still sum; revision 0008 has no place "
                           "for them")
    op.drop_table("ledger_retention")
    op.drop_table("cost_rollup_daily")
    op.drop_table("cost_rollup_hourly")
    # Not in batch mode: recreating node_bills would drop a table cost_lines' foreign key points at.
    op.drop_column("node_bills", "gpu_model")
