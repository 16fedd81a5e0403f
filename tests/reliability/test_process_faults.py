"""Process faults on a real `pdserve serve` (loopback, real worker processes): SIGSTOP / SIGKILL of
decode and prefill workers, the supervisor restarting a dead worker, SIGTERM to the supervisor,
and a stuck engine loop. After each scenario every live worker's KV ledger balances and a canary
request is served."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from transformers import AutoTokenizer

from tests.conftest import hf_greedy, random_prompts
from tests.reliability.faults import stall_env
from tests.reliability.ledger import assert_canary_served, wait_ledger_balanced
from tests.reliability.procs import (
    busy_worker_pid,
    health_status,
    live_workers,
    metrics_text,
    resume,
    served,
    wait_until,
)

pytestmark = pytest.mark.slow

# a worker is dead after 2 s without a heartbeat (sent every 0.5 s); allow scheduling slack
DETECT_S = 3.0


class Stream:
    """A streaming completion read in a background thread: text pieces with arrival times."""

    def __init__(self, base: str, body: dict) -> None:
        self.pieces: list[tuple[float, str]] = []
        self.finish: str | None = None
        self.errors: list[dict] = []
        self.status: int | None = None
        self.exc: BaseException | None = None
        self.usage: dict | None = None
        self.started = time.monotonic()
        self.thread = threading.Thread(target=self._run, args=(base, body), daemon=True)
        self.thread.start()

    def _run(self, base: str, body: dict) -> None:
        try:
            with httpx.stream(
                "POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=httpx.Timeout(120, connect=5)
            ) as r:
                self.status = r.status_code
                if r.status_code != 200:
                    self.errors.append({"body": r.read().decode(errors="replace")})
                    return
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    obj = json.loads(line[6:])
                    if "error" in obj:
                        self.errors.append(obj["error"])
                        continue
                    if obj.get("usage"):
                        self.usage = obj["usage"]
                    for ch in obj["choices"]:
                        self.pieces.append((time.monotonic(), ch["text"]))
                        self.finish = ch["finish_reason"] or self.finish
        except BaseException as e:  # reported by join()
            self.exc = e

    @property
    def text(self) -> str:
        return "".join(p for _, p in self.pieces)

    def wait_pieces(self, n: int, timeout_s: float = 30) -> None:
        assert wait_until(lambda: len(self.pieces) >= n or not self.thread.is_alive(), timeout_s) is not None
        assert len(self.pieces) >= n, (self.status, self.errors, self.exc)

    def join(self, timeout_s: float = 120) -> "Stream":
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "stream did not finish"
        assert self.exc is None, repr(self.exc)
        assert self.status == 200 and not self.errors, (self.status, self.errors)
        return self


def group_members(pgid: int) -> list[str]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
                out.append(f"{pid} {fields[0]}: {cmd[:120]}")
        except (OSError, IndexError, ValueError):
            pass
    return out


def group_alive(pgid: int) -> bool:
    return bool(group_members(pgid))


def greedy(n: int, prompt: list[int]) -> dict:
    return {"prompt": prompt, "max_tokens": n, "min_tokens": n, "temperature": 0}


def hf_text(tok, model, prompt: list[int], n: int) -> str:
    return tok.decode(hf_greedy(str(model), tuple(prompt), n, n), skip_special_tokens=True)


def check_after(base: str, ledger_timeout_s: float = 5.0) -> None:
    wait_ledger_balanced(base, timeout_s=ledger_timeout_s)
    assert_canary_served(base)


def check_killed_decode_worker_migrates_exactly(model, prompt: list[int], n: int, *serve_args: str) -> None:
    """`serve` with two decode workers: the one running a greedy stream of `n` tokens is SIGKILLed
    after its first tokens; the stream migrates (prompt and output prefilled again on the other)
    and its text equals HF's, no token lost or doubled; the killed worker comes back."""
    tok = AutoTokenizer.from_pretrained(model)
    want = hf_text(tok, model, prompt, n)
    with served(model, "--decode-workers", "2", *serve_args) as s:
        assert wait_until(lambda: len(live_workers(s.base, "decode")) == 2, 90) is not None
        stream = Stream(s.base, {**greedy(n, prompt), "logprobs": 1})  # one event per token
        stream.wait_pieces(2)
        killed = busy_worker_pid(s.base, "decode")
        assert killed is not None, "no decode worker reports the running request"
        os.kill(killed, signal.SIGKILL)
        assert stream.finish is None, "not caught mid-stream"
        stream.join()
        assert stream.finish == "length" and stream.text == want  # migrated: nothing lost or doubled
        assert len(stream.pieces) == n
        assert wait_until(lambda: len(live_workers(s.base, "decode")) == 2, 90) is not None  # restarted
        check_after(s.base)


