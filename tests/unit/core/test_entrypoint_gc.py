"""A service process raises the young generation's collection threshold at start (``tune_garbage_collector``) and
keeps the older generations' as CPython sets them."""

from __future__ import annotations

import subprocess
import sys

from gpumeter.entrypoint import GC_GEN0_THRESHOLD


def test_a_service_process_collects_its_young_generation_less_often():
    script = ("import gc\n"
              "before = gc.get_threshold()\n"
              "from gpumeter.entrypoint import tune_garbage_collector\n"
              "tune_garbage_collector()\n"
              "print(before, gc.get_threshold())\n")
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True).stdout
    before, after = (tuple(int(x) for x in part.strip("() ").split(",")) for part in out.strip().split(") ("))
    assert after == (GC_GEN0_THRESHOLD, before[1], before[2])
    assert GC_GEN0_THRESHOLD > before[0]

