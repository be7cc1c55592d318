"""Helm, kustomize, promtool and the Prometheus server for the deployment and integration tests: built once from
source with Go into the cache, with nothing but Python if need be.

Contract:

* ``ensure_tools(cache_dir)`` returns the paths of ``helm`` (``HELM_VERSION``), ``kustomize``
  (``KUSTOMIZE_VERSION``), ``promtool`` and ``prometheus`` (Prometheus ``PROMETHEUS_VERSION``) under
  ``cache_dir/gotools/``, building what is missing on the first call with
  ``go install <module>/<cmd>@<version>``: static (``CGO_ENABLED=0``), helm with the ldflags of its own release
  builds, so ``helm version`` and the Kubernetes version it assumes are those of the release; promtool and
  prometheus with Prometheus' version variables set, so ``--version`` names it, in one ``go install`` (one module at
  one version: the packages they share compile once; ``install_groups``).
* The Go used: ``go`` on ``PATH`` when it is at least ``MIN_GO`` (the tools' go.mod); otherwise the pinned Go
  toolchain ``golang.org/toolchain@v0.0.1-go<GO_TOOLCHAIN_VERSION>.<os>-<arch>``, downloaded from the Go module
  proxy with the standard library and checked against its pinned go.sum hash (from the Go checksum database)
  before anything in it runs. A mismatch is a ``GoToolError``, never a silent use.
* Go runs with ``GOTOOLCHAIN=local`` (no toolchain switch behind this module's back), its module and build caches
  in a scratch folder under ``cache_dir/gotools`` that is removed afterwards with the downloaded toolchain: only
  the binaries stay (helm ~60 MB, kustomize ~15 MB, promtool 88 MB, prometheus 105 MB). The go
  command checks every module it downloads against the checksum database.
* Concurrent callers (``make deploy-tools`` and a test session) wait on one lock; the second finds them built.

Command line: ``python -m gpumeter.devtools.gotools build`` (what ``make deploy-tools`` runs) prints the paths.
The first build takes about 2.5 minutes on an idle 2-core machine for helm and kustomize (helm's modules, ~100 MB,
are downloaded; the toolchain, 71 MB, only without a suitable ``go``; kustomize reuses most of helm's compiled
packages); promtool's larger module graph took 13 minutes and the server 3.3 more (measured 2026-12-04 21:41-21:57
UTC on 2 cores shared with other builds and tests, load 7-10: promtool alone 773 s, then prometheus in the same
build cache 197 s; both through ``ensure_tools``' one ``go install``, niced beside a full unit-test run: 35 minutes
wall, 10.0 CPU-minutes, binaries byte-identical to those two steps'); later calls find the binaries in
milliseconds.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CACHE_DIR = Path(os.environ.get("GPUMETER_CACHE_DIR", REPO_ROOT / ".cache"))

HELM_MODULE = "helm.sh/helm/v3"
HELM_VERSION = "v3.22.0"
# Helm's Makefile derives the Kubernetes version `helm template` and `helm lint` assume (without --kube-version)
# from its k8s.io/client-go, v0.37.0 in v3.22.0: Kubernetes 1.37.
HELM_KUBE_VERSION = ("1", "37")
KUSTOMIZE_MODULE = "sigs.k8s.io/kustomize/kustomize/v5"
# v5.8.1 builds on sigs.k8s.io/kustomize/api v0.21.1, the version helm v3.22.0 builds on: compiled once for both.
KUSTOMIZE_VERSION = "v5.8.1"
# helm v3.22.0's go.mod asks for go 1.26.0, kustomize v5.8.1's for 1.24.0.
MIN_GO = (1, 26)

GO_PROXY = "https://proxy.golang.org"
GO_TOOLCHAIN_VERSION = "1.26.11"
# go.sum hashes ("h1:", the module zip's dirhash) of golang.org/toolchain v0.0.1-go1.26.11.<platform>, as the Go
# checksum database (sum.golang.org) lists them.
GO_TOOLCHAIN_SUMS = {
    "linux-amd64": "h1:KyINmJ/FQdKRmDYGuTAAXkumyeR2DyUlSNHZj7XaLFg=",
    "linux-arm64": "h1:GFS9FmglLJxMwOSuun3qb8tBjpr8ibzOkt8tBrRLrnk=",
    "darwin-amd64": "h1:ydidkBD90rrbnDbAJQcL+jVHdCj0S3OMfLntC/we3fw=",
    "darwin-arm64": "h1:cGxzEKi4mhhQFd6Cz/2NSL4Y9nfIBCirzU1yn2rnOY8=",
}

_GO_VERSION_RE = re.compile(r"\bgo(\d+)\.(\d+)(?:\.(\d+))?\b")


class GoToolError(RuntimeError):
    """A tool could not be built: no usable Go, a download or checksum failure, or a failed ``go install``."""


@dataclass(frozen=True)
class GoTool:
    """A command built with ``go install <package>@<version>``, and how to ask it its version. Tools of one module
    at one version with the same ldflags are built by one ``go install`` (``install_groups``)."""

    name: str
    module: str
    package: str
    version: str
    version_command: tuple[str, ...]
    ldflags: tuple[str, ...] = ()

    def path(self, cache_dir: Path) -> Path:
        return cache_dir / "gotools" / f"{self.name}-{self.version}" / self.name

    def is_built(self, cache_dir: Path) -> bool:
        binary = self.path(cache_dir)
        if not binary.is_file():
            return False
        try:
            result = subprocess.run([str(binary), *self.version_command], capture_output=True, text=True,
                                    timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return result.returncode == 0 and self.version in result.stdout


HELM = GoTool(
    name="helm",
    module=HELM_MODULE,
    package=f"{HELM_MODULE}/cmd/helm",
    version=HELM_VERSION,
    version_command=("version", "--template", "{{.Version}}"),
    ldflags=(
        f"-X {HELM_MODULE}/internal/version.version={HELM_VERSION}",
        f"-X {HELM_MODULE}/internal/version.gitTreeState=clean",
        f"-X {HELM_MODULE}/pkg/lint/rules.k8sVersionMajor={HELM_KUBE_VERSION[0]}",
        f"-X {HELM_MODULE}/pkg/lint/rules.k8sVersionMinor={HELM_KUBE_VERSION[1]}",
        f"-X {HELM_MODULE}/pkg/chartutil.k8sVersionMajor={HELM_KUBE_VERSION[0]}",
        f"-X {HELM_MODULE}/pkg/chartutil.k8sVersionMinor={HELM_KUBE_VERSION[1]}",
    ),
)
# kustomize reports the module version go install embeds (runtime/debug build info).
KUSTOMIZE = GoTool(name="kustomize", module=KUSTOMIZE_MODULE, package=KUSTOMIZE_MODULE, version=KUSTOMIZE_VERSION,
                   version_command=("version",))
# promtool, Prometheus' own checker of rule files and their unit tests (``promtool check rules``, ``promtool test
# rules``): the deployment tests run it on the chart's rendered PrometheusRule. Prometheus 3.16.0 is the Go module
# github.com/prometheus/prometheus v0.316.0 (Prometheus 3.x releases are published to Go as v0.3xx.y).
PROMETHEUS_MODULE = "github.com/prometheus/prometheus"
PROMETHEUS_MODULE_VERSION = "v0.316.0"
PROMETHEUS_VERSION = "3.16.0"
PROMETHEUS_LDFLAGS = (
    f"-X github.com/prometheus/common/version.Version={PROMETHEUS_VERSION}",
    f"-X github.com/prometheus/common/version.Revision=go-module-{PROMETHEUS_MODULE_VERSION}",
    "-X github.com/prometheus/common/version.Branch=HEAD",
)
PROMTOOL = GoTool(name="promtool", module=PROMETHEUS_MODULE, package=f"{PROMETHEUS_MODULE}/cmd/promtool",
                  version=PROMETHEUS_MODULE_VERSION, version_command=("--version",), ldflags=PROMETHEUS_LDFLAGS)
# The Prometheus server itself, for the integration run that scrapes the services and asks it every dashboard
# query (tests/integration/test_prometheus_scrape.py) and for the PromQL parser the deployment tests read queries
# with (/api/v1/parse_query). Built in promtool's ``go install``: the packages both import compile once. Without
# the ``builtinassets`` build tag its web UI is not embedded; its HTTP API, all the tests use, is whole.
PROMETHEUS = GoTool(name="prometheus", module=PROMETHEUS_MODULE, package=f"{PROMETHEUS_MODULE}/cmd/prometheus",
                    version=PROMETHEUS_MODULE_VERSION, version_command=("--version",), ldflags=PROMETHEUS_LDFLAGS)
TOOLS = (HELM, KUSTOMIZE, PROMTOOL, PROMETHEUS)


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def ensure_tools(cache_dir: Path = DEFAULT_CACHE_DIR, log: Callable[[str], None] = _to_stderr) -> dict[str, Path]:
    """{name: path} of every tool in ``TOOLS`` under ``cache_dir``, building the missing ones first (module doc)."""
    cache_dir = cache_dir.resolve()  # the go command wants absolute paths
    paths = {tool.name: tool.path(cache_dir) for tool in TOOLS}
    if all(tool.is_built(cache_dir) for tool in TOOLS):
        return paths
    root = cache_dir / "gotools"
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / ".lock"):
        missing = [tool for tool in TOOLS if not tool.is_built(cache_dir)]
        if not missing:
            return paths
        started = time.monotonic()
        scratch = root / "build.partial"
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        try:
            go = _usable_go_on_path() or fetch_go_toolchain(scratch / "toolchain", log=log)
            for group in install_groups(missing):
                names = " and ".join(tool.name for tool in group)
                log(f"building {names} {group[0].version} from source with {go} (first run only, minutes)...")
                _go_install(go, group, scratch, cache_dir)
                for tool in group:
                    if not tool.is_built(cache_dir):
                        raise GoToolError(f"{tool.path(cache_dir)} was built but does not report version "
                                          f"{tool.version}")
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        log(f"built {', '.join(t.name + ' ' + t.version for t in missing)} into {root} in "
            f"{time.monotonic() - started:.0f} s")
    return paths


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def go_version(go: Path | str) -> tuple[int, int] | None:
    """(major, minor) of the Go toolchain ``go`` runs, as ``go env GOVERSION`` says; None when it does not run.
    GOTOOLCHAIN=local: the answer is that binary's own version, not one it would switch to."""
    try:
        result = subprocess.run([str(go), "env", "GOVERSION"], capture_output=True, text=True, timeout=60,
                                env={**os.environ, "GOTOOLCHAIN": "local"})
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = _GO_VERSION_RE.search(result.stdout)
    if result.returncode != 0 or not match:
        return None
    return int(match.group(1)), int(match.group(2))


