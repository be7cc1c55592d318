"""No secret of a URL ever shows, however the URL is written: one masker (``gpumeter.redact.mask_url``) behind
every settings printout, log line, ``--help`` text and error message.

The tables hold URLs that broke the earlier maskers or that client libraries read in surprising ways: an "@" in
a password (SQLAlchemy ends the password at the first "@" and would send the rest out as the host name), a "/"
in a password (urllib, and so aiohttp, end the authority there: host ``am``, port ``AM``), secrets in libpq
query parameters (``password``, ``sslpassword``, ``sslkey``), a secret where the port should be (the library's
own parse error quotes it), and text that is no URL at all (a libpq ``key=value`` string). Each one goes through
the real entry points -- ``gpumeter billing``, ``gpumeter report``, ``gpumeter guard`` and their ``--help`` -- with
the URL in the environment or on the command line, and its secret must appear nowhere: stdout, stderr, any log
record (at DEBUG), the settings' ``repr``. No network: ledgers point at a unix socket folder that is not there,
Kafka clients are the no-broker doubles of ``test_security``.
"""

from __future__ import annotations

import logging
import uuid

import pytest

from gpumeter import cli
from gpumeter.redact import SECRET_MARK, mask_secrets, mask_url

NO_SOCKET = "host=/nonexistent-gpumeter-socket-dir"


def _secret() -> str:
    return f"S{uuid.uuid4().hex[:12]}"


S1, S2 = _secret(), _secret()

# (case id, URL, the masked form)
MASKED = [
    ("at-in-password", f"postgresql://u:PG@{S1}@host/db", "postgresql://u:***@host/db"),
    ("query-password", f"postgresql://u:pw@host/db?password={S1}", "postgresql://u:***@host/db?password=***"),
    ("libpq-parameters", f"postgresql://u@host/db?sslpassword={S1}&sslmode=require&sslkey=/k/{S2}.key",
     "postgresql://u@host/db?sslpassword=***&sslmode=require&sslkey=***"),
    ("parameter-in-any-case-or-encoded", f"postgresql://h/db?PassWord={S1}&pass%77ord={S2}",
     "postgresql://h/db?PassWord=***&pass%77ord=***"),
    ("ampersand-in-a-query-password", f"postgresql://u@h/db?password=a&{S1}&sslmode=x",
     "postgresql://u@h/db?password=***&***&sslmode=x"),
    ("slash-in-password", f"postgresql+psycopg://u:p/{S1}@host/db", "postgresql+psycopg://u:***@host/db"),
    ("question-mark-in-password", f"postgresql://u:a?{S1}@host/db", "postgresql://u:***@host/db"),
    ("secret-where-the-port-goes", f"postgresql://u:PG@SEC:{S1}@db/ledger", "postgresql://u:***@db/ledger"),
    ("bad-port", f"postgresql://u:{S1}@h:notaport/db", "postgresql://u:***@h:notaport/db"),
    ("http-slash-in-password", f"http://am:AM/{S1}@host", "http://am:***@host"),
    ("http-at-in-password", f"http://am:AM@{S1}@host:9093", "http://am:***@host:9093"),
    ("http-hash-in-password", f"http://am:{S1}#x@h:1", "http://am:***@h:1"),
    ("no-user-name", f"http://:{S1}@h", "http://:***@h"),
    ("libpq-keyword-string", f"host=/x user=billing password={S1} dbname=l",
     "host=/x user=billing password=*** dbname=l"),
    ("an-at-in-the-query-is-not-user-info", "postgresql://u:pw@host/db?application_name=me@x",
     "postgresql://u:***@host/db?application_name=me@x"),
    ("nothing-to-hide", "sqlite:///gpumeter-ledger.sqlite3", "sqlite:///gpumeter-ledger.sqlite3"),
    ("ipv6-host", "https://[::1]:9093", "https://[::1]:9093"),
]


@pytest.mark.parametrize("url, masked", [case[1:] for case in MASKED], ids=[case[0] for case in MASKED])
def test_the_masker_hides_every_secret_of_a_nasty_url(url, masked):
    assert mask_url(url) == masked
    assert S1 not in masked and S2 not in masked
    assert mask_secrets(f"cannot open ledger {url!r}: boom") == f"cannot open ledger {masked!r}: boom"


