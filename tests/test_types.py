"""mypy (pyproject.toml [tool.mypy]) is clean on the whole `pdserve` package."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pdserve" / "mypy"


def package_tree(dest: Path) -> Path:
    """`pdserve` laid out as installed, in symlinks under `dest`: mypy does not follow setuptools'
    package-dir, which keeps the subpackages in the repository's top-level folders."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    pkg = dest / "pdserve"
    pkg.mkdir(parents=True)
    for entry in (ROOT / package_dir["pdserve"]).iterdir():
        (pkg / entry.name).symlink_to(entry)
    for name, folder in package_dir.items():
        parts = name.split(".")
        if len(parts) == 2:
            (pkg / parts[1]).symlink_to(ROOT / folder)
        elif len(parts) > 2:  # reached through its parent's link: it must sit where that puts it
            parent = package_dir[".".join(parts[:-1])]
            assert Path(folder) == Path(parent) / parts[-1], f"{name} = {folder!r} is not under {parent!r}"
    return dest


def test_mypy_is_clean(tmp_path):
    tree = package_tree(tmp_path / "tree")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            "--cache-dir",
            str(CACHE),
            "-p",
            "pdserve",
        ],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
