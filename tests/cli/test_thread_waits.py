"""Every `pdserve` process sets how its idle OpenMP threads wait before torch loads libgomp
(runtime/thread_waits.py): decode and colocated workers a short spin, every other process asleep
at once; a value the user set wins; `serve`'s children, which inherit the value pdserve chose for
the parent, choose again for their role; set after torch's import it is too late, and says so."""

from __future__ import annotations

import os
import subprocess
import sys

from pdserve.runtime.thread_waits import CHOSEN_MARK, DECODE_SPINCOUNT, VARIABLES

ENTRY = """
import os, sys
from pdserve.cli.main import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print("torch" in sys.modules, os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT"))
"""


def run(code: str, *args: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in (*VARIABLES, CHOSEN_MARK)}
    out = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env={**clean, **env}, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_every_process_but_a_decoding_worker_sleeps_at_once_set_before_torch_loads():
    assert run(ENTRY, "--help") == "False PASSIVE None"
    assert run(ENTRY, "prefill", "--help") == "False PASSIVE None"
    assert run(ENTRY, "gateway", "--help") == "False PASSIVE None"


def test_decode_and_colocated_workers_spin_briefly():
    assert run(ENTRY, "decode", "--help") == f"False None {DECODE_SPINCOUNT}"
    assert run(ENTRY, "colocated", "--help") == f"False None {DECODE_SPINCOUNT}"


def test_serves_children_choose_again_for_their_role():
    # what `serve`'s process chose, as its children inherit it
    parent = {"OMP_WAIT_POLICY": "PASSIVE", CHOSEN_MARK: "1"}
    assert run(ENTRY, "decode", "--help", **parent) == f"False None {DECODE_SPINCOUNT}"
    assert run(ENTRY, "prefill", "--help", **parent) == "False PASSIVE None"


def test_a_value_the_user_set_wins():
    assert run(ENTRY, "decode", "--help", OMP_WAIT_POLICY="PASSIVE") == "False PASSIVE None"
    assert run(ENTRY, "prefill", "--help", OMP_WAIT_POLICY="ACTIVE") == "False ACTIVE None"
    assert run(ENTRY, "prefill", "--help", GOMP_SPINCOUNT="500") == "False None 500"


def test_set_after_torch_it_reports_that_it_came_too_late():
    code = (
        "import torch\nfrom pdserve.runtime.thread_waits import choose_thread_waits\nprint(choose_thread_waits(None))"
    )
    assert run(code) == "False"
    assert (
        run("from pdserve.runtime.thread_waits import choose_thread_waits\nprint(choose_thread_waits(None))") == "True"
    )
