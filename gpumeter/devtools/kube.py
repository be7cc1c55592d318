"""etcd and kube-apiserver for the tests that meet a real Kubernetes API server: built once from source with Go
into the cache, the way ``gotools`` builds helm and kustomize (and with its Go).

Contract:

* ``ensure_kube_binaries(cache_dir)`` returns the paths of ``kube-apiserver`` (Kubernetes ``KUBERNETES_VERSION``),
  ``etcd`` (``ETCD_VERSION``, the etcd Kubernetes' own go.mod requires and kubeadm runs for that release) and
  ``kube-pki`` (writes the test cluster's CA, certificates and service-account key with Go's crypto/x509: the
  Python side has no X.509 library and need not have one) under ``cache_dir/kube/<build id>/``, building them on
  the first call. The build id names both versions and a hash of the wrapper module's files, so an edited
  wrapper is rebuilt, never confused with an older build.
* What is built is the wrapper module ``gpumeter/devtools/kube-wrapper``: its ``go.mod`` requires
  ``k8s.io/kubernetes`` and replaces each staging module that Kubernetes' own go.mod replaces by ``./staging/...``
  (``k8s.io/api``, ``k8s.io/apiserver``, ...) by its published ``v0.<minor>.<patch>``; its ``go.sum`` is
  committed. The build runs with ``-mod=readonly``: a module missing from go.sum, or one whose download does not
  match it, fails the build with Go's own message in a ``GoToolError``; nothing is resolved anew behind the
  pinned versions. The versions pinned here and the wrapper's go.mod are checked against each other first.
* kube-apiserver carries the release's version (``-X k8s.io/component-base/version.*``, as Kubernetes' own build
  sets it), so ``/version`` says ``v1.37.2``, not ``v0.0.0-master``. Static (``CGO_ENABLED=0``), ``-trimpath``.
* Go as ``gotools`` picks it (``go`` on PATH when new enough, else the pinned, checksum-checked toolchain),
  ``GOTOOLCHAIN=local``, module and build caches in a scratch folder removed afterwards; one lock
  (``cache_dir/kube/.lock``) so that concurrent callers build once.

Command line: ``python -m gpumeter.devtools.kube build`` (``make kube-tools``; ``make test`` runs it) prints the
paths. Cold, the build downloads about 700 MB of modules and compiles for 8.7 CPU-minutes (15 minutes of wall
clock on 2 cores shared with other builds and tests, 4 Dec 2026; kube-apiserver is 119 MB stripped, etcd 25 MB);
later calls find the binaries in milliseconds.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from gpumeter.devtools.gotools import (
    DEFAULT_CACHE_DIR,
    GoToolError,
    fetch_go_toolchain,
    locked,
    usable_go_on_path,
)

KUBERNETES_VERSION = "v1.37.2"
# The staging modules' published versions: v0.<minor>.<patch> of the Kubernetes release.
STAGING_VERSION = "v0.37.2"
# The etcd Kubernetes v1.37.2's go.mod requires (go.etcd.io/etcd/server/v3) and kubeadm runs for 1.37 (3.7.0-0).
ETCD_VERSION = "v3.7.0"
WRAPPER_DIR = Path(__file__).resolve().parent / "kube-wrapper"
# The files of the wrapper that make up the build (the build id hashes them).
WRAPPER_FILES = ("go.mod", "go.sum", "cmd/kube-apiserver/main.go", "cmd/etcd/main.go", "cmd/kube-pki/main.go")

_MAJOR, _MINOR, _PATCH = KUBERNETES_VERSION.lstrip("v").split(".")
# What Kubernetes' hack/lib/version.sh passes for a release build (buildDate is left out: the build stays
# reproducible; /version reports it empty).
KUBE_LDFLAGS = tuple(
    f"-X {package}.{key}={value}"
    for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
    for key, value in (("gitVersion", KUBERNETES_VERSION), ("gitMajor", _MAJOR), ("gitMinor", _MINOR),
                       ("gitTreeState", "clean"))
)


@dataclass(frozen=True)
class KubeBinaries:
    """Paths of the three built programs."""

    kube_apiserver: Path
    etcd: Path
    kube_pki: Path

    def as_dict(self) -> dict[str, Path]:
        return {"kube-apiserver": self.kube_apiserver, "etcd": self.etcd, "kube-pki": self.kube_pki}


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build_id(wrapper_dir: Path = WRAPPER_DIR) -> str:
    """``k8s-<version>-etcd-<version>-<12 hex>``: the hash over the wrapper's files (names and contents)."""
    digest = hashlib.sha256()
    for name in WRAPPER_FILES:
        digest.update(name.encode() + b"\0" + (wrapper_dir / name).read_bytes() + b"\0")
    return f"k8s-{KUBERNETES_VERSION}-etcd-{ETCD_VERSION}-{digest.hexdigest()[:12]}"


def binaries_in(cache_dir: Path, wrapper_dir: Path = WRAPPER_DIR) -> KubeBinaries:
    folder = cache_dir / "kube" / build_id(wrapper_dir)
    return KubeBinaries(folder / "kube-apiserver", folder / "etcd", folder / "kube-pki")


