"""Joining a cluster by the gateway's public URL: `pdserve prefill --gateway http://HOST:PORT`.

The worker POSTs `/cluster/join` with a claim (role, host, time) signed under the cluster
secret (FrameAuth, as every internal frame); the gateway checks the signature and the clock
(a claim older than MAX_CLAIM_AGE_S is refused) and answers the address of its worker plane
(its ZeroMQ inbox), which the worker then registers with as usual. A worker without the secret
gets 403 and the gateway logs who was refused and why. The answer is not secret (the worker
plane authenticates every frame anyway): the check is there so a misconfigured worker fails at
once, loudly, instead of registering into silence.

The worker-plane address: the gateway's `--worker-advertise` if set, else its bound address, with
a wildcard host replaced by the host name the worker reached the HTTP endpoint with.
"""

from __future__ import annotations

import time
from urllib.parse import urlsplit

import msgspec

from pdserve.protocol.auth import AuthError, FrameAuth
from pdserve.protocol.channel import is_wildcard_host

JOIN_PATH = "/cluster/join"
MAX_CLAIM_AGE_S = 120.0


class JoinClaim(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: str
    host: str
    time: float  # unix seconds when the worker signed it


class JoinRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    claim: str  # the JSON-encoded JoinClaim, exactly as signed
    mac: str  # hex HMAC-SHA256 under the cluster secret


class JoinAnswer(msgspec.Struct, frozen=True):
    gateway_id: str
    worker_addr: str  # where to register: tcp://HOST:PORT


class JoinRefused(Exception):
    pass


def sign_join(auth: FrameAuth, role: str, host: str, now: float | None = None) -> JoinRequest:
    claim = msgspec.json.encode(JoinClaim(role, host, time.time() if now is None else now))
    mac = auth.sign(claim)[0]
    return JoinRequest(claim=claim.decode(), mac=mac.hex())


def check_join(auth: FrameAuth, body: bytes, now: float | None = None) -> JoinClaim:
    """The claim a valid request carries; JoinRefused saying why otherwise."""
    try:
        req = msgspec.json.decode(body, type=JoinRequest)
        auth.verify([bytes.fromhex(req.mac), req.claim.encode()])
        claim = msgspec.json.decode(req.claim, type=JoinClaim)
    except (msgspec.DecodeError, ValueError):
        raise JoinRefused("malformed join request") from None
    except AuthError:
        raise JoinRefused("bad signature: the worker does not hold this cluster's secret") from None
    age = (time.time() if now is None else now) - claim.time
    if abs(age) > MAX_CLAIM_AGE_S:
        raise JoinRefused(f"claim signed {age:.0f} s from now: clocks apart or a replay")
    return claim


def worker_plane_addr(bound: str, advertise: str | None, url_host: str) -> str:
    """The worker-plane address to hand a worker that reached us as `url_host`."""
    if advertise:
        return advertise
    parts = urlsplit(bound)
    if parts.scheme == "tcp" and is_wildcard_host(parts.hostname):  # (`--allow-wildcard-bind` only)
        host = f"[{url_host}]" if ":" in url_host else url_host
        return f"tcp://{host}:{parts.port}"
    return bound
