"""HTTPS on the gateway: `pdserve serve --ssl-certfile/--ssl-keyfile` serves the OpenAI API over
TLS (a streamed chat completion through the official client, the certificate verified), refuses
plain HTTP on that port, and a half-given or broken pair fails at start."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import sys
import time

import httpx
import pytest
from openai import OpenAI

from tests.e2e.cluster import free_port, stop_group

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def _self_signed(tmp_path) -> tuple[str, str]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost"]
        + ["-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    return str(cert), str(key)


def _serve(model, port: int, *tls: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "pdserve.cli", "serve", "--model", str(model), "--port", str(port)]
    argv += ["--colocated", "--dtype", "float32", "--num-blocks", "64", "--max-model-len", "256", *tls]
    return subprocess.Popen(argv, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_serve_speaks_https_with_the_given_certificate(tiny_llama, tmp_path):
    cert, key = _self_signed(tmp_path)
    port = free_port()
    proc = _serve(tiny_llama, port, "--ssl-certfile", cert, "--ssl-keyfile", key)
    base = f"https://127.0.0.1:{port}"
    try:
        with httpx.Client(verify=ssl.create_default_context(cafile=cert), timeout=5) as http:
            deadline = time.monotonic() + 180
            while True:
                assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
                try:
                    if http.get(f"{base}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "no healthy HTTPS gateway"
                time.sleep(0.25)
            client = OpenAI(base_url=f"{base}/v1", api_key="unused", http_client=http, max_retries=0)
            model = client.models.list().data[0].id
            stream = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True
            )
            chunks = list(stream)
            assert chunks[-1].choices[0].finish_reason == "length"
            assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 1
        with pytest.raises(httpx.TransportError):  # plain HTTP on the TLS port gets no HTTP answer
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        with pytest.raises(httpx.ConnectError):  # and a client that cannot verify the certificate stops
            httpx.get(f"{base}/health", timeout=5)
    finally:
        stop_group(proc)


def test_a_half_given_or_broken_pair_fails_at_start(tiny_llama, tmp_path):
    cert, _ = _self_signed(tmp_path)
    bad = tmp_path / "bad.pem"
    bad.write_text("not a key")
    for tls in (("--ssl-certfile", cert), ("--ssl-certfile", cert, "--ssl-keyfile", str(bad))):
        proc = _serve(tiny_llama, free_port(), *tls)
        try:
            out, _ = proc.communicate(timeout=60)
        finally:
            stop_group(proc)
        assert proc.returncode != 0 and b"--ssl-certfile" in out
