"""The one settings loader: frozen dataclasses whose fields declare where their value comes from.

A settings class is a frozen dataclass whose fields are made with ``setting(...)`` (a value read from a flag and/or
environment variables) or ``nested(OtherSettings, ...)`` (a settings object loaded by the same rules, e.g.
``KafkaSettings`` inside every service's settings). Its ``__post_init__`` calls ``validate(self)`` first and then
checks what involves more than one field. Four functions do the rest for every service:

* ``add_arguments(parser, cls)``: one argparse flag per setting that has one (nested settings' flags included),
  each taking text; its help names the environment variable(s) and the default.
* ``load(cls, args, env)``: the settings object. Precedence, per setting: the flag (when given on the command line),
  then the environment variables in the order the setting names them (the first one set wins), then the default.
* ``describe(settings)``: a JSON-ready dict for the start-up line, secrets redacted (``gpumeter.redact``).
* ``env_variables(cls)``: every environment variable the class (and its nested settings) reads.

The rules, the same for every service:

* **Whitespace.** Text is stripped of surrounding whitespace, wherever it comes from. An environment variable that
  is empty after stripping is unset (its default applies). A flag given on the command line is set even when empty
  (``--topic-prefix ""`` is the empty prefix, over ``GPUMETER_KAFKA_TOPIC_PREFIX``). Text given to a field whose
  default is None, blank after stripping, is None.
* **Text to value.** A field given as text -- by the loader, or directly to the constructor -- goes through the
  setting's ``parse``; then any value other than None through its ``check`` (which may normalise it). Both raise
  ``ValueError`` or a ``ConfigError`` with a reason; the loader turns it into ``SettingError`` naming the flag, the
  environment variable and the value (redacted when the setting is secret).
* **Secrets.** ``secret=True`` (a credential: a password, a URL with one) keeps the value out of ``repr``, out of
  ``describe()`` (``mask(value)`` when a ``mask`` is given, e.g. ``mask_url`` for a URL that carries a password;
  else ``***``) and out of error messages. A ``mask`` without ``secret`` is for a value that is no credential but
  may hold one (an API server URL): ``describe()`` and errors show it masked.
* **Kafka client ids.** One rule, ``KafkaSettings``' own: ``GPUMETER_KAFKA_CLIENT_ID`` when set, else the default
  the service's ``nested(KafkaSettings, client_id=...)`` declares; checked by ``check_client_id``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from dataclasses import MISSING, dataclass, field, fields
from decimal import Decimal
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from gpumeter.errors import ConfigError, GpumeterError, SettingError
from gpumeter.redact import SECRET_MARK, mask_secrets

METADATA_KEY = "gpumeter.setting"


@dataclass(frozen=True)
class Setting:
    """Where one field's value comes from and how its text becomes a value (the metadata ``setting()`` stores)."""

    env: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()
    parse: Callable[[str], Any] | None = None
    check: Callable[[Any], Any] | None = None
    help: str = ""
    secret: bool = False
    mask: Callable[[Any], Any] | None = None
    default_text: str | None = None
    metavar: str | None = None
    nested: type | None = None
    nested_defaults: Mapping[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """``--flag / GPUMETER_VAR``: how errors and docs name the setting."""
        names = [*self.flags[:1], *self.env]
        return " / ".join(names)


def text(raw: str) -> str:
    """Text as given (already stripped)."""
    return raw


def integer(raw: str) -> int:
    """A whole number in decimal."""
    try:
        return int(raw, 10)
    except ValueError:
        raise ValueError("is not a whole number") from None


def number(raw: str) -> float:
    """A finite decimal number."""
    try:
        value = float(raw)
    except ValueError:
        raise ValueError("is not a number") from None
    if not math.isfinite(value):
        raise ValueError("is not a finite number")
    return value


def path(raw: str) -> Path:
    return Path(raw)


def one_of(*allowed: str) -> Callable[[Any], Any]:
    """A check: the value is one of ``allowed`` (as written)."""
    def check(value: Any) -> Any:
        if value not in allowed:
            raise ValueError(f"is not one of {', '.join(allowed)}")
        return value
    return check


def at_least(minimum: float) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if value < minimum:
            raise ValueError(f"must be >= {minimum:g}")
        return value
    return check


def greater_than(bound: float) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if not value > bound:
            raise ValueError(f"must be > {bound:g}")
        return value
    return check


def between(low: float, high: float) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if not low <= value <= high:
            raise ValueError(f"must be {low:g} to {high:g}")
        return value
    return check


def non_empty(value: Any) -> Any:
    if not value:
        raise ValueError("is empty")
    return value


_CLIENT_ID = re.compile(r"[A-Za-z0-9._-]{1,255}")


def check_client_id(value: str) -> str:
    """The one client-id rule: 1 to 255 of ``A-Z a-z 0-9 . _ -`` (what Kafka accepts in a quota entity and a
    metric tag without escaping)."""
    if not _CLIENT_ID.fullmatch(value):
        raise ValueError("is not a Kafka client id: 1 to 255 letters, digits, '.', '_' or '-'")
    return value


def setting(default: Any = MISSING, *, env: str | Sequence[str] | None = None, flag: str | Sequence[str] | None = None,
            parse: Callable[[str], Any] = text, check: Callable[[Any], Any] | None = None, help: str = "",
            secret: bool = False, mask: Callable[[Any], Any] | None = None, default_factory: Any = MISSING,
            default_text: str | None = None, metavar: str | None = None) -> Any:
    """A dataclass field read from ``flag`` (the first name is the flag, others are aliases) and the environment
    variables ``env`` (the first one set wins). ``default_text`` is how help and docs show the default (when the
    default is computed, e.g. from the topic prefix)."""
    meta = Setting(env=_names(env), flags=_names(flag), parse=parse, check=check, help=help, secret=secret,
                   mask=mask, default_text=default_text, metavar=metavar)
    return field(default=default, default_factory=default_factory, repr=not secret, metadata={METADATA_KEY: meta})


def nested(cls: type, **defaults: Any) -> Any:
    """A field holding settings of ``cls``, loaded by the same rules. ``defaults`` replace ``cls``' own defaults
    for this use (a value, or a callable given the outer settings' values loaded so far, by field name)."""
    return field(default_factory=cls, metadata={METADATA_KEY: Setting(nested=cls, nested_defaults=defaults)})


def _names(names: str | Sequence[str] | None) -> tuple[str, ...]:
    if names is None:
        return ()
    return (names,) if isinstance(names, str) else tuple(names)


def settings_fields(cls: type) -> Iterator[tuple[dataclasses.Field, Setting]]:
    """The fields of ``cls`` that are settings (or nested settings), with their metadata."""
    for f in fields(cls):
        meta = f.metadata.get(METADATA_KEY)
        if meta is not None:
            yield f, meta


def _shown(meta: Setting, value: Any) -> Any:
    """``value`` as messages and printouts may show it."""
    if value is None or value == "":
        return value
    if meta.mask is not None:
        return meta.mask(value)
    return SECRET_MARK if meta.secret else value


def _error(f: dataclasses.Field, meta: Setting, value: Any, reason: str, source: str | None = None) -> SettingError:
    shown = _shown(meta, value) if isinstance(value, str) or meta.secret else value
    if meta.secret or meta.mask is not None:
        if isinstance(value, str) and value:
            reason = reason.replace(value, SECRET_MARK)
        reason = mask_secrets(reason)
    return SettingError(setting=f.name, flag=meta.flags[0] if meta.flags else None, env=meta.env, value=shown,
                        reason=reason, source=source)


def _convert(f: dataclasses.Field, meta: Setting, value: Any, source: str | None) -> Any:
    """``value`` parsed (when it is text) and checked: what ``validate`` and ``load`` do for one field."""
    original = value
    try:
        if isinstance(value, str):
            value = value.strip()
            if not value and f.default is None:
                return None
            if meta.parse is not None:
                value = meta.parse(value)
        if value is not None and meta.check is not None:
            value = meta.check(value)
    except SettingError:
        raise
    except (ValueError, GpumeterError) as exc:
        raise _error(f, meta, original, str(exc) or type(exc).__name__, source) from None
    return value


def validate(settings: Any) -> None:
    """Parse each setting of ``settings`` given as text and check every one (``__post_init__`` calls this first);
    ``SettingError`` names the first unusable one."""
    for f, meta in settings_fields(type(settings)):
        if meta.nested is not None:
            continue
        value = getattr(settings, f.name)
        converted = _convert(f, meta, value, None)
        if converted is not value:
            object.__setattr__(settings, f.name, converted)


def _flag_value(args: Any, f: dataclasses.Field, meta: Setting) -> Any:
    """The flag's value in ``args``; None when not given, or when the setting has no flag (an attribute of the same
    name that another command's parser made is not this setting)."""
    return None if args is None or not meta.flags else getattr(args, f.name, None)


def _env_value(env: Mapping[str, str], meta: Setting) -> tuple[str | None, str | None]:
    for variable in meta.env:
        raw = env.get(variable)
        if raw is not None and raw.strip():
            return raw, variable
    return None, None


def _required(f: dataclasses.Field) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


def load(cls: type, args: Any = None, env: Mapping[str, str] | None = None, *,
         defaults: Mapping[str, Any] | None = None, outer: Mapping[str, Any] | None = None) -> Any:
    """Settings of ``cls`` from the flags in ``args`` (an argparse namespace built by ``add_arguments``; None: no
    flags) over ``env`` over the defaults (``defaults`` replace the class's, as ``nested`` declares). Raises
    ``SettingError`` (a ``ConfigError``) for an unusable or missing value and ``ConfigError`` for values that do
    not go together."""
    env = env or {}
    values: dict[str, Any] = {}
    later: list[tuple[dataclasses.Field, Setting]] = []
    for f, meta in settings_fields(cls):
        if meta.nested is not None:
            later.append((f, meta))
            continue
        flagged = _flag_value(args, f, meta)
        if flagged is not None:
            values[f.name] = _convert(f, meta, flagged, meta.flags[0] if meta.flags else f.name)
            continue
        raw, variable = _env_value(env, meta)
        if raw is not None:
            values[f.name] = _convert(f, meta, raw, variable)
            continue
        if defaults and f.name in defaults:
            default = defaults[f.name]
            values[f.name] = default(outer or {}) if callable(default) else default
        elif _required(f):
            raise _error(f, meta, None, "is required and not set")
    for f, meta in later:
        values[f.name] = load(meta.nested, args, env, defaults=meta.nested_defaults, outer=values)
    return cls(**values)


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per setting of ``cls`` (and of its nested settings) that declares one; every flag takes text,
    which ``load`` parses, so a bad flag value is a ``SettingError`` like a bad environment value."""
    for f, meta in settings_fields(cls):
        if meta.nested is not None:
            add_arguments(parser, meta.nested)
            continue
        if not meta.flags:
            continue
        parser.add_argument(*meta.flags, dest=f.name, metavar=meta.metavar, help=_help(f, meta).replace("%", "%%"))


def default_text(f: dataclasses.Field, meta: Setting) -> str | None:
    """How help and docs show a setting's default; None when it has none worth showing."""
    if meta.default_text is not None:
        return meta.default_text
    if f.default is MISSING or f.default is None:
        return None
    value = _shown(meta, f.default)
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


def _help(f: dataclasses.Field, meta: Setting) -> str:
    notes = []
    if meta.env:
        notes.append("env " + " or ".join(meta.env))
    shown = default_text(f, meta)
    if shown is not None:
        notes.append(f"default {shown}")
    elif _required(f):
        notes.append("required")
    return f"{meta.help} ({', '.join(notes)})" if notes else meta.help


def env_variables(cls: type) -> frozenset[str]:
    """Every environment variable settings of ``cls`` read (nested settings' included)."""
    names: set[str] = set()
    for _f, meta in settings_fields(cls):
        names.update(env_variables(meta.nested) if meta.nested is not None else meta.env)
    return frozenset(names)


def flags(cls: type) -> frozenset[str]:
    """Every flag name (aliases included) ``add_arguments(parser, cls)`` adds."""
    names: set[str] = set()
    for _f, meta in settings_fields(cls):
        names.update(flags(meta.nested) if meta.nested is not None else meta.flags)
    return frozenset(names)


def _plain(value: Any) -> Any:
    """``value`` as JSON can hold it."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (Path, Decimal)):
        return str(value)
    if isinstance(value, Enum):
        return value.value
    if hasattr(value, "describe") and callable(value.describe):
        return value.describe()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list, frozenset, set)):
        return [_plain(v) for v in value]
    return str(value)


def describe(settings: Any) -> dict[str, Any]:
    """Every field of ``settings`` as JSON-ready values, nested settings as dicts, secrets redacted (``***``, or
    the setting's ``mask``: ``mask_url`` keeps a URL readable without its password)."""
    view: dict[str, Any] = {}
    for f in fields(settings):
        value = getattr(settings, f.name)
        meta = f.metadata.get(METADATA_KEY)
        if meta is not None and meta.nested is not None:
            view[f.name] = describe(value)
        elif meta is not None and (meta.secret or meta.mask is not None):
            view[f.name] = _shown(meta, value)
        else:
            view[f.name] = _plain(value)
    return view


def settings_repr(settings: Any) -> str:
    """``Name(field=value, ...)`` from ``describe``: what a settings class's ``__repr__`` returns."""
    return f"{type(settings).__name__}({', '.join(f'{k}={v!r}' for k, v in describe(settings).items())})"


def markdown_table(cls: type) -> list[str]:
    """The settings of ``cls`` as a Markdown table -- variable(s), flag(s), default, meaning -- one row per setting,
    nested settings left to their own table. docs/configuration.md is made of these (``gpumeter.commands.config_doc``)
    and checked against them, so the page cannot drift from the code."""
    rows = ["| Variable | Flag | Default | Meaning |", "|---|---|---|---|"]
    for f, meta in settings_fields(cls):
        if meta.nested is not None:
            rows.append(f"| (`{meta.nested.__name__}`) | | | `{f.name}`: see its own table |")
            continue
        variables = " or ".join(f"`{v}`" for v in meta.env) or "–"
        flag_names = ", ".join(f"`{n}`" for n in meta.flags) or "–"
        shown = default_text(f, meta)
        shown_as = "shown as ***" if meta.mask is None else "shown with its password masked"
        meaning = meta.help + (f" (secret: {shown_as})" if meta.secret else
                               f" ({shown_as})" if meta.mask is not None else "")
        shown = f"`{shown}`" if shown else ("required" if _required(f) else "–")
        rows.append(f"| {variables} | {flag_names} | {shown} | "
                    f"{meaning.replace('|', chr(92) + '|')} |")
    return rows


__all__ = [
    "METADATA_KEY", "Setting", "SettingError", "ConfigError", "add_arguments", "at_least", "between",
    "check_client_id", "describe", "env_variables", "flags", "greater_than", "integer", "load", "markdown_table",
    "nested", "non_empty", "number", "one_of", "path", "setting", "settings_fields", "settings_repr", "text",
    "validate",
]