def _usable_go_on_path() -> Path | None:
    found = shutil.which("go")
    if found is None:
        return None
    version = go_version(found)
    return Path(found) if version is not None and version >= MIN_GO else None


# For the other Go builds of gpumeter.devtools (kube.py): the same Go, the same kind of lock.
usable_go_on_path = _usable_go_on_path
locked = _locked


def toolchain_platform() -> str:
    system = {"Linux": "linux", "Darwin": "darwin"}.get(platform.system())
    machines = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}
    machine = machines.get(platform.machine().lower())
    name = f"{system}-{machine}"
    if system is None or machine is None or name not in GO_TOOLCHAIN_SUMS:
        raise GoToolError(f"no pinned Go toolchain for {platform.system()}/{platform.machine()}: install Go "
                             f">= {MIN_GO[0]}.{MIN_GO[1]} (https://go.dev/dl/) and run again")
    return name


def module_zip_hash(zip_path: Path) -> str:
    """The go.sum hash of a module zip: Go's dirhash "h1" (golang.org/x/mod/sumdb/dirhash.HashZip) — SHA-256 over
    the sorted lines "<sha256 hex of a file>  <its name in the zip>\\n", base64, prefixed "h1:"."""
    summary = hashlib.sha256()
    with zipfile.ZipFile(zip_path) as archive:
        names = sorted(info.filename for info in archive.infolist())
        for name in names:
            if "\n" in name:
                raise GoToolError(f"{zip_path}: a file name with a newline")
            digest = hashlib.sha256()
            with archive.open(name) as member:
                for chunk in iter(lambda: member.read(1 << 20), b""):
                    digest.update(chunk)
            summary.update(f"{digest.hexdigest()}  {name}\n".encode())
    return "h1:" + base64.b64encode(summary.digest()).decode()


