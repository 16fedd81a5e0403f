"""A worker's side of protocol/join.py: turn `--gateway http://HOST:PORT` into the gateway's
worker-plane address, waiting for a gateway that is not up yet (pods start in any order)."""

from __future__ import annotations

import logging
import time
import urllib.error
import urllib.request

import msgspec

from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.join import JOIN_PATH, JoinAnswer, sign_join

log = logging.getLogger(__name__)


class JoinError(RuntimeError):
    pass


def is_http_gateway(addr: str) -> bool:
    return addr.startswith(("http://", "https://"))


def join_gateway(url: str, auth: FrameAuth, role: str, host: str, wait_s: float = 300.0) -> str:
    """The worker-plane address of the gateway at `url`. Retries while it cannot be reached (up
    to `wait_s`); raises JoinError at once when it refuses us (403: wrong cluster secret)."""
    deadline = time.monotonic() + wait_s
    delay = 0.5
    while True:
        body = msgspec.json.encode(sign_join(auth, role, host))  # signed now: the clock check holds
        req = urllib.request.Request(
            url.rstrip("/") + JOIN_PATH, data=body, headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                answer = msgspec.json.decode(resp.read(), type=JoinAnswer)
            log.info("gateway %s at %s: worker plane %s", answer.gateway_id, url, answer.worker_addr)
            return answer.worker_addr
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            if e.code in (401, 403, 404):
                raise JoinError(f"gateway {url} refused to let this {role} worker join ({e.code}): {detail}") from None
            err = f"HTTP {e.code}: {detail}"
        except (urllib.error.URLError, OSError, msgspec.DecodeError) as e:
            err = str(e)
        if time.monotonic() + delay > deadline:
            raise JoinError(f"gateway {url} not reachable for {wait_s:.0f} s: {err}")
        log.info("gateway %s not ready (%s); retrying in %.1f s", url, err, delay)
        time.sleep(delay)
        delay = min(5.0, delay * 2)
