"""A DecodeWorker in this process (no gateway behind its address) drives its engine only through
EngineCore: a lease's blocks are reserved there and come back there; AIMD's limit reaches the
engine's scheduler and the worker's registration."""

from __future__ import annotations

import pytest

from pdserve.decode_node.settings import DecodeSettings
from pdserve.decode_node.worker import DecodeWorker
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import Abort, ReserveRequest

BS = 4


@pytest.fixture
def decode_worker(tiny_llama):
    made = []

    def make(**settings) -> DecodeWorker:
        config = EngineConfig(
            model=str(tiny_llama),
            dtype="float32",
            cache=CacheConfig(block_size=BS, num_blocks=32),
            scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=64),
        )
        w = DecodeWorker(
            DecodeSettings(engine=config, gateways=["tcp://127.0.0.1:9"], host="test", shared_memory=False, **settings),
            FrameAuth(b"k" * 32),
        )
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


def test_a_lease_takes_blocks_from_the_engine_and_gives_them_back(decode_worker):
    w = decode_worker()
    free = w.engine.stats().num_free_blocks
    w._on_reserve(ReserveRequest(request_id="r", gateway_id="g", num_prompt_tokens=10, max_tokens=4))
    lease = w.leases.get("r")
    assert lease is not None and len(lease.block_ids) == 3
    assert w.engine.stats().num_free_blocks == free - 3
    w._on_abort(Abort(request_id="r", lease_unused=True))  # nobody will write it: back at once
    assert w.engine.stats().num_free_blocks == free and "r" not in w.requests
    w.engine.pool.assert_all_free()  # (a test may look inside; the worker does not)


def test_a_reservation_past_the_free_blocks_is_refused_for_capacity(decode_worker):
    w = decode_worker()
    outcomes = [
        w._reserve(ReserveRequest(request_id=f"r{i}", gateway_id="g", num_prompt_tokens=60, max_tokens=2))
        for i in range(3)
    ]  # 15 blocks each of 32
    assert outcomes == ["lease", "lease", "refused"] and w.leases.get("r2") is None
    assert w.engine.stats().num_free_blocks == 2


def test_aimd_sets_the_engines_limit_and_the_registration(decode_worker):
    w = decode_worker(min_num_seqs=2, tpot_target_ms=1000.0)
    assert w.aimd is not None and w.engine.stats().seq_limit == w.aimd.limit == 2
    for _ in range(w.aimd.s.increase_every_steps + w.aimd.s.cooldown_steps):
        w._adapt(0.001, w.engine.stats().seq_limit, 0, w.engine.stats().seq_limit)  # fast, full steps
    assert w.aimd.limit == 3 and w.engine.stats().seq_limit == 3
    assert w.rt.info is not None and w.rt.info.max_num_seqs == 3
