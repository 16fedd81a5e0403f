"""Cluster secret and HMAC frame authentication, checked before anything is decoded.

A ZMQ message is `[mac, header, *payloads]`, mac = HMAC-SHA256(secret, header || len(p0) || ...).
Payload *bytes* (KV tensors, MBs) are not hashed by default: hashing would cost about as much
as moving them. Their exact lengths are covered, and the header (request, lease epoch, layer,
block ids, shape) is. On networks you do not trust, `digest_payloads=True` MACs the bytes too.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import struct
from collections.abc import Sequence
from pathlib import Path

MAC_SIZE = 32
_ENV = "PDSERVE_CLUSTER_SECRET"
_ENV_FILE = "PDSERVE_CLUSTER_SECRET_FILE"


class AuthError(Exception):
    pass


def generate_cluster_secret() -> bytes:
    return secrets.token_bytes(32)


def load_cluster_secret() -> bytes:
    """From $PDSERVE_CLUSTER_SECRET (hex) or the file named by $PDSERVE_CLUSTER_SECRET_FILE."""
    text = os.environ.get(_ENV)
    if text is None and os.environ.get(_ENV_FILE):
        text = Path(os.environ[_ENV_FILE]).read_text().strip()
    if not text:
        raise RuntimeError(f"no cluster secret: set {_ENV} (hex) or {_ENV_FILE}; `pdserve serve` "
                           "makes one for its own workers")
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError:
        raise RuntimeError(f"{_ENV} must be hex") from None
    if len(secret) < 16:
        raise RuntimeError("cluster secret must be at least 16 bytes")
    return secret


class FrameAuth:
    def __init__(self, secret: bytes, digest_payloads: bool = False) -> None:
        if len(secret) < 16:
            raise ValueError("cluster secret must be at least 16 bytes")
        self._secret = secret
        self.digest_payloads = digest_payloads

    def _mac(self, header: bytes | memoryview, payloads: Sequence) -> bytes:
        h = hmac.new(self._secret, digestmod=hashlib.sha256)
        h.update(header)
        for p in payloads:
            h.update(struct.pack("<Q", memoryview(p).nbytes))
        if self.digest_payloads:
            for p in payloads:
                h.update(p)
        return h.digest()

    def sign(self, header: bytes, payloads: Sequence = ()) -> list:
        return [self._mac(header, payloads), header, *payloads]

    def verify(self, frames: Sequence) -> tuple[memoryview, list]:
        """frames as received -> (header, payloads); raises AuthError on any mismatch."""
        if len(frames) < 2:
            raise AuthError("message has no mac/header frames")
        mac, header, payloads = frames[0], frames[1], list(frames[2:])
        mac_bytes = bytes(_buffer(mac))
        if len(mac_bytes) != MAC_SIZE:
            raise AuthError("bad mac size")
        header_buf = _buffer(header)
        payload_bufs = [_buffer(p) for p in payloads]
        if not hmac.compare_digest(mac_bytes, self._mac(header_buf, payload_bufs)):
            raise AuthError("bad mac")
        return header_buf, payload_bufs


def _buffer(frame) -> memoryview:
    """zmq.Frame or bytes -> memoryview without copying."""
    return frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