# Ledger URLs: (case id, URL with {S} for the secret). None of them reaches a server.
LEDGER_URLS = [
    ("at-in-password", f"postgresql+psycopg://billing:PG@{{S}}@/ledger?{NO_SOCKET}"),
    ("query-password", f"postgresql+psycopg://billing@/ledger?{NO_SOCKET}&password={{S}}"),
    ("query-password-upper-case", f"postgresql+psycopg://billing@/ledger?{NO_SOCKET}&PASSWORD={{S}}"),
    ("libpq-parameters", f"postgresql+psycopg:///ledger?{NO_SOCKET}&user=billing&sslpassword={{S}}"
                         "&sslkey=/keys/{S}.key&sslmode=disable"),
    ("slash-in-password", f"postgresql+psycopg://billing:p/{{S}}@/ledger?{NO_SOCKET}"),
    ("question-mark-in-password", f"postgresql+psycopg://billing:a?{{S}}@/ledger?{NO_SOCKET}"),
    ("secret-where-the-port-goes", "postgresql+psycopg://billing:PG@SEC:{S}@db/ledger"),
    ("bad-port", "postgresql+psycopg://billing:{S}@db:notaport/ledger"),
    ("libpq-keyword-string", "host=/nonexistent-gpumeter-socket-dir user=billing password={S}"),
    ("percent-encoded", f"postgresql+psycopg://billing:%40{{S}}@/ledger?{NO_SOCKET}"),
]

ALERTMANAGER_URLS = [
    ("slash-in-password", "http://guard:AM/{S}@127.0.0.1:1"),
    ("at-in-password", "http://guard:AM@{S}@127.0.0.1:1"),
    ("colon-and-at-in-password", "http://guard:AM@SEC:{S}@127.0.0.1:1"),
    ("bad-port", "http://guard:{S}@127.0.0.1:notaport"),
    ("hash-in-password", "http://guard:{S}#x@127.0.0.1:1"),
    ("query-token", "http://guard:{S}@127.0.0.1:1/?token={S}"),
    ("no-user-name", "http://:{S}@127.0.0.1:1"),
    ("https", "https://guard:{S}@127.0.0.1:1/alertmanager"),
]


@pytest.fixture
def debug_logs(caplog, monkeypatch):
    caplog.set_level(logging.DEBUG)
    monkeypatch.setattr(logging, "basicConfig", lambda **kwargs: None)
    return caplog


def _logged(caplog) -> str:
    return "\n".join(f"{r.name} {r.levelname} {r.getMessage()} {r.exc_text or ''}" for r in caplog.records)


def _help(command: str, capsys) -> str:
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    out, err = capsys.readouterr()
    return out + err


def _assert_hidden(secret: str, **texts: str) -> None:
    for where, text in texts.items():
        assert secret not in text, f"the secret shows in the {where}:\n{text[:3000]}"


@pytest.mark.parametrize("url", [case[1] for case in LEDGER_URLS], ids=[case[0] for case in LEDGER_URLS])
def test_billing_and_report_never_show_a_ledger_urls_secret(url, monkeypatch, capsys, debug_logs):
    from services.billing import main as billing_main
    from services.billing import report
    from tests.unit.core.test_security import NoBroker, close_all

    secret = _secret()
    url = url.replace("{S}", secret)
    env = {"GPUMETER_LEDGER_URL": url, "GPUMETER_METRICS_PORT": "0",
           "GPUMETER_BILLING_LEDGER_RETRY_INITIAL_SECONDS": "0.2", "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"}
    monkeypatch.setattr("gpumeter.cli.env_snapshot", lambda: dict(env))
    help_text = _help("billing", capsys) + _help("report", capsys)

    broker = NoBroker(monkeypatch)
    code = billing_main.main(cli.build_parser("billing").parse_args(["billing", "--duration", "1"]), env)
    out, err = capsys.readouterr()
    close_all(broker)
    # 0: retried the unreachable ledger until the duration ended; 1: the driver refused an option; 2: refused.
    assert code in (0, 1, 2)
    assert {0: "ledger unavailable", 1: "billing failed", 2: "cannot open ledger"}[code] in _logged(debug_logs)
    if code != 2 or out:
        assert out.startswith("gpumeter billing ") and SECRET_MARK in out.splitlines()[0]

    report_codes = []
    for argv, report_env in ((["report", "--ledger-url", url], {}), (["report"], {"GPUMETER_LEDGER_URL": url})):
        report_codes.append(report.main(cli.build_parser("report").parse_args(argv), report_env))
    report_out, report_err = capsys.readouterr()
    assert report_codes == [2, 2] and report_err.startswith("gpumeter report: ")

    from services.billing.settings import billing_settings

    try:
        shown = repr(billing_settings(cli.build_parser("billing").parse_args(["billing"]), env))
    except Exception as exc:  # a refused setting: its message is shown
        shown = str(exc)
    _assert_hidden(secret, help=help_text, stdout=out, stderr=err, logs=_logged(debug_logs),
                   report=report_out + report_err, settings=shown)


