"""``pip install`` through a kept folder of wheels, saying what it downloads and how big.

``make`` runs it as ``python -m gpumeter.devtools.pip_install <requirements and pip options>`` from the
repository root before gpumeter is installed, so it uses the standard library only. Two steps:

1. ``pip download -d <wheels>``: every wheel the requirements need (and the build backend's, for an editable
   install of this project) into the wheels folder (``gpumeter.devtools.cache.wheels_dir``). First from that
   folder alone (no network); only when something is missing there, from the index, where a file already in the
   folder is not downloaded again (pip checks it against the index's hash). So only the first virtualenv on a
   machine, or a new pin, pays for a download. One line per file downloaded, with its size, then a summary.
2. ``pip install --no-index --find-links <wheels>``: the install itself, from those files only.

pip's own HTTP cache would do the first step's job where the package index sends caching headers; the index this
project's machines reach sends none, so pip would download every wheel again for each new virtualenv.
On failure it prints pip's output and exits with pip's status.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from gpumeter.devtools.cache import wheels_dir

_FILE_LINE = re.compile(r"^\s*(Downloading|Using cached) (\S+) \(([\d.]+) (B|kB|MB|GB)\)\s*$")
_UNIT_BYTES = {"B": 1, "kB": 1_000, "MB": 1_000_000, "GB": 1_000_000_000}


def human_bytes(size: int) -> str:
    return f"{size / 1e6:.1f} MB" if size >= 100_000 else f"{size / 1e3:.0f} kB"


@dataclass
class DownloadTally:
    downloaded: list[tuple[str, int]] = field(default_factory=list)

    def read(self, line: str) -> tuple[str, int] | None:
        """Count a pip output line naming a file it downloads (wheel metadata files are not counted); return
        (file name, bytes) for such a line."""
        match = _FILE_LINE.match(line)
        if match is None or match.group(2).endswith(".metadata"):
            return None
        _verb, name, amount, unit = match.groups()
        size = int(float(amount) * _UNIT_BYTES[unit])
        self.downloaded.append((name, size))
        return name, size

    def summary(self, wheels: Path) -> str:
        if not self.downloaded:
            return f"nothing to download (every wheel is in {wheels})"
        total = sum(size for _, size in self.downloaded)
        count = len(self.downloaded)
        return f"{count} file{'s' if count != 1 else ''} downloaded ({human_bytes(total)}) into {wheels}"


def download_arguments(arguments: Sequence[str], project_root: Path) -> list[str]:
    """``pip install`` arguments as ``pip download`` takes them: ``-e X`` becomes ``X``, and an editable or local
    install of ``project_root`` adds its build-system requirements (the isolated build needs them offline)."""
    result: list[str] = []
    local = False
    items = list(arguments)
    while items:
        item = items.pop(0)
        if item in ("-e", "--editable"):
            item = items.pop(0)
        if item.startswith(".") and Path(item.split("[")[0]).resolve() == project_root.resolve():
            local = True
        result.append(item)
    pyproject = project_root / "pyproject.toml"
    if local and pyproject.is_file():
        result += tomllib.loads(pyproject.read_text(encoding="utf-8")).get("build-system", {}).get("requires", [])
    return result


def _pip(python: str, arguments: list[str], on_line: Callable[[str], None] = lambda line: None
         ) -> tuple[int, list[str]]:
    process = subprocess.Popen([python, "-m", "pip", *arguments], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, text=True)
    assert process.stdout is not None
    output = []
    for line in process.stdout:
        output.append(line.rstrip("\n"))
        on_line(line)
    return process.wait(), output


def install(arguments: Sequence[str], *, label: str = "Python packages", wheels: Path | None = None,
            log: Callable[[str], None] | None = None, python: str = sys.executable,
            project_root: Path = Path.cwd()) -> int:
    """Download into ``wheels`` what ``arguments`` need, install from there; pip's exit status."""
    log = log or (lambda message: print(message, flush=True))
    wheels = wheels or wheels_dir()
    wheels.mkdir(parents=True, exist_ok=True)
    tally = DownloadTally()

    def report(line: str) -> None:
        counted = tally.read(line)
        if counted is not None:
            log(f"{label}: downloading {counted[0]} ({human_bytes(counted[1])})")

    wanted = download_arguments(arguments, project_root)
    code, output = _pip(python, ["download", "--no-index", "--find-links", str(wheels), "--progress-bar", "off",
                                 "-d", str(wheels), *wanted])
    if code != 0:  # something is not in the folder yet: ask the index
        code, output = _pip(python, ["download", "--progress-bar", "off", "-d", str(wheels), *wanted], report)
    if code != 0:
        log("\n".join(output[-200:]))
        log(f"{label}: pip download failed (exit {code})")
        return code
    log(f"{label}: {tally.summary(wheels)}; installing...")
    code, output = _pip(python, ["install", "--no-index", "--find-links", str(wheels), "--no-compile", *arguments])
    if code != 0:
        log("\n".join(output[-200:]))
        log(f"{label}: pip install failed (exit {code})")
    return code


def main(argv: Sequence[str] | None = None) -> int:
    return install(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
