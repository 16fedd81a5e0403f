"""Encryption of the worker and KV planes (ZeroMQ's CURVE: Curve25519 key exchange, then every
frame encrypted and authenticated with XSalsa20-Poly1305, built into libzmq).

Which sockets encrypt is one cluster-wide setting, `PDSERVE_PLANE_ENCRYPTION` (pdserve/env.py),
because both ends of a connection must agree:

    auto (default)  tcp:// sockets encrypt; ipc:// and inproc:// (same host) do not
    on              tcp:// and ipc:// sockets encrypt
    off             none (frames are still authenticated: protocol/auth.py)

Under `auto` a tcp:// socket on loopback encrypts too: a bound socket cannot know where its
peers connect from, and each end must decide from the address alone. `pdserve serve` on one
host uses ipc:// (and shared memory for KV), so it pays nothing.

Keys come from the cluster secret, so nothing new is distributed: every process derives the
same server key pair and the same client key pair. Without the secret a peer cannot compute the
server's public key, so it cannot complete the handshake, and it never sees a frame in clear.
The frame MACs (FrameAuth) still authenticate each message inside the encrypted stream.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import zmq
from zmq.utils import z85

MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class CurveKeys:
    server_public: bytes  # Z85, 40 bytes each
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def _key_pair(secret: bytes, role: bytes) -> tuple[bytes, bytes]:
    """(public, secret) Z85 Curve25519 keys derived from the cluster secret for `role`."""
    private = hashlib.blake2b(secret, digest_size=32, person=b"pdserve-curve", salt=role.ljust(16, b"\0")).digest()
    private_z85 = z85.encode(private)
    return zmq.curve_public(private_z85), private_z85


@functools.lru_cache(maxsize=8)
def curve_keys(cluster_secret: bytes) -> CurveKeys:
    server_public, server_secret = _key_pair(cluster_secret, b"server")
    client_public, client_secret = _key_pair(cluster_secret, b"client")
    return CurveKeys(server_public, server_secret, client_public, client_secret)


def encrypts(mode: str, addr: str) -> bool:
    """Whether a socket bound or connected to `addr` encrypts under `mode`."""
    if mode not in MODES:
        raise ValueError(f"plane encryption must be one of {MODES}, got {mode!r}")
    scheme = addr.partition("://")[0]
    if mode == "off":
        return False
    return scheme == "tcp" or (mode == "on" and scheme == "ipc")


def available() -> bool:
    """Whether this libzmq was built with CURVE (pyzmq's wheels are)."""
    return bool(zmq.has("curve"))


def _require_curve() -> None:
    if not available():
        raise RuntimeError(
            "this libzmq has no CURVE support: install pyzmq's wheel, or set PDSERVE_PLANE_ENCRYPTION=off"
        )


def secure_bound(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make `sock` (before it binds) a CURVE server."""
    _require_curve()
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True


def secure_connected(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make `sock` (before it connects) a CURVE client of the cluster's servers."""
    _require_curve()
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret
