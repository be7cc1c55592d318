"""The one masker of secrets in text gpumeter shows: settings printouts, log lines, error messages.

``mask_url(url)`` shows a URL with its password and its secret query parameters as ``***``, whatever the URL's
shape -- parsed or not, well formed or not -- and never raises. It hides the union of what the client libraries
would take for a secret, so that a secret one library reads differently from another still never shows:

* **User info.** SQLAlchemy's ``make_url`` ends the password at the *first* "@" (``u:PG@SECRET@host`` connects to
  host ``SECRET@host``), urllib, yarl and aiohttp end the user info at the *last* "@" of the authority, and
  SQLAlchemy lets a password hold "/" and "?" where urllib ends the authority at them. So: the user info runs from
  after ``scheme://`` to the last "@" before the first "?" or "#" (to the first "@" when none comes before them:
  ``u:a?b@host``); the user name (up to its first ":") stays, everything after that ":" is the password.
* **Query parameters** whose names say they hold a secret (``password``, libpq's ``sslpassword``, ``sslkey``,
  ``passfile``, anything with ``pass``, ``pwd``, ``secret``, ``token``, ``key``, ``auth`` or ``credential``; the
  name percent-decoded and in any case): the value becomes ``***``, as do the bare pieces after it (an unencoded
  "&" in the secret).
* **Text that is not a URL** (a libpq ``key=value`` connection string, a typo without ``://``): the values of
  secret-named keys are masked.

``mask_secrets(text)`` applies ``mask_url`` to every URL inside free text and masks ``password=...``-style pairs;
every service's log handlers (``gpumeter.safetext.SafeTextFilter``) run every log line through it, behind the
masking each message already does at its source.
"""

from __future__ import annotations

import re
from urllib.parse import unquote_plus

SECRET_MARK = "***"

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")
_SECRET_NAME = re.compile(r"pass|pwd|secret|token|key|auth|credential", re.IGNORECASE)
# key=value pairs outside URLs (libpq conninfo, free text): only names that unmistakably hold a secret.
_TEXT_PAIR = re.compile(
    r"(?P<key>\b[\w.-]*(?:password|passwd|pwd|secret|token|sslkey|passfile)[\w.-]*)(?P<eq>\s*[=:]\s*)"
    r"(?P<value>'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|[^\s&;,'\"]+)",
    re.IGNORECASE,
)
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s\"'<>]+")


def _userinfo_end(rest: str) -> int:
    """Index in ``rest`` (the URL after ``scheme://``) of the "@" that ends its user info; -1 when it has none."""
    first = rest.find("@")
    if first < 0:
        return -1
    stop = len(rest)
    for mark in "?#":
        at = rest.find(mark)
        if at >= 0:
            stop = min(stop, at)
    last = rest.rfind("@", 0, stop)
    return last if last >= 0 else first


def _mask_query(query: str) -> str:
    pieces = query.split("&")
    masked, after_secret = [], False
    for piece in pieces:
        name, eq, _ = piece.partition("=")
        if eq and _SECRET_NAME.search(unquote_plus(name)):
            masked.append(f"{name}={SECRET_MARK}")
            after_secret = True
        elif not eq and after_secret and piece:
            masked.append(SECRET_MARK)  # the tail of a secret that held an unencoded "&"
        else:
            masked.append(piece)
            after_secret = False
    return "&".join(masked)


def _mask_pairs(text: str) -> str:
    return _TEXT_PAIR.sub(lambda m: f"{m['key']}{m['eq']}{SECRET_MARK}", text)


def mask_url(url: str) -> str:
    """``url`` with its password and secret query parameters shown as ``***`` (see the module docstring).
    Never raises; anything that is not a string comes back as its masked ``str``."""
    if not isinstance(url, str):
        url = str(url)
    scheme = _SCHEME.match(url)
    if scheme is None:
        return _mask_pairs(url)
    rest = url[scheme.end():]
    end = _userinfo_end(rest)
    if end >= 0:
        user, colon, _password = rest[:end].partition(":")
        shown = f"{scheme.group()}{user}{':' + SECRET_MARK if colon else ''}@"
        rest = rest[end + 1:]
    else:
        shown = scheme.group()
    fragment_at = rest.find("#")
    body, fragment = (rest, "") if fragment_at < 0 else (rest[:fragment_at], rest[fragment_at:])
    path, question, query = body.partition("?")
    if question:
        query = _mask_query(query)
    return f"{shown}{path}{question}{query}{fragment}"


def mask_secrets(text: str) -> str:
    """``text`` with every URL in it masked by ``mask_url`` and ``password=...``-style values as ``***``."""
    if "://" in text:
        text = _URL_IN_TEXT.sub(lambda m: mask_url(m.group()), text)
    return _mask_pairs(text)


__all__ = ["SECRET_MARK", "mask_secrets", "mask_url"]
