"""What travels on a worker's prefix export socket (kvtransfer/prefix_exporter.py answers,
kvtransfer/prefix_fetcher.py asks), one connection per fetch, every message authenticated like
all others (`[mac, header, *payloads]`, protocol/auth.py):

    asker -> peer   PrefixFetch                         the prompt's leading blocks, by hash
    peer -> asker   KvFrameHeader + 1 raw payload       one layer's K and V of the first n of them,
                    (one per layer: target, then draft) [2, n, block_size, heads, W], `block_ids`
                                                        0 .. n-1 (positions in the asked list)
    peer -> asker   PrefixFetchDone(n)                  the end; n = 0 with a reason: none sent

Decoding accepts only these tags (anything else raises msgspec.ValidationError: dropped).
"""

from __future__ import annotations

from typing import Union

import msgspec

from pdserve.kvtransfer.wire import KvFrameHeader
from pdserve.protocol.messages import KvLayout, PrefixFetch, PrefixFetchDone

PrefixReply = Union[KvFrameHeader, PrefixFetchDone]

_encoder = msgspec.msgpack.Encoder()
_requests = msgspec.msgpack.Decoder(PrefixFetch)
_replies = msgspec.msgpack.Decoder(PrefixReply)


def encode_prefix(msg: PrefixFetch | KvFrameHeader | PrefixFetchDone) -> bytes:
    return _encoder.encode(msg)


def decode_request(data: bytes | memoryview) -> PrefixFetch:
    """Raises msgspec.DecodeError / ValidationError on anything else."""
    return _requests.decode(data)


def decode_reply(data: bytes | memoryview) -> KvFrameHeader | PrefixFetchDone:
    """Raises msgspec.DecodeError / ValidationError on anything else."""
    return _replies.decode(data)


def same_kv_identity(a: KvLayout, b: KvLayout) -> bool:
    """Whether two pools' blocks are interchangeable: every field of the layout but its size."""
    return msgspec.structs.replace(a, num_blocks=0) == msgspec.structs.replace(b, num_blocks=0)
