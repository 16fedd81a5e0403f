"""Test-only fault injection, loaded by Python at start-up in the processes of a test's server
(tests/reliability/faults.py `stall_env` puts this folder on PYTHONPATH); production code has
no hook for it. PDSERVE_TEST_STALL_STEP_S="<role>:<seconds>" makes the first engine step of each
worker of that role sleep that long, once per process: a stuck engine loop. (A prefill worker
stalls in the first layer one of its lanes runs.) Heartbeats go on from their own thread and
carry the step's growing age. PDSERVE_TEST_SLOW_STEP_S="<role>:<seconds>" makes every engine
step of that role that much longer: a slow worker (streams that last long enough to interrupt).
PDSERVE_TEST_DROP_REQUEST="<role>:<n>" (decode or colocated) makes each worker of that role
forget the n-th request it emits tokens for, right after its first output, without a word to
the gateway: the engine aborts it (its blocks go back) and its record goes, as a lost request
would (gateway/reconcile.py must notice)."""

import os
import sys
import time


def _install(role: str, seconds: float, every_step: bool = False) -> None:
    if role == "prefill":
        from pdserve.engine.model_runner import ModelRunner as owner

        name = "run_layers"
    else:  # decode, colocated: their loop's engine step
        from pdserve.engine.llm_engine import LLMEngine as owner

        name = "execute"
    original = getattr(owner, name)
    stalled = []

    def stalling(self, *args, **kwargs):
        if every_step:
            time.sleep(seconds)
        elif not stalled:
            stalled.append(True)
            print(f"test fault: stalling this {role} worker's engine for {seconds:g} s", file=sys.stderr, flush=True)
            time.sleep(seconds)
        return original(self, *args, **kwargs)

    setattr(owner, name, stalling)


def _install_drop(role: str, nth: int) -> None:
    if role == "decode":
        from pdserve.decode_node.worker import DecodeWorker as owner

        name = "_emit_step"
    else:
        from pdserve.decode_node.colocated import ColocatedWorker as owner

        name = "_emit"
    original = getattr(owner, name)
    seen: list[str] = []

    def dropping(self, out, *args, **kwargs):
        original(self, out, *args, **kwargs)
        rid = out.request_id
        if rid in seen or out.finish_reason is not None or rid not in self.requests:
            return
        seen.append(rid)
        if len(seen) == nth:
            print(f"test fault: this {role} worker drops request {rid} silently", file=sys.stderr, flush=True)
            self.engine.abort(rid)
            self.requests.pop(rid, None)

    setattr(owner, name, dropping)


_drop_role, _, _drop_nth = os.environ.get("PDSERVE_TEST_DROP_REQUEST", "").partition(":")
if _drop_role and len(sys.argv) > 1 and sys.argv[1] == _drop_role:
    _install_drop(_drop_role, int(_drop_nth))

for _var, _every in (("PDSERVE_TEST_STALL_STEP_S", False), ("PDSERVE_TEST_SLOW_STEP_S", True)):
    _spec = os.environ.get(_var, "")
    _role, _, _seconds = _spec.partition(":")
    if _spec and len(sys.argv) > 1 and sys.argv[1] == _role:  # `python -m pdserve.cli <role> ...`
        _install(_role, float(_seconds), _every)
