"""The time arguments of the ledger's commands (``gpumeter report``, ``export``, ``ledger retention``): a window
as a duration (``--window 24h``) and an instant (``--end``, ``--now``), parsed once here. Pure; ``ConfigError`` on
what cannot be read."""

from __future__ import annotations

import re
from datetime import datetime, timezone

from gpumeter.errors import ConfigError

_DURATION_RE = re.compile(r"^\s*(\d+)\s*([smhdw])\s*$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration_seconds(text: str) -> int:
    """``90m``, ``24h``, ``7d``, ``2w``, ``3600s`` → seconds (> 0); ``ConfigError`` otherwise."""
    match = _DURATION_RE.match(text or "")
    if not match or int(match.group(1)) == 0:
        raise ConfigError(f"window {text!r} is not a duration like 90m, 24h or 7d")
    return int(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def parse_instant_ms(text: str) -> int:
    """An ISO 8601 instant (``2026-11-29T17:00:00Z``; no zone means UTC) → ms since the Unix epoch."""
    try:
        moment = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ConfigError(f"{text!r} is not an ISO 8601 time such as 2026-11-29T17:00:00Z") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return int(moment.timestamp() * 1000)
