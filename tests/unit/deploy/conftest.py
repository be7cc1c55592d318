"""The deployment tests' tools: helm, kustomize and promtool, real binaries built from source once
(gpumeter.devtools.gotools).

``make test`` builds them before pytest (``make deploy-tools``), so a test run only finds them. A run without that
step builds them here, once per cache, in a subprocess (minutes; it says so): the tests never skip for want of them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpumeter.devtools import gotools


@pytest.fixture(scope="session")
def go_tools() -> dict[str, Path]:
    cache_dir = gotools.DEFAULT_CACHE_DIR.resolve()
    if not all(tool.is_built(cache_dir) for tool in gotools.TOOLS):
        # A subprocess: the build downloads (the Go module proxy), which the unit tests' TCP guard forbids here.
        result = subprocess.run([sys.executable, "-m", "gpumeter.devtools.gotools", "build",
                                 "--cache-dir", str(cache_dir)], capture_output=True, text=True)
        if result.returncode != 0:
            pytest.fail(f"could not build helm, kustomize and promtool (`make deploy-tools`):\n"
                        f"{result.stderr[-4000:]}")
    return {tool.name: tool.path(cache_dir) for tool in gotools.TOOLS}