@pytest.fixture(scope="module")
def bench_model(tmp_path_factory):
    """The ~30M model: slow enough on CPU to catch a request in a given phase."""
    from pdserve.modelgen.make_model import make_model

    return make_model(tmp_path_factory.mktemp("bench") / "bench", preset="bench", quiet=True)


# --- 1. SIGSTOP of a decode worker mid-stream -------------------------------------------------
def test_sigstop_decode_mid_stream_migrates_and_sigcont_is_harmless(bench_model):
    # seconds of decoding (~4-7 ms a step): the tiny model decodes 1000 tokens in ~0.3 s on a
    # fast core, often before a heartbeat could report the request running
    n = 600
    tok = AutoTokenizer.from_pretrained(bench_model)
    prompt = random_prompts(tok.vocab_size, [9], seed=21)[0]
    want = hf_text(tok, bench_model, prompt, n)
    later = random_prompts(tok.vocab_size, [7, 8, 10, 11], seed=22)
    later_want = [hf_text(tok, bench_model, p, 24) for p in later]
    with served(bench_model, "--decode-workers", "2", "--max-model-len", "1024") as s:
        assert wait_until(lambda: len(live_workers(s.base, "decode")) == 2, 60) is not None  # both joined
        stopped = None
        try:
            # logprobs: one SSE event per token (the tiny model's text comes out in few pieces)
            stream = Stream(s.base, {**greedy(n, prompt), "logprobs": 1})
            # tokens reach the client before the stop: a heartbeat can report the request on a
            # decode worker before its first token has crossed the gateway (CI saw none)
            stream.wait_pieces(2)
            stopped = busy_worker_pid(s.base, "decode")
            assert stopped is not None, "no decode worker reports a running request"
            os.kill(stopped, signal.SIGSTOP)
            assert stream.pieces and stream.finish is None, "not caught mid-stream"
            detected = wait_until(lambda: stopped not in live_workers(s.base, "decode").values(), 10)
            assert detected is not None and detected <= DETECT_S, f"stopped worker still live after {detected}s"
            stream.join()
            assert stream.finish == "length"
            assert stream.text == want  # migrated: no duplicate or missing token
            assert health_status(s.base) == 200  # the other decode worker serves

            assert len(stream.pieces) == n  # one event per token, none duplicated
            os.kill(stopped, signal.SIGCONT)
            # its request was aborted while it slept (the Abort waits in its inbox); it runs on,
            # heartbeats back into the pool, and must not disturb any other request
            back = wait_until(lambda: stopped in live_workers(s.base, "decode").values(), 5)
            assert back is not None, "the resumed worker did not heartbeat again"

        finally:
            if stopped is not None:
                resume(stopped)
        wait_ledger_balanced(s.base)
        # requests on both workers (the resumed one included) are exact
        streams = [Stream(s.base, greedy(24, p)) for p in later]
        assert [st.join().text for st in streams] == later_want
        check_after(s.base)


# --- 2. SIGSTOP of the only decode worker -----------------------------------------------------
def test_sigstop_only_decode_worker_turns_health_503_until_sigcont(tiny_llama):
    with served(tiny_llama) as s:
        (pid,) = live_workers(s.base, "decode").values()
        try:
            os.kill(pid, signal.SIGSTOP)
            took = wait_until(lambda: health_status(s.base) == 503, 10)
            assert took is not None and took <= DETECT_S, f"/health not 503 after {took}s"
            body = httpx.get(f"{s.base}/health").json()
            assert body["live_workers"]["decode"] == 0
            r = httpx.post(f"{s.base}/v1/completions", json=greedy(3, [5, 6, 7]), timeout=10)
            assert r.status_code == 503 and "Retry-After" in r.headers
            assert r.json()["error"]["type"] == "server_error"
            os.kill(pid, signal.SIGCONT)
            took = wait_until(lambda: health_status(s.base) == 200, 10)
            assert took is not None and took <= DETECT_S, "/health not 200 again after SIGCONT"
        finally:
            resume(pid)
        check_after(s.base)


