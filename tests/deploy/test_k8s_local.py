"""The manifests' own commands, run as local processes the way a kubelet would run the pods:
each "pod" gets an address of its own on loopback (127.0.0.N), $(POD_IP) and the Secret are
filled in, Service names resolve to the pod behind them, /models is the test's model folder.
Pods become ready by their probes; traffic runs while the prefill and decode pools are scaled
up (new pods join by the gateway's URL) and down (SIGTERM: the pod drains and leaves); every
request is served."""

from __future__ import annotations

import signal
import socket
import threading
import urllib.error
import urllib.request

import httpx
import pytest

from tests.deploy.manifests import by_kind, pod_command
from tests.e2e.roles import processes, wait_for, workers

pytestmark = pytest.mark.slow

GATEWAY_IP = "127.0.0.2"
PORTS = (8000, 7100, 7200, 7300, 8080)


def _free(ip: str) -> bool:
    for port in PORTS:
        with socket.socket() as s:
            try:
                s.bind((ip, port))
            except OSError:
                return False
    return True


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_manifest_pods_start_become_ready_and_scale_under_traffic(tiny_llama, tmp_path):
    pod_ips = [GATEWAY_IP, *(f"127.0.0.{n}" for n in range(10, 14))]
    if not all(_free(ip) for ip in pod_ips):
        pytest.skip("the manifests' ports are taken on a loopback address this test uses")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "model").symlink_to(tiny_llama)
    deployments = by_kind("Deployment")
    services = {name: GATEWAY_IP for name in by_kind("Service")}  # every Service fronts the gateway
    with processes(tmp_path) as procs:
        cluster_secret = procs.env["PDSERVE_CLUSTER_SECRET"]
        pods: dict[str, tuple[str, object]] = {}  # pod name -> (ip, PodCommand)
        free_ips = iter(pod_ips[1:])

        def start(deployment: str, name: str, ip: str | None = None):
            ip = ip or next(free_ips)
            cmd = pod_command(
                deployments[deployment],
                ip,
                services,
                {"pdserve-cluster/secret": cluster_secret},
                {"models": tmp_path / "models"},
            )
            pods[name] = (ip, cmd)
            return procs.start(name, cmd.argv, cmd.env)

        def ready(name: str) -> bool:
            return _status(pods[name][1].probes["readinessProbe"]) == 200

        start("pdserve-gateway", "gateway", GATEWAY_IP)
        start("pdserve-prefill", "prefill-0")
        decode0 = start("pdserve-decode", "decode-0")
        for name in ("gateway", "prefill-0", "decode-0"):
            wait_for(lambda name=name: ready(name), 180, f"{name} ready by its readiness probe", procs)
            assert _status(pods[name][1].probes["livenessProbe"]) == 200
        base = f"http://{GATEWAY_IP}:8000"  # the `pdserve` Service

        served, failed = [0], []
        stop = threading.Event()

        def traffic(seed: int) -> None:
            i = 0
            while not stop.is_set():
                i += 1
                body = {"model": "model", "prompt": f"request {seed}-{i}", "max_tokens": 12, "temperature": 0}
                try:
                    r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
                    if r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length":
                        served[0] += 1
                    else:
                        failed.append(r.text)
                except httpx.HTTPError as e:
                    failed.append(repr(e))

        threads = [threading.Thread(target=traffic, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        try:
            # scale up both pools: the new pods join by the gateway's URL and take requests
            start("pdserve-prefill", "prefill-1")
            start("pdserve-decode", "decode-1")
            for name in ("prefill-1", "decode-1"):
                wait_for(lambda name=name: ready(name), 180, f"{name} ready", procs)
            pid_of = {name: procs.procs[name].pid for name in ("prefill-1", "decode-1")}

            def stepped(name: str) -> bool:
                (w,) = [w for w in workers(base) if w["pid"] == pid_of[name]]
                return w["load"]["steps"] > 0

            wait_for(lambda: stepped("prefill-1") and stepped("decode-1"), 60, "the new pods serving")

            # scale down: the oldest pods get SIGTERM (as after their preStop), drain and leave
            before = served[0]
            prefill0 = procs.procs["prefill-0"]
            for proc in (prefill0, decode0):
                proc.send_signal(signal.SIGTERM)
            assert prefill0.wait(timeout=60) == 0 and decode0.wait(timeout=60) == 0
            wait_for(lambda: len(workers(base)) == 2, 10, "the drained pods gone from /v1/workers")
            wait_for(lambda: served[0] >= before + 10, 60, "requests served after the scale-down")
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=90)
        assert not failed, failed[:3]
        assert served[0] > 20
        assert {w["pid"] for w in workers(base)} == set(pid_of.values())
        assert "drained; leaving" in procs.log("decode-0") and "drained; leaving" in procs.log("prefill-0")
