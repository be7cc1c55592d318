"""Text from outside (pod names, labels, URLs, library messages) shown safely: one owner for every output.

* ``escape_control(text)``: every control character -- C0 (newline, carriage return, tab, ESC of ANSI
  sequences, ...), DEL, C1, the Unicode line and paragraph separators and the bidirectional overrides -- as a
  visible escape (``\\n``, ``\\r``, ``\\t``, ``\\x1b``, ``\\u2028``). One log record stays one line and a terminal
  never interprets a sequence someone else chose. Backslashes are left alone (a forged ``\\n`` is two harmless
  characters).
* ``csv_cell(text)``: a text cell a spreadsheet will not run: OWASP's rule -- a cell starting with ``=``, ``+``,
  ``-``, ``@``, a tab or a carriage return gets a leading ``'`` -- after ``escape_control``. For text cells only;
  numbers gpumeter formats itself stay numbers.
* ``SafeTextFilter``: a logging filter that rewrites each record to its finished message with secrets masked
  (``gpumeter.redact.mask_secrets``) and control characters escaped, and its traceback with secrets masked and
  every control character but the line breaks between frames escaped. Every service's root handlers carry one
  (``gpumeter.logflood.guard_root_handlers``), after the flood filter, which needs the message template.
"""

from __future__ import annotations

import logging
import re

from gpumeter.redact import mask_secrets

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_CONTROL_BUT_NEWLINE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
CSV_FORMULA_PREFIXES = ("=", "+", "-", "@", "\t", "\r")


def _escape(match: re.Match) -> str:
    char = match.group()
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def escape_control(text: str) -> str:
    """``text`` with every control character as a visible escape (see the module docstring)."""
    return _CONTROL.sub(_escape, text)


def csv_cell(text: str) -> str:
    """``text`` as a CSV text cell no spreadsheet evaluates (OWASP CSV injection rule)."""
    if text.startswith(CSV_FORMULA_PREFIXES):
        text = "'" + text
    return escape_control(text)


class SafeTextFilter(logging.Filter):
    """Rewrites every record it sees to safe text (see the module docstring); never drops one."""

    _exceptions = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: log what there is rather than lose the record
            message = f"{record.msg!r} % {record.args!r}"
        record.msg = escape_control(mask_secrets(message))
        record.args = ()
        if record.exc_info and not record.exc_text:
            record.exc_text = self._exceptions.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = _CONTROL_BUT_NEWLINE.sub(_escape, mask_secrets(record.exc_text))
        if record.stack_info:
            record.stack_info = _CONTROL_BUT_NEWLINE.sub(_escape, mask_secrets(record.stack_info))
        return True


__all__ = ["CSV_FORMULA_PREFIXES", "SafeTextFilter", "csv_cell", "escape_control"]
