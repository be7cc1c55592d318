"""gpumeter.devtools.kube: the pinned wrapper module that etcd and kube-apiserver are built from, and how a build is
recognised. The build itself (Go, the module proxy) runs in tests/integration/test_kube_build.py and the session
fixture ``kube_apiserver``."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from gpumeter.devtools import kube
from gpumeter.devtools.gotools import GoToolError


@pytest.fixture
def wrapper(tmp_path: Path) -> Path:
    copy = tmp_path / "kube-wrapper"
    shutil.copytree(kube.WRAPPER_DIR, copy)
    return copy


def test_the_committed_wrapper_pins_the_versions_named_here():
    kube.check_wrapper()
    go_mod = (kube.WRAPPER_DIR / "go.mod").read_text()
    go_sum = (kube.WRAPPER_DIR / "go.sum").read_text()
    replaced = re.findall(r"^\s*(k8s\.io/[\w.-]+) => \1 (v\S+)$", go_mod, re.M)
    # Every staging module Kubernetes replaces by ./staging/...: 33 in v1.37.2, each by its published v0.37.2,
    # whose hash go.sum holds.
    assert len(replaced) == 33 and {v for _, v in replaced} == {kube.STAGING_VERSION}
    # Those the build uses are hashed at that version (six, such as the sample servers, are not in its graph).
    hashed = [m for m, v in replaced if f"{m} {v} h1:" in go_sum]
    assert len(hashed) == 27
    assert "k8s.io/api v0.37.2 h1:" in go_sum and "k8s.io/apiserver v0.37.2 h1:" in go_sum


def test_a_go_sum_without_the_pinned_kubernetes_is_refused_before_any_build(wrapper):
    go_sum = wrapper / "go.sum"
    go_sum.write_text("".join(line for line in go_sum.read_text().splitlines(keepends=True)
                              if not line.startswith("k8s.io/kubernetes ")))
    with pytest.raises(GoToolError, match="go.sum has no hash of k8s.io/kubernetes v1.37.2"):
        kube.check_wrapper(wrapper)


def test_a_go_mod_at_other_versions_is_refused(wrapper):
    go_mod = wrapper / "go.mod"
    text = go_mod.read_text()
    go_mod.write_text(text.replace("k8s.io/kubernetes v1.37.2", "k8s.io/kubernetes v1.37.1")
                      .replace("k8s.io/client-go => k8s.io/client-go v0.37.2", "k8s.io/client-go => ./client-go"))
    with pytest.raises(GoToolError) as raised:
        kube.check_wrapper(wrapper)
    assert "go.mod does not require k8s.io/kubernetes v1.37.2" in str(raised.value)


def test_a_staging_module_replaced_by_another_version_is_refused(wrapper):
    go_mod = wrapper / "go.mod"
    go_mod.write_text(go_mod.read_text().replace("k8s.io/api => k8s.io/api v0.37.2", "k8s.io/api => k8s.io/api v0.37.1"))
    with pytest.raises(GoToolError, match="replaces k8s.io/api by k8s.io/api v0.37.1"):
        kube.check_wrapper(wrapper)


def test_the_build_id_names_the_versions_and_changes_with_any_wrapper_file(wrapper):
    before = kube.build_id(wrapper)
    assert before.startswith("k8s-v1.37.2-etcd-v3.7.0-") and before == kube.build_id(kube.WRAPPER_DIR)
    main = wrapper / "cmd" / "kube-pki" / "main.go"
    main.write_text(main.read_text() + "\n// edited\n")
    assert kube.build_id(wrapper) != before


def _fake(path: Path, output: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\necho '{output}'\n")
    path.chmod(0o755)


def test_a_build_counts_only_when_both_servers_report_the_pinned_versions(tmp_path):
    binaries = kube.binaries_in(tmp_path)
    assert binaries.kube_apiserver.parent == tmp_path / "kube" / kube.build_id()
    assert not kube.is_built(binaries)
    _fake(binaries.kube_apiserver, "Kubernetes v1.37.2")
    _fake(binaries.etcd, "etcd Version: 3.7.0")
    _fake(binaries.kube_pki, "")
    assert kube.is_built(binaries)
    _fake(binaries.kube_apiserver, "Kubernetes v0.0.0-master+$Format:%H$")  # built without the version ldflags
    assert not kube.is_built(binaries)


def test_the_version_ldflags_are_kubernetes_own():
    assert "-X k8s.io/component-base/version.gitVersion=v1.37.2" in kube.KUBE_LDFLAGS
    assert "-X k8s.io/component-base/version.gitMinor=37" in kube.KUBE_LDFLAGS
    assert "-X k8s.io/client-go/pkg/version.gitVersion=v1.37.2" in kube.KUBE_LDFLAGS
