"""Every `pdserve` process (and so every `serve` child, which inherits it) runs with
OMP_WAIT_POLICY=PASSIVE set before torch loads libgomp (runtime/thread_waits.py), unless the
user set the variable; set after torch's import it would be too late, and the call says so."""

from __future__ import annotations

import os
import subprocess
import sys

ENTRY = """
import os, sys
from pdserve.cli.main import main
try:
    main(["--help"])
except SystemExit:
    pass
print("torch" in sys.modules, os.environ.get("OMP_WAIT_POLICY"))
"""


def run(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**clean, **env}, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_the_entry_point_sets_passive_waits_before_torch_loads():
    assert run(ENTRY) == "False PASSIVE"


def test_a_value_the_user_set_wins():
    assert run(ENTRY, OMP_WAIT_POLICY="ACTIVE") == "False ACTIVE"


def test_set_after_torch_it_reports_that_it_came_too_late():
    code = "import torch\nfrom pdserve.runtime.thread_waits import use_passive_waits\nprint(use_passive_waits())"
    assert run(code) == "False"
    assert run("from pdserve.runtime.thread_waits import use_passive_waits\nprint(use_passive_waits())") == "True"
