"""Cluster secret and HMAC frame authentication, checked before anything is decoded.

Wire form of every ZMQ message: `[mac, header, *payloads]` where

    mac = HMAC-SHA256(secret, prefix || header [|| payload bytes, if digest_payloads])
    prefix = mode (1 byte) || len(header) (u64) || number of payloads (u64) || len(p_i) (u64 each)

The prefix makes the MAC input unambiguous (frames cannot be split, merged, added or removed)
and binds the mode, so a receiver in one mode never accepts a message made in the other.

Trade-off of `digest_payloads`:
- False (default): payload *bytes* are not hashed. KV frames are megabytes and hashing them
  (~1.5 GB/s for HMAC-SHA256 on one core) would cost more than moving them. The header (request,
  lease epoch, layer, block ids, dtype, shape, nbytes) and every payload's exact length are
  authenticated, so a forger cannot inject, redirect or resize anything; someone who can modify
  packets in flight can still flip bits inside a payload. Right for loopback, IPC and trusted
  cluster networks.
- True: payload bytes are MACed too (same HMAC). Use on networks you do not trust; expect KV
  bandwidth to drop to roughly the hashing speed. Both ends must use the same mode.
The MAC authenticates, it does not encrypt: use a private network or a VPN/TLS tunnel for secrecy.

KV payload MAC (`payload_mac` / `check_payload_mac`): the middle ground for KV frames over tcp://.
The sender MACs the payload bytes with a key derived from the cluster secret
(HMAC-SHA256(secret, "pdserve kv payload mac v1"), so it never equals the frame key) and puts
the 32-byte tag in the (frame-MACed) KvFrameHeader; the receiver checks it on the received bytes
before copying them into KV blocks (kvtransfer/receiver.py). HMAC-SHA256 was measured against
keyed BLAKE2b on the reference machine (16 MiB buffers, CPython 3.11 hashlib): 1.81 vs 0.93 GB/s
(SHA extensions), so HMAC-SHA256 it is.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from collections.abc import Sequence
from pathlib import Path

import zmq

from pdserve.env import settings
from pdserve.protocol import plane_encryption

MAC_SIZE = 32
PAYLOAD_MAC_SIZE = 32
_PAYLOAD_KEY_LABEL = b"pdserve kv payload mac v1"
MIN_SECRET_BYTES = 16
ENV_SECRET = "PDSERVE_CLUSTER_SECRET"
ENV_SECRET_FILE = "PDSERVE_CLUSTER_SECRET_FILE"

_MODE_LENGTHS = 1  # payload lengths only
_MODE_DIGEST = 2  # payload bytes too


class AuthError(Exception):
    """A message failed authentication (missing/wrong mac, frames added, removed or resized)."""


class ClusterSecretError(RuntimeError):
    """No usable cluster secret configured."""


def generate_cluster_secret() -> bytes:
    """32 random bytes from the OS CSPRNG; share as hex (`.hex()`) with every process of the cluster."""
    return secrets.token_bytes(32)


def load_cluster_secret() -> bytes:
    """The secret from $PDSERVE_CLUSTER_SECRET (hex), else from the file named by
    $PDSERVE_CLUSTER_SECRET_FILE (hex text); raises ClusterSecretError when neither is usable."""
    text = settings().cluster_secret
    source = ENV_SECRET
    if not text:
        path = settings().cluster_secret_file
        if not path:
            raise ClusterSecretError(
                f"no cluster secret: set {ENV_SECRET} to a hex string or {ENV_SECRET_FILE} to a file "
                f"holding one (e.g. python -c 'import secrets; print(secrets.token_hex(32))'); "
                "`pdserve serve` makes one for the workers it starts"
            )
        try:
            text = Path(path).read_text().strip()
        except OSError as e:
            raise ClusterSecretError(f"cannot read {ENV_SECRET_FILE}={path!r}: {e}") from None
        source = f"{ENV_SECRET_FILE} ({path})"
        if not text:
            raise ClusterSecretError(f"{source} is empty")
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise ClusterSecretError(f"{source} must be hex (got {len(text)} characters that are not)") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ClusterSecretError(
            f"{source}: cluster secret must be at least {MIN_SECRET_BYTES} bytes "
            f"({2 * MIN_SECRET_BYTES} hex digits), got {len(secret)}"
        )
    return secret


def _buffer(frame) -> memoryview:
    """zmq.Frame, bytes, bytearray, memoryview or any buffer -> flat byte memoryview, no copy."""
    buf = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
    if buf.ndim != 1 or buf.itemsize != 1 or not buf.c_contiguous:
        buf = buf.cast("B") if buf.c_contiguous else memoryview(buf.tobytes())
    return buf


class FrameAuth:
    """Signs and verifies multipart messages under the cluster secret (see module docstring)."""

    def __init__(self, secret: bytes, digest_payloads: bool = False, encryption: str | None = None) -> None:
        """`encryption`: which sockets of the cluster's planes encrypt (protocol/plane_encryption.py:
        auto | on | off); None: $PDSERVE_PLANE_ENCRYPTION (default auto)."""
        if not isinstance(secret, (bytes, bytearray)) or len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"cluster secret must be at least {MIN_SECRET_BYTES} bytes")
        self._secret = bytes(secret)
        self._payload_key = hmac.new(self._secret, _PAYLOAD_KEY_LABEL, hashlib.sha256).digest()
        self.digest_payloads = digest_payloads
        self.encryption = settings().plane_encryption if encryption is None else encryption
        plane_encryption.encrypts(self.encryption, "")  # a bad mode fails here, not at a socket

    def __repr__(self) -> str:  # never print the secret
        return f"FrameAuth(digest_payloads={self.digest_payloads}, encryption={self.encryption!r})"

    def secure_bind(self, sock: zmq.Socket, addr: str) -> None:
        """Before `sock` binds `addr`: a CURVE server when the cluster's setting encrypts `addr`."""
        if plane_encryption.encrypts(self.encryption, addr):
            plane_encryption.secure_bound(sock, plane_encryption.curve_keys(self._secret))

    def secure_connect(self, sock: zmq.Socket, addr: str) -> None:
        """Before `sock` connects to `addr`: a CURVE client when the setting encrypts `addr`."""
        if plane_encryption.encrypts(self.encryption, addr):
            plane_encryption.secure_connected(sock, plane_encryption.curve_keys(self._secret))

    def _mac(self, header: memoryview, payloads: Sequence[memoryview]) -> bytes:
        mode = _MODE_DIGEST if self.digest_payloads else _MODE_LENGTHS
        prefix = struct.pack(f"<BQQ{len(payloads)}Q", mode, header.nbytes, len(payloads), *(p.nbytes for p in payloads))
        h = hmac.new(self._secret, prefix, hashlib.sha256)
        h.update(header)
        if self.digest_payloads:
            for p in payloads:
                h.update(p)
        return h.digest()

    def sign(self, header: bytes, payloads: Sequence = ()) -> list:
        """-> [mac, header, *payloads] (payload objects passed through untouched, for zero-copy sends)."""
        mac = self._mac(_buffer(header), [_buffer(p) for p in payloads])
        return [mac, header, *payloads]

    def verify(self, frames: Sequence) -> tuple[bytes, list[memoryview]]:
        """Frames as received -> (header bytes, payload buffers); raises AuthError on any mismatch.

        The payload buffers are views of the received frames (no copy) and keep them alive."""
        if len(frames) < 2:
            raise AuthError(f"message has {len(frames)} frame(s); needs at least mac and header")
        mac = _buffer(frames[0])
        if mac.nbytes != MAC_SIZE:
            raise AuthError("missing or malformed mac frame")
        header = _buffer(frames[1])
        payloads = [_buffer(f) for f in frames[2:]]
        if not hmac.compare_digest(mac, self._mac(header, payloads)):
            raise AuthError("bad mac (wrong secret, tampered header, or frames added/removed/resized)")
        return bytes(header), payloads

    def payload_mac(self, payload) -> bytes:
        """32-byte HMAC-SHA256 of one payload's bytes under the derived payload key (see module
        docstring). Hashing releases the GIL for large buffers."""
        return hmac.new(self._payload_key, _buffer(payload), hashlib.sha256).digest()

    def check_payload_mac(self, mac: bytes | None, payload) -> bool:
        """True only when `mac` is the payload's tag (constant-time compare); False when missing."""
        if mac is None or len(mac) != PAYLOAD_MAC_SIZE:
            return False
        return hmac.compare_digest(mac, self.payload_mac(payload))
