"""Gateway, prefill and two decode workers on separate "hosts" (network namespaces joined by
veth links through a bridge, each with its own address): workers join by the gateway's URL, KV
crosses over TCP, and greedy output equals HF. The worker and KV planes are CURVE-encrypted (the
default over TCP, protocol/plane_encryption.py): a capture on the bridge while they serve holds
their bytes, and no prompt, message field name or KV header in clear. Then faults on the links:
a decode host's link down mid-stream (its streams move to the other decode host, exactly), the
prefill host's link down (a clear 503, nothing hangs; served again once it is back), and slow,
lossy links from every worker host (netem delay and loss where the kernel has sch_netem, else an
HTB rate cap and u32-selected drops: `netns.Lan.impair`). Afterwards every decode worker's KV
ledger balances. Skipped where network namespaces cannot be made (not root, no iproute2)."""

from __future__ import annotations

import concurrent.futures as cf
import sys
import time

import httpx
import msgspec
import pytest
from transformers import AutoTokenizer

from tests.conftest import hf_greedy, random_prompts
from tests.e2e.roles import processes, stream_text, wait_for, workers
from tests.reliability import link_capture, netns
from tests.reliability.faults import slow_env

pytestmark = pytest.mark.slow

_why_not = netns.available()
if _why_not:
    pytestmark = [pytest.mark.slow, pytest.mark.skip(reason=_why_not)]

MAX_NEW = 60
HOSTS = ["gw", "p", "d1", "d2"]


def _stream(base: str, prompt: list[int]) -> str:
    return stream_text(base, prompt, MAX_NEW)


def _worker(base: str, pid: int) -> dict:
    (w,) = [w for w in workers(base) if w["pid"] == pid]
    return w


def _settled(base: str) -> bool:
    decodes = [w for w in workers(base) if w["role"] == "decode"]
    return len(decodes) == 2 and all(
        w["state"] == "ready" and w["kv"]["blocks_used"] == 0 and w["load"]["leases_active"] == 0 for w in decodes
    )


def test_pools_on_separate_hosts_over_real_links(tiny_llama, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompts = random_prompts(tok.vocab_size, [11, 27, 19, 33], seed=23)
    want = [tok.decode(hf_greedy(str(tiny_llama), tuple(p), MAX_NEW), skip_special_tokens=True) for p in prompts]
    model = str(tiny_llama)
    common = ["--model", model, "--dtype", "float32", "--num-blocks", "256", "--max-model-len", "512"]
    with netns.lan(HOSTS) as net, processes(tmp_path) as procs:
        gw = net.hosts["gw"]
        base = f"http://{gw}:8000"

        def on(host: str, name: str, *args: str, env: dict[str, str] | None = None):
            return procs.start(name, net.exec_argv(host, [*procs_python(), *args]), env)

        captured = tmp_path / "link.bin"  # the worker and KV planes' bytes on the bridge (not HTTP)
        capture = procs.start(
            "capture",
            ["ip", "netns", "exec", net.lan_ns, sys.executable, link_capture.__file__, "any", str(captured)]
            + ["--skip-port", "8000"],
        )
        wait_for(lambda: "capturing" in procs.log("capture"), 30, "the link capture", procs)

        on(  # prompts through the prefill pool, so their KV crosses the link
            "gw",
            "gateway",
            "gateway",
            "--model",
            model,
            "--host",
            gw,
            "--worker-bind",
            f"tcp://{gw}:7100",
            "--prefill-placement",
            "remote",
        )
        p = on(
            "p",
            "prefill",
            "prefill",
            *common,
            "--gateway",
            base,
            "--bind",
            f"tcp://{net.hosts['p']}:7200",
            "--advertise-host",
            "host-p",
        )
        slow = slow_env("decode", 0.03)  # streams last ~2 s: long enough to cut a link under one
        d1, d2 = (
            on(
                h,
                f"decode-{h}",
                "decode",
                *common,
                "--gateway",
                base,
                "--bind",
                f"tcp://{net.hosts[h]}:7200",
                "--kv-bind",
                f"tcp://{net.hosts[h]}:7300",
                "--advertise-host",
                f"host-{h}",
                env=slow,
            )
            for h in ("d1", "d2")
        )
        wait_for(
            lambda: len(workers(base)) == 3 and all(w["state"] == "ready" for w in workers(base)),
            180,
            "3 workers joined over the links",
            procs,
        )
        assert {w["control_addr"].split("//")[1].split(":")[0] for w in workers(base)} == {
            net.hosts["p"],
            net.hosts["d1"],
            net.hosts["d2"],
        }

        with cf.ThreadPoolExecutor(4) as pool:
            # 1. over the links: exact, KV over TCP
            assert list(pool.map(lambda q: _stream(base, q), prompts)) == want
            metrics = httpx.get(f"{base}/metrics").text
            (kv_bytes,) = [ln for ln in metrics.splitlines() if ln.startswith("pdserve_kv_transfer_bytes_total")]
            assert float(kv_bytes.split()[-1]) > 0
            assert all(w["kv"]["blocks_total"] > 0 for w in workers(base) if w["role"] == "decode")
            capture.terminate()
            capture.wait(timeout=10)
            on_the_wire = captured.read_bytes()
            assert len(on_the_wire) > float(kv_bytes.split()[-1])  # the capture saw the KV go by ...
            in_clear = [m for m in (b"prompt_token_ids", b"request_id", b"lease_epoch") if m in on_the_wire]
            in_clear += [q for q in prompts if msgspec.msgpack.encode(q) in on_the_wire]
            assert not in_clear  # ... and nothing of what it carried

            # 2. a decode host's link goes down mid-stream: its streams continue on the other one
            runs = [pool.submit(_stream, base, q) for q in prompts]
            wait_for(lambda: _worker(base, d1.pid)["load"]["routed_requests"] > 0, 30, "a stream on d1")
            time.sleep(0.3)
            net.set_link("d1", up=False)
            assert [r.result(timeout=90) for r in runs] == want
            assert "lost worker" in procs.log("gateway")
            net.set_link("d1", up=True)  # back: it heartbeats again, gets the gateway's aborts
            wait_for(lambda: _settled(base), 60, "both decode workers idle with every block back")

            # 3. the prefill host's link goes down: a clear 503, no hang; served once it is back
            net.set_link("p", up=False)
            wait_for(lambda: _worker(base, p.pid)["state"] == "unresponsive", 10, "prefill seen gone")
            started = time.monotonic()
            r = httpx.post(
                f"{base}/v1/completions",
                json={"model": "tiny-llama", "prompt": prompts[0], "max_tokens": 4},
                timeout=60,
            )
            assert r.status_code == 503 and "prefill" in r.json()["error"]["message"]
            assert time.monotonic() - started < 10
            net.set_link("p", up=True)
            wait_for(lambda: _worker(base, p.pid)["state"] == "ready", 30, "prefill back")
            assert _stream(base, prompts[1]) == want[1]

            # 4. slow, lossy links from every worker host (netem where the kernel has it)
            how = {h: net.impair(h) for h in ("p", "d1", "d2")}
            assert list(pool.map(lambda q: _stream(base, q), prompts)) == want, how
            assert sum(net.dropped(h) for h in ("p", "d1", "d2")) > 0, how  # the loss was real
        wait_for(lambda: _settled(base), 60, "every decode block back at the end")
        assert all(proc.poll() is None for proc in (p, d1, d2))  # nobody died of it


def procs_python() -> list[str]:
    return [sys.executable, "-m", "pdserve.cli"]
