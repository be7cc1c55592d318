"""``gpumeter api`` on a ledger in PostgreSQL, asked over HTTP: OpenCost's /allocation adds up to ``gpumeter report``.

The API runs as its own process (``python -m gpumeter.cli api``) on a database of this test's own on the session's
PostgreSQL server; the test is its HTTP client (urllib over TCP) and runs ``gpumeter report`` as a process too.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from datetime import datetime, timezone

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from services.billing.ledger import Ledger, LedgerError
from tests.unit.billing.conftest import WINDOW_START_MS, sample_costs

pytestmark = [pytest.mark.postgres, pytest.mark.network]

WINDOWS = 3
END_MS = WINDOW_START_MS + WINDOWS * 60_000
SHARING = "idle=weighted,node_other=weighted"


def iso(unix_ms: int) -> str:
    return datetime.fromtimestamp(unix_ms / 1000, tz=timezone.utc).isoformat(timespec="seconds").replace("+00:00",
                                                                                                          "Z")


@pytest.fixture
def database_url(postgres_url):
    name = f"api_{uuid.uuid4().hex[:12]}"
    admin = create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(postgres_url).set(database=name).render_as_string(hide_password=False)
    yield url
    with admin.connect() as connection:
        connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture
def billed(database_url):
    """The ledger with two nodes' three minutes, idle and node_other shared to the pods."""
    ledger = Ledger(database_url)
    ledger.migrate()
    results = sample_costs(WINDOWS, sharing=SHARING)
    ledger.write([c for r in results for c in r.costs], [r.bill for r in results])
    ledger.close()
    return database_url, results


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def api(billed, tmp_path):
    yield from _run_api(billed, tmp_path)


@pytest.fixture
def api_with_tokens(billed, tmp_path):
    """The API with a token file (``tokens``: the file, holding ``t0ken-one``)."""
    tokens = tmp_path / "tokens"
    tokens.write_text("t0ken-one\n")
    for base, url, results in _run_api(billed, tmp_path, "--token-file", str(tokens)):
        yield base, tokens


def _run_api(billed, tmp_path, *extra: str):
    url, results = billed
    port = free_port()
    log = (tmp_path / "api.log").open("wb")
    process = subprocess.Popen([sys.executable, "-m", "gpumeter.cli", "api", "--ledger-url", url, "--port", str(port),
                                "--metrics-address", "127.0.0.1", *extra], stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "GPUMETER_LOG_LEVEL": "INFO"})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"{base}/healthz", timeout=2) as answer:
                if answer.status == 200:
                    break
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"gpumeter api did not come up: {(tmp_path / 'api.log').read_text()}")
        time.sleep(0.2)
    yield base, url, results
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0, (tmp_path / "api.log").read_text()
    log.close()


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_allocation_by_team_has_the_totals_of_the_report_by_team(api):
    base, url, results = api
    window = f"{iso(WINDOW_START_MS)},{iso(END_MS)}"
    code, body = get(f"{base}/allocation?window={window}&aggregate=label:team&includeIdle=true&shareIdle=true")
    assert code == 200 and body["code"] == 200
    (allocations,) = body["data"]
    report = subprocess.run([sys.executable, "-m", "gpumeter.cli", "report", "--ledger-url", url, "--by",
                             "label:team", "--end", iso(END_MS), "--window", f"{WINDOWS}m", "--format", "json"],
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    document = json.loads(report.stdout)
    expected = {}
    for line in document["lines"]:
        name = "__unallocated__" if line["kind"] == "pod" and line["group"].startswith("(no ") else (
            line["group"] if line["kind"] == "pod" else f"__{line['kind']}__")
        expected[name] = expected.get(name, 0) + line["cost_micro_usd"]
    assert {name: a["totalCostMicroUsd"] for name, a in allocations.items()} == expected
    assert sum(a["totalCostMicroUsd"] for a in allocations.values()) == document["total_micro_usd"]
    kept = sum(line["cost_micro_usd"] for line in document["lines"] if line["kind"] != "pod")
    assert kept > 0 and document["pods_micro_usd"] == document["total_micro_usd"] - kept  # the buckets kept
    for line in (l for l in document["lines"] if l["kind"] == "pod" and not l["group"].startswith("(no ")):
        allocation = allocations[line["group"]]
        assert allocation["directCostMicroUsd"] == line["direct_micro_usd"]
        assert allocation["gpuCostIdleMicroUsd"] + allocation["sharedCostMicroUsd"] == line["shared_micro_usd"]
    assert body["gpumeter"]["reconciliation"]["reconciled"] is True
    assert body["gpumeter"]["sharingPolicies"] == [{"policy": SHARING, "nodeWindows": len(results)}]


def test_bad_parameters_are_400s_and_the_api_is_read_only(api):
    base, url, _ = api
    code, body = get(f"{base}/allocation?window=forever")
    assert code == 400 and body == {"code": 400, "message": body["message"]} and "window" in body["message"]
    code, body = get(f"{base}/allocation?window=1d&aggregate=label:")
    assert code == 400 and "label key" in body["message"]
    code, body = get(f"{base}/allocation?window=365d")
    assert code == 400 and "at most 93 days" in body["message"]
    request = urllib.request.Request(f"{base}/allocation?window=1d", method="DELETE")
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=10)
    assert caught.value.code == 405
    # OpenCost's UI asks under /model: the same answer.
    window = f"{iso(WINDOW_START_MS)},{iso(END_MS)}"
    assert get(f"{base}/model/allocation?window={window}")[1]["data"] == get(
        f"{base}/allocation?window={window}")[1]["data"]
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as answer:
        assert b'gpumeter_api_requests_total{code="400",path="/allocation"}' in answer.read()
    # The API's connections are read-only sessions: PostgreSQL itself refuses a write on them.
    results = sample_costs(1, start_ms=END_MS + 60_000)
    reader = Ledger(url, read_only=True)
    with pytest.raises(LedgerError, match="read-only transaction"):
        reader.write([c for r in results for c in r.costs], [r.bill for r in results])
    reader.close()


def test_too_many_parameters_are_a_400_over_http_not_a_500(api):
    base, _, _ = api
    code, body = get(f"{base}/allocation?window=1d&" + "&".join(f"p{i}=1" for i in range(60)))
    assert code == 400 and "more than 50 query parameters" in body["message"]


def test_a_token_file_guards_allocation_over_http_and_a_rotation_needs_no_restart(api_with_tokens):
    base, tokens = api_with_tokens
    window = f"{iso(WINDOW_START_MS)},{iso(END_MS)}"
    try:
        urllib.request.urlopen(f"{base}/allocation?window={window}", timeout=10)
        pytest.fail("answered without a token")
    except urllib.error.HTTPError as refused:
        assert refused.code == 401 and refused.headers["WWW-Authenticate"] == 'Bearer realm="gpumeter"'
    assert get(f"{base}/allocation?window={window}", {"Authorization": "Bearer t0ken-one"})[0] == 200
    assert get(f"{base}/allocation?window={window}", {"Authorization": "Bearer t0ken-number-two"})[0] == 401
    tokens.write_text("t0ken-number-two\n")  # a rotation (another size): read again at the next request
    assert get(f"{base}/allocation?window={window}", {"Authorization": "Bearer t0ken-number-two"})[0] == 200
    assert get(f"{base}/allocation?window={window}", {"Authorization": "Bearer t0ken-one"})[0] == 401
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as answer:  # no token for Prometheus
        assert b'gpumeter_api_requests_total{code="401",path="/allocation"}' in answer.read()
