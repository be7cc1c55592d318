"""The built etcd and kube-apiserver (gpumeter.devtools.kube) and the control plane the session runs from them
(gpumeter.devtools.kube_apiserver): the versions, what the server serves, that RBAC and admission are on; and that
the build uses go.sum as committed (a module whose download does not match, or that go.sum lacks, stops it).

The go.sum cases build a wrapper of the same shape (the three ``cmd/`` programs) over a one-file module served by
a ``file://`` module proxy, with the same ``_go_build`` and the same Go as the real build.
"""

from __future__ import annotations

import hashlib
import base64
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from gpumeter.devtools import kube
from gpumeter.devtools.gotools import GoToolError, fetch_go_toolchain, module_zip_hash, usable_go_on_path
from tests.integration.kube_world import new_namespace

pytestmark = [pytest.mark.integration]


def test_the_binaries_report_the_pinned_versions(kube_apiserver):
    version = subprocess.run([str(kube_apiserver.binaries.kube_apiserver), "--version"], capture_output=True,
                             text=True, check=True).stdout.strip()
    assert version == "Kubernetes v1.37.2"
    etcd = subprocess.run([str(kube_apiserver.binaries.etcd), "--version"], capture_output=True, text=True,
                          check=True).stdout
    assert "etcd Version: 3.7.0" in etcd
    status, served = kube_apiserver.request("GET", "/version")
    assert status == 200 and (served["gitVersion"], served["major"], served["minor"]) == ("v1.37.2", "1", "37")


def test_the_server_serves_dra_and_enforces_rbac_and_admission(kube_apiserver):
    status, group = kube_apiserver.request("GET", "/apis/resource.k8s.io/v1")
    assert status == 200
    assert {"resourceslices", "resourceclaims", "deviceclasses", "resourceclaims/status"} <= {
        r["name"] for r in group["resources"]}
    # RBAC: a ServiceAccount nobody granted anything may not even list namespaces.
    namespace = new_namespace(kube_apiserver)
    token = kube_apiserver.must("POST", f"/api/v1/namespaces/{namespace}/serviceaccounts/default/token",
                                {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {}})
    status, answer = kube_apiserver.request("GET", "/api/v1/namespaces", token=answer_token(token))
    assert status == 403 and answer["reason"] == "Forbidden"
    # Admission as a cluster runs it: NamespaceLifecycle refuses a pod in a namespace that does not exist, and
    # ServiceAccount one whose ServiceAccount the controllers have not created.
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
           "spec": {"containers": [{"name": "c", "image": "busybox"}], "serviceAccountName": "nobody"}}
    status, answer = kube_apiserver.request("POST", "/api/v1/namespaces/no-such-namespace/pods", pod)
    assert status == 404 and answer["reason"] == "NotFound"
    status, answer = kube_apiserver.request("POST", f"/api/v1/namespaces/{namespace}/pods", pod)
    assert status == 403 and 'serviceaccount "nobody" not found' in answer["message"]


def answer_token(answer: dict) -> str:
    return answer["status"]["token"]


# --- go.sum as committed ------------------------------------------------------------------------------------------

DEP = "example.com/gpumeter-dep"
DEP_VERSION = "v1.0.0"
DEP_GO_MOD = f"module {DEP}\n\ngo 1.22\n"
DEP_SOURCE = "package dep\n\nconst Name = \"dep\"\n"


def _h1(files: dict[str, bytes]) -> str:
    summary = hashlib.sha256()
    for name in sorted(files):
        summary.update(f"{hashlib.sha256(files[name]).hexdigest()}  {name}\n".encode())
    return "h1:" + base64.b64encode(summary.digest()).decode()


def _proxy(root: Path) -> tuple[str, str]:
    """A file:// module proxy serving DEP; returns (the zip's h1, the go.mod's h1)."""
    folder = root / DEP / "@v"
    folder.mkdir(parents=True)
    (folder / "list").write_text(DEP_VERSION + "\n")
    (folder / f"{DEP_VERSION}.info").write_text(f'{{"Version":"{DEP_VERSION}","Time":"2026-01-01T00:00:00Z"}}')
    (folder / f"{DEP_VERSION}.mod").write_text(DEP_GO_MOD)
    with zipfile.ZipFile(folder / f"{DEP_VERSION}.zip", "w") as archive:
        archive.writestr(f"{DEP}@{DEP_VERSION}/go.mod", DEP_GO_MOD)
        archive.writestr(f"{DEP}@{DEP_VERSION}/dep.go", DEP_SOURCE)
    return module_zip_hash(folder / f"{DEP_VERSION}.zip"), _h1({"go.mod": DEP_GO_MOD.encode()})


def _wrapper(root: Path, go_sum: str) -> Path:
    wrapper = root / "wrapper"
    for name in ("kube-apiserver", "etcd", "kube-pki"):
        (wrapper / "cmd" / name).mkdir(parents=True)
        (wrapper / "cmd" / name / "main.go").write_text(
            # println, not fmt: a fresh build cache compiles only the runtime for it.
            f'package main\n\nimport dep "{DEP}"\n\nfunc main() {{ println(dep.Name) }}\n')
    (wrapper / "go.mod").write_text(f"module gpumeter.local/test-wrapper\n\ngo 1.22\n\nrequire {DEP} {DEP_VERSION}\n")
    (wrapper / "go.sum").write_text(go_sum)
    return wrapper


@pytest.fixture
def go(tmp_path_factory) -> Path:
    return usable_go_on_path() or fetch_go_toolchain(tmp_path_factory.mktemp("toolchain"))


@pytest.mark.parametrize("case", ["matching", "mismatching", "missing"])
def test_the_build_uses_go_sum_as_committed(go, tmp_path, monkeypatch, case):
    zip_hash, mod_hash = _proxy(tmp_path / "proxy")
    wrong = "h1:" + base64.b64encode(b"\0" * 32).decode()
    go_sum = {
        "matching": f"{DEP} {DEP_VERSION} {zip_hash}\n{DEP} {DEP_VERSION}/go.mod {mod_hash}\n",
        "mismatching": f"{DEP} {DEP_VERSION} {wrong}\n{DEP} {DEP_VERSION}/go.mod {mod_hash}\n",
        "missing": f"{DEP} {DEP_VERSION}/go.mod {mod_hash}\n",
    }[case]
    wrapper = _wrapper(tmp_path, go_sum)
    monkeypatch.setenv("GOPROXY", f"file://{tmp_path / 'proxy'}")
    monkeypatch.setenv("GOSUMDB", "off")  # only go.sum vouches for the module: what is under test
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    if case == "matching":
        kube._go_build(go, wrapper, scratch)
        assert subprocess.run([str(scratch / "bin" / "etcd")], capture_output=True, text=True).stderr == "dep\n"
    else:
        with pytest.raises(GoToolError) as raised:
            kube._go_build(go, wrapper, scratch)
        expected = "checksum mismatch" if case == "mismatching" else "missing go.sum entry"
        assert expected in str(raised.value)
        assert not (scratch / "bin" / "etcd").exists()
    assert (wrapper / "go.sum").read_text() == go_sum  # never rewritten
    shutil.rmtree(scratch, ignore_errors=True)
