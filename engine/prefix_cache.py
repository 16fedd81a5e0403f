"""The engine's side of content-addressed KV blocks (protocol/block_hashes.py): a sequence's
chained block hashes, computed once as its tokens become known."""

from __future__ import annotations

from pdserve.engine.sequence import Sequence
from pdserve.protocol.block_hashes import BlockHasher as _WireHasher


class BlockHasher(_WireHasher):
    def extend(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """`seq.block_hashes`, extended to its first `num_blocks` full blocks (computed once)."""
        bs, have = self.block_size, seq.block_hashes
        num_blocks = min(num_blocks, seq.num_tokens // bs)
        parent = have[-1] if have else self.root
        for i in range(len(have), num_blocks):
            parent = self.chain(parent, seq.token_ids[i * bs : (i + 1) * bs])
            have.append(parent)
        return have