@pytest.mark.parametrize("url", [case[1] for case in ALERTMANAGER_URLS],
                         ids=[case[0] for case in ALERTMANAGER_URLS])
def test_the_guard_never_shows_an_alertmanager_urls_secret(url, monkeypatch, capsys, debug_logs, tmp_path):
    from services.guard import main as guard_main
    from services.guard.settings import guard_settings
    from tests.unit.core.test_security import NoBroker, close_all

    secret = _secret()
    url = url.replace("{S}", secret)
    env = {"GPUMETER_GUARD_ALERTMANAGER_URL": url, "GPUMETER_METRICS_PORT": "0",
           "GPUMETER_GUARD_STATE_PATH": str(tmp_path / "guard.state"), "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"}
    monkeypatch.setattr("gpumeter.cli.env_snapshot", lambda: dict(env))
    help_text = _help("guard", capsys)
    broker = NoBroker(monkeypatch)
    code = guard_main.main(cli.build_parser("guard").parse_args(["guard"]), env)
    out, err = capsys.readouterr()
    close_all(broker)
    # Refused (2, "error: ..." naming the URL masked), or started and stopped: its consumer has no broker (1).
    assert code in (1, 2)
    if code == 2:
        assert out.startswith("error: Alertmanager URL ") or out.startswith("error: ")
    else:
        assert '"alertmanager_url": "' in out and SECRET_MARK in out.splitlines()[0]
    try:
        shown = repr(guard_settings(cli.build_parser("guard").parse_args(["guard"]), env))
    except Exception as exc:
        shown = str(exc)
    _assert_hidden(secret, help=help_text, stdout=out, stderr=err, logs=_logged(debug_logs), settings=shown)


def test_urls_the_client_libraries_would_misread_are_refused_with_the_url_masked():
    """Where SQLAlchemy or urllib would read another host than the one written, the URL is refused at start."""
    from gpumeter.errors import ConfigError
    from services.billing.ledger import Ledger, LedgerError
    from services.guard.settings import GuardSettings

    secret = _secret()
    with pytest.raises(LedgerError, match="percent-encode") as refused:
        Ledger(f"postgresql+psycopg://billing:PG@{secret}@db.internal/ledger")
    assert secret not in str(refused.value) and "billing:***@db.internal/ledger" in str(refused.value)
    for url in (f"http://am:AM/{secret}@am.internal:9093", f"http://am:{secret}@am.internal:port"):
        with pytest.raises(ConfigError, match="percent-encode") as refused:
            GuardSettings(alertmanager_url=url)
        assert secret not in str(refused.value) and "am:***@" in str(refused.value)


def test_other_urls_in_settings_printouts_are_masked_too(capsys):
    """The collector's API server URL and the guard's external URL go through the same masker."""
    from services.collector.settings import collector_settings
    from services.guard.settings import guard_settings

    secret = _secret()
    collector = collector_settings(cli.build_parser("collector").parse_args(
        ["collector", "--node", "n1", "--kube-api", f"https://admin:{secret}@10.0.0.1:6443"]), {})
    guard = guard_settings(cli.build_parser("guard").parse_args(
        ["guard", "--external-url", f"https://ops:AB@{secret}@grafana.example/d/x"]), {})
    assert collector.describe()["kube_api"] == "https://admin:***@10.0.0.1:6443"
    assert guard.describe()["external_url"] == "https://ops:***@grafana.example/d/x"
    assert secret not in repr(collector.describe()) + repr(guard.describe())
