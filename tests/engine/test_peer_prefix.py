"""Prefix blocks shared between engines (engine/peer_prefix.py; EngineCore.export_prefix /
import_prefix): blocks one engine computed, copied out and loaded into another, are found there
by the scheduler as cached blocks, and greedy output still equals HF's (fp32)."""

from __future__ import annotations

import pytest
import torch

from pdserve.protocol.sampling import SamplingParams
from tests.conftest import hf_greedy, random_prompts
from tests.engine.test_engine_vs_hf import make_engine
from tests.engine.test_structured_output import run

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def wire_layers(pools: list[torch.Tensor]) -> list[memoryview]:
    """As a fetch hands them over: one payload of bytes per layer, [2, n, bs, H, W]."""
    return [memoryview(kv.contiguous().view(-1).view(torch.uint8).numpy().tobytes()) for p in pools for kv in p]


@pytest.fixture(scope="module")
def engines(tiny_llama):
    return make_engine(tiny_llama, num_blocks=64), make_engine(tiny_llama, num_blocks=64)


def test_blocks_computed_on_one_engine_serve_the_other_equal_to_hf(engines, tiny_llama):
    a, b = engines
    (prompt,) = random_prompts(512, [100], seed=21)
    want = hf_greedy(str(tiny_llama), tuple(prompt), 8)
    assert run(a, {"r": (prompt, GREEDY)})["r"][0] == want
    hashes = b.prefix_hashes(prompt)
    assert len(hashes) == 6 and hashes == a.prefix_hashes(prompt)  # (99 // 16: the last block is computed)
    assert b.cached_prefix(hashes) == []

    pools = a.export_prefix(hashes[2:])  # a holds all: asked from the third on
    assert len(pools) == 1 and pools[0].shape == (a.kv_cache.shape[0], 2, 4, *a.kv_cache.shape[3:])
    assert b.import_prefix(hashes, 2, wire_layers(pools)) == 0  # b lacks the first two: none would be found
    b.import_prefix(hashes, 0, wire_layers(a.export_prefix(hashes[:2])))
    assert b.import_prefix(hashes, 2, wire_layers(pools)) == 4
    assert len(b.cached_prefix(hashes)) == 6
    b.pool.check_integrity()

    b.add_request("r", prompt, GREEDY)
    out = []
    while b.has_work():
        for o in b.step():
            out += o.new_token_ids
            if o.num_output_tokens == 1:
                assert o.num_cached_tokens == 96  # six blocks found cached, not computed
    assert out == want
    b.pool.assert_all_free()


def test_what_is_held_already_is_not_loaded_twice_and_the_layer_count_is_checked(engines):
    a, b = engines
    (prompt,) = random_prompts(512, [70], seed=22)
    run(a, {"r": (prompt, GREEDY)})
    run(b, {"r": (prompt, GREEDY)})
    hashes = a.prefix_hashes(prompt)
    layers = wire_layers(a.export_prefix(hashes))
    assert b.import_prefix(hashes, 0, layers) == 0
    with pytest.raises(ValueError, match="layer payloads"):
        b.import_prefix(hashes, 0, layers[:-1])
    assert a.export_prefix([bytes(16)] + hashes) == []  # the run starts with a block it lacks