def fetch_go_toolchain(dest: Path, *, version: str = GO_TOOLCHAIN_VERSION, platform_name: str | None = None,
                       sums: Mapping[str, str] = GO_TOOLCHAIN_SUMS, proxy: str = GO_PROXY,
                       log: Callable[[str], None] = _to_stderr) -> Path:
    """Download the Go toolchain module from ``proxy``, check its hash against ``sums``, unpack it into ``dest``;
    return the path of its ``bin/go``. Nothing is unpacked from a zip whose hash does not match."""
    platform_name = platform_name or toolchain_platform()
    module_version = f"v0.0.1-go{version}.{platform_name}"
    url = f"{proxy.rstrip('/')}/golang.org/toolchain/@v/{module_version}.zip"
    dest.mkdir(parents=True, exist_ok=True)
    archive = dest / f"{module_version}.zip"
    log(f"no Go >= {MIN_GO[0]}.{MIN_GO[1]} on PATH: downloading the Go {version} toolchain ({platform_name}) "
        f"from {url}...")
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(archive, "wb") as out:
            size = response.headers.get("Content-Length")
            if size:
                log(f"  {int(size) / 1e6:.0f} MB")
            shutil.copyfileobj(response, out, 1 << 20)
    except OSError as exc:
        raise GoToolError(f"could not download {url}: {exc}") from exc
    expected = sums[platform_name]
    try:
        actual = module_zip_hash(archive)
    except zipfile.BadZipFile as exc:
        raise GoToolError(f"{url} is not a zip file: {exc}") from exc
    if actual != expected:
        archive.unlink()
        raise GoToolError(f"checksum mismatch for golang.org/toolchain {module_version}: expected {expected}, "
                             f"got {actual}; the download was discarded")
    root = dest / "go"
    prefix = f"golang.org/toolchain@{module_version}/"
    with zipfile.ZipFile(archive) as zipped:
        for info in zipped.infolist():
            if not info.filename.startswith(prefix):
                raise GoToolError(f"{url}: {info.filename!r} is outside {prefix}")
            relative = Path(info.filename[len(prefix):])
            if relative.is_absolute() or ".." in relative.parts:
                raise GoToolError(f"{url}: unsafe path {info.filename!r}")
            if info.is_dir():
                continue
            out_path = root / relative
            out_path.parent.mkdir(parents=True, exist_ok=True)
            with zipped.open(info) as member, open(out_path, "wb") as out:
                shutil.copyfileobj(member, out, 1 << 20)
            # Module zips carry no file modes; the go command marks the same two folders executable.
            if relative.parts[0] == "bin" or relative.parts[:2] == ("pkg", "tool"):
                out_path.chmod(0o755)
    archive.unlink()
    go = root / "bin" / "go"
    if not go.is_file():
        raise GoToolError(f"{url} holds no bin/go")
    return go


