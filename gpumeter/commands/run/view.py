"""The live view of ``gpumeter run`` as one rich renderable (``render_view``): GPU shares per unit, cost by
namespace and by team (direct and shared), active violations, processes. The state it shows is
``gpumeter.commands.live_view``'s (pure, tested without a terminal)."""

from __future__ import annotations

import zlib
from typing import Sequence

from gpumeter.commands import live_view
from gpumeter.commands.live_view import ProcessHealth, ProcessState, ViewState

_POD_COLOURS = ("dodger_blue1", "green3", "orange1", "magenta", "cyan", "gold1", "medium_purple1", "spring_green2",
                "deep_pink2", "turquoise2", "light_salmon1", "chartreuse2")
_BUCKET_STYLE = {"idle": ("░", "grey62"), "reserved": ("▒", "grey42"), "unattributed": ("▓", "red3"),
                 "unavailable": ("╳", "dark_red")}


def _segment_style(segment: live_view.BarSegment) -> tuple[str, str]:
    from schemas.records import ShareSubjectKind

    if segment.kind is ShareSubjectKind.POD:
        key = (segment.pod_uid or segment.label).encode()
        return "█", _POD_COLOURS[zlib.crc32(key) % len(_POD_COLOURS)]
    return _BUCKET_STYLE[segment.label]


def render_view(state: ViewState, health: Sequence[ProcessHealth], header: str, undecodable: int = 0):
    """The live view as one rich renderable."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    shares = Table(title="GPU shares — cost share of each GPU unit in its last closed window (adds up to 100 %)",
                   box=box.SIMPLE_HEAD, expand=False, title_justify="left", pad_edge=False)
    shares.add_column("node")
    shares.add_column("GPU unit")
    shares.add_column("mode")
    shares.add_column("window", no_wrap=True)
    shares.add_column("share", no_wrap=True)
    shares.add_column("who", overflow="fold")
    for unit in live_view.unit_windows(state):
        segments = live_view.bar_segments(unit)
        bar = Text()
        legend = Text()
        for segment in segments:
            char, style = _segment_style(segment)
            bar.append(char * segment.cells, style=style)
            if segment.tenths:
                if legend:
                    legend.append(" · ")
                legend.append(f"{segment.label} {segment.percent_text}", style=style)
        legend.append(f" = {live_view.tenths_text(sum(s.tenths for s in segments))}")
        start = live_view.iso_utc(unit.window_start_unix_ms)[11:19]
        shares.add_row(unit.key.node_name, unit.describe(), unit.first.sharing_mode.value.lower(), start, bar, legend)
    if not state.units:
        shares.add_row("-", "(waiting for the first closed window)", "", "", "", "")

    shared_total = live_view.shared_total_micro_usd(state)

    def cost_table(title: str, rows: Sequence[live_view.CostRow]) -> Table:
        # direct: the group's pods' own use; shared: their part of buckets the sharing policy shared to them.
        table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
        table.add_column("group")
        table.add_column("cost so far", justify="right")
        table.add_column("direct", justify="right")
        table.add_column("shared", justify="right")
        table.add_column("%", justify="right")
        for row in rows:
            table.add_row(Text(row.group, style="grey62" if row.is_bucket else ""), row.usd, row.direct_usd,
                          row.shared_usd, row.percent_text)
        total = state.cost_total_micro_usd
        table.add_row(Text("total", style="bold"), Text(live_view.usd_text(total), style="bold"),
                      live_view.usd_text(total - shared_total), live_view.usd_text(shared_total), "")
        return table

    costs = Table.grid(padding=(0, 4))
    costs.add_row(cost_table("Cost by namespace", live_view.namespace_costs(state)),
                  cost_table(f"Cost by label {state.team_label}", live_view.team_costs(state)))

    violations = Table(title=f"Active violations ({live_view.resolved_count(state)} resolved)", box=box.SIMPLE_HEAD,
                       title_justify="left", pad_edge=False)
    for column in ("rule", "severity", "subject", "first seen", "summary"):
        violations.add_column(column, overflow="fold")
    for row in live_view.active_violations(state):
        style = "bold red" if row.severity.value == "CRITICAL" else "yellow"
        violations.add_row(Text(row.rule, style=style), row.severity.value, row.subject,
                           live_view.iso_utc(row.first_seen_unix_ms)[11:19], row.summary)
    if not live_view.active_violations(state):
        violations.add_row("-", "", "(none firing)", "", "")

    processes = Table(title="Processes", box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    for column in ("process", "pid", "state", "restarts", "uptime"):
        processes.add_column(column)
    for h in health:
        style = "green" if h.state is ProcessState.RUNNING else ("red" if not h.healthy else "yellow")
        state_text = h.state.value + (f" (exit {h.exit_code})" if h.exit_code is not None else "")
        processes.add_row(h.name, str(h.pid or "-"), Text(state_text, style=style), str(h.restarts),
                          f"{h.uptime_seconds:.0f}s" if h.state is ProcessState.RUNNING else "-")
    footer = Text(style="grey62")
    footer.append(f"dead letters {sum(state.dead_letters.values())}")
    if state.dead_letters:
        footer.append(" (" + ", ".join(f"{service}/{reason} {count}"
                                       for (service, reason), count in sorted(state.dead_letters.items())) + ")")
    if undecodable:
        footer.append(f" · undecodable records {undecodable}")
    footer.append(" · Ctrl-C stops everything cleanly")
    return Group(Text(header, style="bold"), shares, costs, violations, processes, footer)