def check_wrapper(wrapper_dir: Path = WRAPPER_DIR) -> None:
    """The wrapper's go.mod requires the versions pinned here, replaces every staging module by
    ``STAGING_VERSION``, and go.sum lists them: else ``GoToolError`` saying what disagrees."""
    go_mod = (wrapper_dir / "go.mod").read_text()
    go_sum = (wrapper_dir / "go.sum").read_text() if (wrapper_dir / "go.sum").is_file() else ""
    problems = []
    for module, version in (("k8s.io/kubernetes", KUBERNETES_VERSION), ("go.etcd.io/etcd/server/v3", ETCD_VERSION)):
        if not re.search(rf"^\s*(require\s+)?{re.escape(module)} {re.escape(version)}\s*$", go_mod, re.M):
            problems.append(f"go.mod does not require {module} {version}")
        if f"{module} {version} h1:" not in go_sum:
            problems.append(f"go.sum has no hash of {module} {version}")
    replaced = re.findall(r"^\s*(k8s\.io/[\w.-]+) => (\S+) (\S+)\s*$", go_mod, re.M)
    if not replaced:
        problems.append("go.mod replaces no staging module")
    for module, target, version in replaced:
        if target != module or version != STAGING_VERSION:
            problems.append(f"go.mod replaces {module} by {target} {version}, not by {module} {STAGING_VERSION}")
    if problems:
        raise GoToolError(f"{wrapper_dir}: " + "; ".join(problems))


def _reports_version(binary: Path, args: tuple[str, ...], expected: str) -> bool:
    if not binary.is_file():
        return False
    try:
        result = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0 and expected in result.stdout


def is_built(binaries: KubeBinaries) -> bool:
    """All three are there and the two servers report the pinned versions."""
    return (_reports_version(binaries.kube_apiserver, ("--version",), f"Kubernetes {KUBERNETES_VERSION}")
            and _reports_version(binaries.etcd, ("--version",), f"etcd Version: {ETCD_VERSION.lstrip('v')}")
            and binaries.kube_pki.is_file() and os.access(binaries.kube_pki, os.X_OK))


def ensure_kube_binaries(cache_dir: Path = DEFAULT_CACHE_DIR, log: Callable[[str], None] = _to_stderr,
                         wrapper_dir: Path = WRAPPER_DIR) -> KubeBinaries:
    """The built binaries under ``cache_dir`` (module doc), building them first when missing."""
    cache_dir = cache_dir.resolve()  # the go command wants absolute paths
    binaries = binaries_in(cache_dir, wrapper_dir)
    if is_built(binaries):
        return binaries
    check_wrapper(wrapper_dir)
    root = cache_dir / "kube"
    root.mkdir(parents=True, exist_ok=True)
    with locked(root / ".lock"):
        if is_built(binaries):
            return binaries
        started = time.monotonic()
        scratch = root / "build.partial"
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        try:
            go = usable_go_on_path() or fetch_go_toolchain(scratch / "toolchain", log=log)
            log(f"building kube-apiserver {KUBERNETES_VERSION} and etcd {ETCD_VERSION} from source with {go} "
                f"(first run only: 9 CPU-minutes, 700 MB of modules)...")
            _go_build(go, wrapper_dir, scratch)
            folder = binaries.kube_apiserver.parent
            folder.mkdir(parents=True, exist_ok=True)
            for name, target in binaries.as_dict().items():
                os.replace(scratch / "bin" / name, target)
            if not is_built(binaries):
                raise GoToolError(f"{folder}: built, but kube-apiserver or etcd does not report "
                                  f"{KUBERNETES_VERSION} / {ETCD_VERSION}")
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        log(f"built kube-apiserver {KUBERNETES_VERSION}, etcd {ETCD_VERSION} and kube-pki into "
            f"{binaries.kube_apiserver.parent} in {time.monotonic() - started:.0f} s")
    return binaries


def _go_build(go: Path, wrapper_dir: Path, scratch: Path) -> None:
    env = {
        **os.environ,
        "GOTOOLCHAIN": "local",
        "CGO_ENABLED": "0",
        # readonly: go.mod and go.sum are used as committed, a missing or mismatching hash is an error.
        "GOFLAGS": "-modcacherw -mod=readonly",
        "GOPATH": str(scratch / "gopath"),
        "GOMODCACHE": str(scratch / "gopath" / "pkg" / "mod"),
        "GOCACHE": str(scratch / "gocache"),
    }
    env["GOWORK"] = "off"  # the wrapper's go.mod alone, whatever go.work an outer folder has
    out = scratch / "bin"
    out.mkdir(parents=True, exist_ok=True)
    ldflags = " ".join(("-s", "-w", *KUBE_LDFLAGS))
    command = [str(go), "build", "-trimpath", "-ldflags", ldflags, "-o", str(out) + os.sep,
               "./cmd/kube-apiserver", "./cmd/etcd", "./cmd/kube-pki"]
    result = subprocess.run(command, cwd=wrapper_dir, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise GoToolError(f"go build in {wrapper_dir} failed ({result.returncode}):\n{result.stderr[-4000:]}")
    for name in ("kube-apiserver", "etcd", "kube-pki"):
        if not (out / name).is_file():
            raise GoToolError(f"go build in {wrapper_dir} succeeded but left no {out / name}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpumeter.devtools.kube", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["build", "paths"],
                        help="build: build what is missing and print the paths; paths: print where they go")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    args = parser.parse_args(argv)
    if args.command == "paths":
        binaries = binaries_in(args.cache_dir.resolve())
    else:
        try:
            binaries = ensure_kube_binaries(args.cache_dir)
        except GoToolError as exc:
            _to_stderr(f"error: {exc}")
            return 1
    for name, path in binaries.as_dict().items():
        print(f"{name} {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
