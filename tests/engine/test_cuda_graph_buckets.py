"""The decode CUDA graphs' buckets (engine/cuda_graphs.py), and that the CPU engine runs eagerly.
Replays themselves are tested on a GPU (tests/gpu/test_cuda_graphs.py)."""

from __future__ import annotations

from pdserve.engine.cuda_graphs import MIN_CONTEXT_BUCKET, batch_buckets, context_bucket
from tests.engine.test_engine_vs_hf import make_engine


def test_batch_buckets_cover_every_batch_up_to_the_limit():
    assert batch_buckets(1) == [1]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert batch_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]
    for limit in (1, 3, 17, 64, 256):
        buckets = batch_buckets(limit)
        assert buckets == sorted(set(buckets)) and buckets[-1] == limit
        assert all(next(b for b in buckets if b >= n) - n < max(8, n) for n in range(1, limit + 1))


def test_context_buckets_are_powers_of_two_capped_at_the_model_length():
    assert context_bucket(1, 8192) == MIN_CONTEXT_BUCKET
    assert context_bucket(MIN_CONTEXT_BUCKET, 8192) == MIN_CONTEXT_BUCKET
    assert context_bucket(MIN_CONTEXT_BUCKET + 1, 8192) == 2 * MIN_CONTEXT_BUCKET
    assert context_bucket(5000, 8192) == 8192
    assert context_bucket(5000, 6000) == 6000  # never past max_model_len
    assert context_bucket(200, 256) == 256


def test_the_cpu_engine_has_no_graphs(tiny_llama):
    engine = make_engine(tiny_llama)
    assert engine.runner.decode_graphs is None
