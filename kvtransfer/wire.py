"""What travels on a decode worker's KV stream (P -> D, one PULL socket per decode worker).

Each ZMQ message is authenticated like every other (`[mac, header, *payloads]`, protocol/auth.py);
its msgpack header is a tagged union told apart by the msgspec tag field `"type"`:

    {"type": "KvFrameHeader", ...} + 1 raw payload frame   one layer's K and V for some blocks,
                                                           [2, n_blocks, block_size, heads, head_dim],
                                                           C-contiguous, native byte order, `dtype`
                                                           (int8, uint8: head_dim + 4, each row's fp32
                                                           scale after its values, kernels/kv_quant.py)
    {"type": "KvFrameHeader", ..., "in_place": true}       same, no payload: P already wrote the
                                                           blocks into D's shared-memory pool
    {"type": "KvDone", ...}                                protocol.messages.KvDone: all layers sent
    {"type": "KvRangeDone", ...}                           a prefill rank's own stream: its heads sent
    {"type": "KvRelease" | "KvRenew", ...}                 P drops the request / still holds it

Decoding accepts only these tags (anything else -> msgspec.ValidationError, dropped).
`seq` numbers a request's frames of one head range 0, 1, 2 ... in send order (one sender per
range: a prefill rank's), so D rejects replayed or reordered frames. A layer may legitimately arrive more than once (chunked prefill re-sends a block that
the previous chunk only partly filled), each time with a new `seq`.

`payload_mac`: 32-byte HMAC of the payload bytes (protocol/auth.py FrameAuth.payload_mac), set by
a sender with payload authentication on. The frame MAC covers the header (so this tag) but only
the payload's length; the tag closes that gap for networks where frames can be modified in
flight. Policy `--kv-payload-mac {auto,on,off}` (`payload_mac_enabled`): auto = on for tcp://,
off for ipc:// and shared memory (same host, private 0700 runtime directory). A receiver with it
on drops frames whose tag is missing or wrong before their bytes reach a KV block.
"""

from __future__ import annotations

from typing import Union

import msgspec
import torch

from pdserve.protocol.messages import KvDone, KvRangeDone, KvRelease, KvRenew
from pdserve.protocol.plane_encryption import encrypts


class KvFrameHeader(msgspec.Struct, tag="KvFrameHeader", frozen=True, forbid_unknown_fields=True):
    request_id: str
    lease_epoch: int
    layer: int
    block_ids: list[int]  # destination (D's) block ids, in payload order
    kv_head_start: int
    kv_head_end: int
    dtype: str  # torch dtype name without "torch.", e.g. "float32"
    shape: list[int]  # [2, len(block_ids), block_size, kv_head_end - kv_head_start, head_dim]
    nbytes: int
    seq: int
    in_place: bool = False
    payload_mac: bytes | None = None  # HMAC of the payload bytes (payload authentication on)


KvStreamMessage = Union[KvFrameHeader, KvDone, KvRangeDone, KvRelease, KvRenew]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KvStreamMessage)


def encode_kv(msg: KvFrameHeader | KvDone) -> bytes:
    return _encoder.encode(msg)


def decode_kv(data: bytes | memoryview) -> KvFrameHeader | KvDone | KvRangeDone | KvRelease | KvRenew:
    """Raises msgspec.DecodeError / ValidationError on anything else."""
    return _decoder.decode(data)


_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,  # --kv-cache-dtype int8: rows of D values + their fp32 scale (kernels/kv_quant.py)
    "uint8": torch.uint8,  # --kv-cache-dtype fp8: rows of D e4m3 values + their fp32 scale (the same)
}
if hasattr(torch, "float8_e4m3fn"):
    _DTYPES["float8_e4m3fn"] = torch.float8_e4m3fn
    _DTYPES["float8_e5m2"] = torch.float8_e5m2


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported KV dtype {name!r} (known: {sorted(_DTYPES)})") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def element_size(name: str) -> int:
    return torch.empty((), dtype=torch_dtype(name)).element_size()


PAYLOAD_MAC_MODES = ("auto", "on", "off")


def payload_mac_enabled(mode: str, *addrs: str | None, encryption: str = "off") -> bool:
    """Whether KV payloads are authenticated: "on"/"off" as given; "auto" = on when any of the
    ZMQ addresses involved (bound, advertised or connected to) is tcp:// and the cluster's
    `encryption` (protocol/plane_encryption.py) leaves it in clear: CURVE already authenticates
    every byte it carries, at less cost than the MAC (docs/benchmarks/kv_transfer.md)."""
    if mode not in PAYLOAD_MAC_MODES:
        raise ValueError(f"kv payload mac mode must be one of {PAYLOAD_MAC_MODES}, got {mode!r}")
    if mode != "auto":
        return mode == "on"
    return any(a is not None and a.startswith("tcp://") and not encrypts(encryption, a) for a in addrs)
