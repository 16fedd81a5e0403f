"""Content addresses of KV blocks: what the gateway, prefill and decode workers agree a block is.

A full block's identity is a chained hash: blake2b-128 over its parent's hash and its token
ids, rooted in a salt naming whatever else changes its KV (the model fingerprint with its
dtype, `WorkerInfo.model_fingerprint`) and the block size. Two different prefixes never share
a hash (a 128-bit cryptographic digest), so a block found by hash holds exactly the KV that
this prefix would compute. Partial blocks have no hash: they are never shared.

    tokens   [t0 .. t15][t16 .. t31][t32 .. t40]
    hashes   h0=H(root,b0) h1=H(h0,b1)   (partial: none)
"""

from __future__ import annotations

import hashlib
from array import array

HASH_BYTES = 16


def short_id(block_hash: bytes) -> int:
    """A block hash's first 8 bytes: enough to route by (gateway/kv_index.py), not to trust."""
    return int.from_bytes(block_hash[:8], "little")


class BlockHasher:
    def __init__(self, salt: str, block_size: int) -> None:
        self.block_size = block_size
        self.root = hashlib.blake2b(f"pdserve-kv/{salt}/bs{block_size}".encode(), digest_size=HASH_BYTES).digest()

    def chain(self, parent: bytes, tokens: list[int]) -> bytes:
        h = hashlib.blake2b(parent, digest_size=HASH_BYTES)
        h.update(array("q", tokens).tobytes())
        return h.digest()

    def hashes(self, token_ids: list[int], num_blocks: int | None = None) -> list[bytes]:
        """The hashes of the first `num_blocks` full blocks of `token_ids` (default: all full)."""
        bs = self.block_size
        n = len(token_ids) // bs if num_blocks is None else min(num_blocks, len(token_ids) // bs)
        out, parent = [], self.root
        for i in range(n):
            parent = self.chain(parent, token_ids[i * bs : (i + 1) * bs])
            out.append(parent)
        return out
