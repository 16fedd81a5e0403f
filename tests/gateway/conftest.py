"""What the gateway's tests share: a small byte-level tokenizer, and WorkerInfo for fake workers."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pdserve.engine.tokenizer_builder import build_tokenizer
from pdserve.protocol.messages import KvLayout, WorkerInfo


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path, 512)
    return AutoTokenizer.from_pretrained(path)


def fake_worker(worker_id: str, role: str, control_addr: str, num_blocks: int = 8, max_num_seqs: int = 4) -> WorkerInfo:
    """What a worker of `role` at `control_addr` registers with (no engine behind it)."""
    return WorkerInfo(
        worker_id=worker_id,
        role=role,  # type: ignore[arg-type]
        control_addr=control_addr,
        host="localhost",
        pid=1,
        model_fingerprint="m",
        kv_layout=KvLayout(1, num_blocks, 16, 1, 8, "float32"),
        max_num_seqs=max_num_seqs,
    )
