"""Where the development tools keep what they download (standard library only: ``make`` imports it before
gpumeter is installed).

``DEFAULT_CACHE_DIR`` is ``$GPUMETER_CACHE_DIR``, else ``.cache/`` at the repository root: Kafka's jars
(``kafka/libs``), the local broker's state (``kafka-run``), ``make run``'s runs (``runs``). ``wheels_dir()`` is
``$GPUMETER_WHEELS_DIR``, else ``<cache>/wheels``: every Python wheel ``make`` installed, kept so that a new
virtualenv (``make clean``, a fresh clone given the same folder) installs without downloading again.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

REPO_ROOT = Path(__file__).resolve().parents[2]
CACHE_ENV = "GPUMETER_CACHE_DIR"
WHEELS_ENV = "GPUMETER_WHEELS_DIR"


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(env[CACHE_ENV]) if env.get(CACHE_ENV) else REPO_ROOT / ".cache"


def wheels_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(env[WHEELS_ENV]) if env.get(WHEELS_ENV) else cache_dir(env) / "wheels"


DEFAULT_CACHE_DIR = cache_dir()