# --- 4. the supervisor restarts a dead worker -------------------------------------------------
def test_supervisor_restarts_a_killed_decode_worker(tiny_llama):
    with served(tiny_llama) as s:
        ((old_node, old_pid),) = live_workers(s.base, "decode").items()
        os.kill(old_pid, signal.SIGKILL)
        # the gateway drops it: dead after 2 s of silence (/health 503), or replaced first when
        # its restart registers sooner (a tiny model loads in ~1 s on a fast core)
        assert wait_until(lambda: old_node not in live_workers(s.base, "decode"), 10) is not None
        took = wait_until(
            lambda: health_status(s.base) == 200 and any(p != old_pid for p in live_workers(s.base, "decode").values()),
            60,
            step_s=0.2,
        )
        assert took is not None, "no new decode worker registered"
        ((new_node, new_pid),) = live_workers(s.base, "decode").items()
        assert new_pid != old_pid and new_node != old_node
        assert old_node not in metrics_text(s.base)  # the gateway forgot the replaced worker
        with open(f"/proc/{new_pid}/stat") as f:  # a child of the supervisor
            assert int(f.read().rsplit(")", 1)[1].split()[1]) == s.proc.pid
        check_after(s.base)


# --- 5. SIGTERM to `pdserve serve` ----------------------------------------------------------
def test_sigterm_drains_in_flight_stream_refuses_new_and_exits_0(bench_model):
    """The ~30M model makes 150 tokens take seconds, so the stream is still running at SIGTERM."""
    n = 150
    with served(bench_model) as s:
        check_after(s.base)
        stream = Stream(s.base, {**greedy(n, [5, 6, 7, 8, 9, 10, 11, 12]), "stream_options": {"include_usage": True}})
        stream.wait_pieces(3)
        s.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()

        def refused() -> bool:
            """True when a new request is turned away: connection refused (listener closed) or
            503 with the OpenAI envelope; False when it was served."""
            try:
                r = httpx.post(f"{s.base}/v1/completions", json=greedy(3, [5, 6, 7]), timeout=5)
            except httpx.TransportError:
                return True
            if r.status_code == 200:
                return False
            assert r.status_code == 503, r.text
            assert r.json()["error"]["type"] == "server_error"
            return True

        # a request racing the signal may still be served; once one is refused, all are
        took = wait_until(refused, 3)
        assert took is not None and took < 1.0, f"new requests still served {took}s after SIGTERM"
        assert stream.thread.is_alive(), "the stream ended before the test could check anything"
        stream.join(60)
        assert stream.finish == "length"
        assert stream.usage is not None and stream.usage["completion_tokens"] == n  # drained, all tokens
        assert all(refused() for _ in range(3))  # still nothing new accepted
        code = s.proc.wait(timeout=40)
        assert code == 0
        assert time.monotonic() - sent < 40
        assert wait_until(lambda: not group_alive(s.proc.pid), 5) is not None, (
            f"left running: {group_members(s.proc.pid)}"
        )  # every worker stopped too


# --- 6. a stuck engine loop ---------------------------------------------------------------------
def test_stuck_engine_loop_turns_health_503_then_recovers(tiny_llama):
    """Heartbeats come from a thread of their own (a long step must not look like death), so the
    heartbeat carries the age of the step in progress and the gateway counts a worker with work
    pending and no finished step past its stuck-loop limit as dead: /health turns 503.
    The test-only hook (tests/reliability/faults.py stall_env("decode", 8)) makes each decode worker's first busy
    step sleep 8 s (its process keeps running); `--stuck-after 3` lowers the gateway's
    stuck-loop limit from 30 s."""
    env = stall_env("decode", 8)
    with served(tiny_llama, "--stuck-after", "3", env=env) as s:
        (pid,) = live_workers(s.base, "decode").values()
        result: dict = {}

        def request() -> None:
            result["r"] = httpx.post(f"{s.base}/v1/completions", json=greedy(8, [5, 6, 7]), timeout=60)

        t = threading.Thread(target=request, daemon=True)
        t.start()
        took = wait_until(lambda: health_status(s.base) == 503, 10)
        # stuck after 3 s, seen at the next heartbeat (0.5 s), plus scheduling slack
        assert took is not None and took <= 4.0, f"/health not 503 after {took}s"
        assert live_workers(s.base, "decode") == {}
        with open(f"/proc/{pid}/stat") as f:  # not stopped: stuck in its loop
            assert f.read().rsplit(")", 1)[1].split()[0] in ("S", "R")
        assert wait_until(lambda: health_status(s.base) == 200, 12) is not None  # the step ended
        t.join(30)
        assert not t.is_alive(), "the request caught by the stall never ended"
        assert result["r"].status_code in (200, 500), result["r"].text
        assert list(live_workers(s.base, "decode").values()) == [pid]  # the same process, back
        check_after(s.base)


# --- 3. a prefill worker lost before the first token (last: its server is module-scoped) ---------
LONG_PROMPT_TOKENS = 1000
PREFILL_OUT = 6


