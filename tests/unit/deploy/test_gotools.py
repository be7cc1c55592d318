"""gpumeter.devtools.gotools: the Go toolchain download a Python-only machine builds helm and kustomize with.

A module proxy on loopback serves a small toolchain-shaped module zip; its go.sum hash below is the one the go
command itself computed for exactly these files (``go mod download -json`` from a file:// proxy), so the hash
function is checked against Go, and the download, the check and the unpacking run as they do against
proxy.golang.org. The real build (helm and kustomize from source) runs in the deployment tests' session fixture.
"""

from __future__ import annotations

import dataclasses
import http.server
import subprocess
import threading
import zipfile
from pathlib import Path

import pytest

from gpumeter.devtools import gotools

VERSION = "1.99.0"
PLATFORM = "linux-amd64"
MODULE_VERSION = f"v0.0.1-go{VERSION}.{PLATFORM}"
PREFIX = f"golang.org/toolchain@{MODULE_VERSION}/"
FILES = {
    PREFIX + "go.mod": b"module golang.org/toolchain\n",
    PREFIX + "bin/go": b"#!/bin/sh\necho go1.99.0\n",
    PREFIX + "pkg/tool/linux_amd64/compile": b"#!/bin/sh\nexit 0\n",
    PREFIX + "VERSION": b"go1.99.0\n",
}
# `go mod download -json golang.org/toolchain@v0.0.1-go1.99.0.linux-amd64` (go1.26.8) for a zip of FILES.
GO_SUM = "h1:GMCPoT0YIYs41TfQeSxLq/7HUvf+Mx4QJ5eQ/VAWf0I="


def write_zip(path: Path, files: dict[str, bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as archive:
        for name, content in files.items():
            archive.writestr(name, content)
    return path


@pytest.fixture
def module_proxy(tmp_path):
    """(base URL, folder): an HTTP server on loopback serving the folder as a Go module proxy."""
    root = tmp_path / "proxy"
    root.mkdir()

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(root), **kwargs)

        def log_message(self, format, *args):  # noqa: A002 - the stdlib's signature
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", root
    finally:
        server.shutdown()
        server.server_close()


def serve(root: Path, files: dict[str, bytes]) -> None:
    write_zip(root / "golang.org" / "toolchain" / "@v" / f"{MODULE_VERSION}.zip", files)


def test_the_go_sum_hash_is_the_one_go_computes(tmp_path):
    assert gotools.module_zip_hash(write_zip(tmp_path / "m.zip", FILES)) == GO_SUM
    reordered = dict(reversed(list(FILES.items())))
    assert gotools.module_zip_hash(write_zip(tmp_path / "r.zip", reordered)) == GO_SUM, "the order in the zip"
    changed = {**FILES, PREFIX + "VERSION": b"go1.99.1\n"}
    assert gotools.module_zip_hash(write_zip(tmp_path / "c.zip", changed)) != GO_SUM


@pytest.mark.network
def test_a_toolchain_whose_hash_matches_is_unpacked_with_runnable_tools(module_proxy, tmp_path):
    url, root = module_proxy
    serve(root, FILES)
    messages = []
    go = gotools.fetch_go_toolchain(tmp_path / "toolchain", version=VERSION, platform_name=PLATFORM,
                                    sums={PLATFORM: GO_SUM}, proxy=url, log=messages.append)
    assert go == tmp_path / "toolchain" / "go" / "bin" / "go"
    assert subprocess.run([str(go)], capture_output=True, text=True, check=True).stdout == "go1.99.0\n"
    assert (go.parent.parent / "pkg" / "tool" / "linux_amd64" / "compile").stat().st_mode & 0o111
    assert not (go.parent.parent / "VERSION").stat().st_mode & 0o111, "only bin/ and pkg/tool/ are executable"
    assert not list((tmp_path / "toolchain").glob("*.zip")), "the download is removed once unpacked"
    assert any(url in m for m in messages), "it says what it downloads"


@pytest.mark.network
def test_a_toolchain_whose_hash_does_not_match_is_discarded_unopened(module_proxy, tmp_path):
    url, root = module_proxy
    serve(root, {**FILES, PREFIX + "bin/go": b"#!/bin/sh\necho tampered\n"})
    with pytest.raises(gotools.GoToolError, match="checksum mismatch.*expected " + GO_SUM.replace("+", r"\+")):
        gotools.fetch_go_toolchain(tmp_path / "toolchain", version=VERSION, platform_name=PLATFORM,
                                   sums={PLATFORM: GO_SUM}, proxy=url, log=lambda _m: None)
    assert not (tmp_path / "toolchain" / "go").exists()
    assert not list((tmp_path / "toolchain").glob("*.zip"))


@pytest.mark.network
def test_a_zip_with_a_path_outside_the_module_is_refused(module_proxy, tmp_path):
    url, root = module_proxy
    files = {**FILES, PREFIX + "../../escape": b"x"}
    serve(root, files)
    digest = gotools.module_zip_hash(root / "golang.org" / "toolchain" / "@v" / f"{MODULE_VERSION}.zip")
    with pytest.raises(gotools.GoToolError, match="unsafe path"):
        gotools.fetch_go_toolchain(tmp_path / "toolchain", version=VERSION, platform_name=PLATFORM,
                                   sums={PLATFORM: digest}, proxy=url, log=lambda _m: None)
    assert not (tmp_path / "escape").exists() and not (tmp_path.parent / "escape").exists()


@pytest.mark.network
def test_a_download_that_fails_is_a_clear_error(module_proxy, tmp_path):
    url, _root = module_proxy
    with pytest.raises(gotools.GoToolError, match="could not download .*404"):
        gotools.fetch_go_toolchain(tmp_path / "toolchain", version=VERSION, platform_name=PLATFORM,
                                   sums={PLATFORM: GO_SUM}, proxy=url, log=lambda _m: None)


def test_every_pinned_platform_has_a_go_sum_hash():
    assert set(gotools.GO_TOOLCHAIN_SUMS) == {"linux-amd64", "linux-arm64", "darwin-amd64", "darwin-arm64"}
    assert all(h.startswith("h1:") and len(h) == 47 for h in gotools.GO_TOOLCHAIN_SUMS.values())
    assert gotools.toolchain_platform() in gotools.GO_TOOLCHAIN_SUMS


def test_promtool_and_the_prometheus_server_are_built_by_one_go_install():
    # One module at one version with one set of ldflags: the packages they share compile once.
    assert gotools.install_groups(gotools.TOOLS) == [(gotools.HELM,), (gotools.KUSTOMIZE,),
                                                    (gotools.PROMTOOL, gotools.PROMETHEUS)]
    assert gotools.install_groups([gotools.PROMETHEUS]) == [(gotools.PROMETHEUS,)]  # what is missing, alone
    # A tool of that module at another version cannot share the invocation (go install refuses it).
    older = dataclasses.replace(gotools.PROMETHEUS, version="v0.315.0")
    assert gotools.install_groups([gotools.PROMTOOL, older]) == [(gotools.PROMTOOL,), (older,)]


def test_the_built_prometheus_server_reports_the_pinned_release(go_tools):
    result = subprocess.run([str(go_tools["prometheus"]), "--version"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert f"prometheus, version {gotools.PROMETHEUS_VERSION} " in result.stdout
    assert gotools.PROMETHEUS.is_built(gotools.DEFAULT_CACHE_DIR.resolve())