def install_groups(tools: list[GoTool] | tuple[GoTool, ...]) -> list[tuple[GoTool, ...]]:
    """``tools`` in groups that one ``go install`` builds: the same module, version and ldflags (``go install``
    takes several packages only of one module at one version, and applies one -ldflags to all), in first-seen
    order."""
    groups: dict[tuple[str, str, tuple[str, ...]], list[GoTool]] = {}
    for tool in tools:
        groups.setdefault((tool.module, tool.version, tool.ldflags), []).append(tool)
    return [tuple(group) for group in groups.values()]


def _go_install(go: Path, tools: tuple[GoTool, ...], scratch: Path, cache_dir: Path) -> None:
    env = {
        **os.environ,
        "GOTOOLCHAIN": "local",
        "CGO_ENABLED": "0",
        "GOFLAGS": "-modcacherw",  # so the scratch module cache can be removed without chmod
        "GOPATH": str(scratch / "gopath"),
        "GOMODCACHE": str(scratch / "gopath" / "pkg" / "mod"),
        "GOCACHE": str(scratch / "gocache"),
        "GOBIN": str(scratch / "bin"),
    }
    (ldflags_set,) = {tool.ldflags for tool in tools}
    ldflags = " ".join(("-s", "-w", *ldflags_set))
    packages = [f"{tool.package}@{tool.version}" for tool in tools]
    command = [str(go), "install", "-trimpath", "-ldflags", ldflags, *packages]
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise GoToolError(f"go install {' '.join(packages)} failed ({result.returncode}):\n"
                          f"{result.stderr[-4000:]}")
    for tool in tools:
        built = scratch / "bin" / tool.name
        if not built.is_file():
            raise GoToolError(f"go install {' '.join(packages)} succeeded but left no {built}")
        target = tool.path(cache_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(built, target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpumeter.devtools.gotools", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["build", "paths"],
                        help="build: build what is missing and print the paths; paths: print where they go")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    args = parser.parse_args(argv)
    if args.command == "paths":
        paths = {tool.name: tool.path(args.cache_dir) for tool in TOOLS}
    else:
        try:
            paths = ensure_tools(args.cache_dir)
        except GoToolError as exc:
            _to_stderr(f"error: {exc}")
            return 1
    for name, path in paths.items():
        print(f"{name} {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