@pytest.fixture(scope="module")
def slow_prefill_server(real_llama):
    """Two prefill workers on the real-shaped model (30 layers) with a 16-token step budget: a
    1000-token prompt takes ~60 steps (seconds) on one prefill worker, which keeps heartbeating
    between steps. (The ~30M bench model at 32 tokens a step prefilled it in ~0.25 s on a fast
    core, before any heartbeat reported it.)"""
    with served(
        real_llama,
        "--prefill-workers",
        "2",
        "--max-num-batched-tokens",
        "16",
        "--max-model-len",
        "1100",
        "--num-blocks",
        "160",
    ) as s:
        yield s


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["sigkill", "sigstop"])
def test_prefill_worker_lost_before_first_token_is_retried(real_llama, slow_prefill_server, sig):
    s = slow_prefill_server
    tok = AutoTokenizer.from_pretrained(real_llama)
    prompt = random_prompts(tok.vocab_size, [LONG_PROMPT_TOKENS], seed=30 + sig)[0]
    want = hf_text(tok, real_llama, prompt, PREFILL_OUT)
    assert wait_until(lambda: len(live_workers(s.base, "prefill")) == 2, 60) is not None
    victim = None
    try:
        stream = Stream(s.base, greedy(PREFILL_OUT, prompt))
        victim = busy_worker_pid(s.base, "prefill", wait_s=10)
        assert victim is not None, "no prefill worker reports the request"
        os.kill(victim, sig)
        hit_at = time.monotonic()
        stream.join()
        assert stream.pieces and stream.pieces[0][0] > hit_at, "the first token came before the fault"
        assert stream.finish == "length"
        assert stream.text == want  # retried on the other prefill worker, exact
        if sig == signal.SIGSTOP:
            os.kill(victim, signal.SIGCONT)
    finally:
        if victim is not None:
            resume(victim)
    # SIGKILL: `pdserve serve` restarts it; SIGSTOP: it comes back after SIGCONT
    assert wait_until(lambda: len(live_workers(s.base, "prefill")) == 2, 60) is not None
    check_after(s.base)


# --- 7. a decode worker killed while it holds a conversation's cached KV ----------------------
@pytest.mark.parametrize("local_limit", ["128", "0"])  # the turn prefilled on D itself, or by P
def test_decode_worker_killed_holding_a_conversation_migrates_exactly(bench_model, local_limit):
    """Turn 1 leaves its KV cached on one decode worker; turn 2 goes back to it (KV-aware
    routing: pinned prefix, or prefilled there) and that worker is SIGKILLed mid-stream. The
    turn migrates to the other decode worker and its text equals HF greedy; the supervisor
    restarts the dead one; every live ledger balances."""
    n = 800  # seconds of decoding: time to see the counters before the kill
    tok = AutoTokenizer.from_pretrained(bench_model)
    first = random_prompts(tok.vocab_size, [150], seed=31)[0]
    answer = hf_greedy(str(bench_model), tuple(first), 16, 16)
    second = first + answer + random_prompts(tok.vocab_size, [20], seed=32)[0]
    want = hf_text(tok, bench_model, second, n)
    extra = ("--decode-workers", "2", "--max-model-len", "1024", "--local-prefill-max-tokens", local_limit)
    with served(bench_model, *extra) as s:
        assert wait_until(lambda: len(live_workers(s.base, "decode")) == 2, 60) is not None
        r = httpx.post(f"{s.base}/v1/completions", json=greedy(16, first), timeout=60)
        assert r.json()["choices"][0]["text"] == tok.decode(answer, skip_special_tokens=True)
        time.sleep(1.5)  # heartbeats: the gateway learns which decode worker holds turn 1
        killed = None
        stream = Stream(s.base, {**greedy(n, second), "logprobs": 1})
        stream.wait_pieces(2)
        # it went back to the worker holding turn 1: prefilled there, or its 10 blocks pinned
        counter = "pdserve_local_prefills_total" if local_limit != "0" else "pdserve_kv_transfer_blocks_skipped_total"
        want_count = 1 if local_limit != "0" else 10
        assert wait_until(lambda: metric_sum(s.base, counter) >= want_count, 2, step_s=0.1) is not None
        killed = busy_worker_pid(s.base, "decode")
        assert killed is not None, "no decode worker reports the running turn"
        os.kill(killed, signal.SIGKILL)
        assert stream.finish is None, "not caught mid-stream"
        stream.join()
        assert stream.finish == "length" and stream.text == want  # migrated: nothing lost or doubled
        assert len(stream.pieces) == n
        took = wait_until(lambda: killed not in live_workers(s.base, "decode").values(), 10)
        assert took is not None
        assert wait_until(lambda: len(live_workers(s.base, "decode")) == 2, 60) is not None  # restarted
        check_after(s.base)


def metric_sum(base: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in metrics_text(base).splitlines() if line.startswith(name))
