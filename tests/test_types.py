"""mypy (pyproject.toml [tool.mypy]) is clean on the whole `pdserve` package, run from the
repository root as a user would: import names are paths (pdserve/X links to X/)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pdserve" / "mypy"


def test_mypy_is_clean():
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
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
