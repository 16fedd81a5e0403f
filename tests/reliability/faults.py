"""Environment for a test server whose workers of one role stall their first engine step, step
slowly, or drop a request silently (tests/reliability/stall_hook/sitecustomize.py does it;
production code has no hook)."""

from __future__ import annotations

import os
from pathlib import Path

HOOK_DIR = Path(__file__).resolve().parent / "stall_hook"


def stall_env(role: str, seconds: float) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(HOOK_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return {"PDSERVE_TEST_STALL_STEP_S": f"{role}:{seconds:g}", "PYTHONPATH": path}


def slow_env(role: str, seconds: float) -> dict[str, str]:
    """Every engine step of the workers of `role` takes `seconds` longer."""
    path = os.pathsep.join(p for p in (str(HOOK_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return {"PDSERVE_TEST_SLOW_STEP_S": f"{role}:{seconds:g}", "PYTHONPATH": path}


def drop_env(role: str, nth: int) -> dict[str, str]:
    """Each worker of `role` (decode, colocated) forgets its `nth` request after its first output,
    telling nobody (the engine aborts it: its blocks go back)."""
    path = os.pathsep.join(p for p in (str(HOOK_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return {"PDSERVE_TEST_DROP_REQUEST": f"{role}:{nth}", "PYTHONPATH": path}
