"""The prefix cache's disk tier (engine/kv_disk_tier.py, engine/kv_offload.py): files written off the
step loop and found again by hash, bounded least recently used, kept across a restart, and a
corrupt or cut file is a miss (recomputed), never wrong KV. On a RAM pool far smaller than the
prompts' KV, a prompt whose blocks left RAM is read back from disk, and greedy output still equals
HF's token for token, before and after a restart."""

from __future__ import annotations

import pytest

from pdserve.engine.kv_disk_tier import HEADER, DiskKvTier
from pdserve.protocol.sampling import SamplingParams
from tests.conftest import hf_greedy, random_prompts
from tests.engine.test_engine_vs_hf import make_engine
from tests.engine.test_structured_output import run


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_blocks_round_trip_and_outlive_the_tier(tmp_path):
    tier = DiskKvTier(tmp_path, "model-a", 1 << 20)
    tier.put(h(1), b"x" * 1000)
    tier.put(h(2), b"y" * 1000)
    tier.flush()
    assert tier.get(h(1)) == b"x" * 1000 and tier.leading([h(1), h(2), h(3), h(1)]) == 2
    assert tier.counters.writes == 2 and tier.counters.reads == 1
    tier.close()
    again = DiskKvTier(tmp_path, "model-a", 1 << 20)  # a restarted worker
    assert again.num_blocks == 2 and again.take(h(2)) == b"y" * 1000
    other = DiskKvTier(tmp_path, "model-b", 1 << 20)  # another model (or KV dtype): another folder
    assert other.num_blocks == 0 and other.get(h(1)) is None
    again.close()
    other.close()


def test_least_recently_used_files_go_past_the_size(tmp_path):
    size = HEADER.size + 1000
    tier = DiskKvTier(tmp_path, "m", 3 * size)
    for i in range(3):
        tier.put(h(i), bytes([i]) * 1000)
    tier.flush()
    assert tier.get(h(0)) is not None  # 0 used: 1 is now the least recent
    tier.put(h(3), b"z" * 1000)
    tier.flush()
    assert [tier.get(h(i)) is not None for i in range(4)] == [True, False, True, True]
    assert tier.counters.evictions == 1 and tier.bytes_used == 3 * size
    assert not tier.path(h(1)).exists()
    tier.close()
    assert DiskKvTier(tmp_path, "m", size).num_blocks == 1  # a smaller size at start trims at once


@pytest.mark.parametrize("damage", ["flipped byte", "cut short", "another block's file"])
def test_a_damaged_file_is_a_miss_and_is_removed(tmp_path, damage):
    tier = DiskKvTier(tmp_path, "m", 1 << 20)
    tier.put(h(1), bytes(range(256)) * 4)
    tier.put(h(2), b"other" * 10)
    tier.flush()
    path = tier.path(h(1))
    data = bytearray(path.read_bytes())
    if damage == "flipped byte":
        data[-7] ^= 1
    elif damage == "cut short":
        data = data[: len(data) - 100]
    else:
        data = bytearray(tier.path(h(2)).read_bytes())
    path.write_bytes(bytes(data))
    assert tier.get(h(1)) is None and tier.counters.corrupt == 1
    assert not path.exists() and h(1) not in tier and tier.get(h(2)) == b"other" * 10
    tier.close()


def test_a_write_cut_by_a_crash_leaves_nothing_behind(tmp_path):
    tier = DiskKvTier(tmp_path, "m", 1 << 20)
    (tier.dir / f".{h(5).hex()}.kvb.123.tmp").write_bytes(b"half a block")
    tier.close()
    again = DiskKvTier(tmp_path, "m", 1 << 20)
    assert again.num_blocks == 0 and not list(again.dir.glob("*.tmp"))
    again.close()


GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def serve(engine, prompts: list[list[int]]) -> list[list[int]]:
    """One at a time, as returning conversations come."""
    return [run(engine, {"r": (p, GREEDY)})["r"][0] for p in prompts]


@pytest.mark.slow
def test_prompts_whose_blocks_left_ram_come_back_from_disk_equal_to_hf(tiny_llama, tmp_path):
    """A RAM pool of 16 blocks; three 120-token prompts (8 blocks each) take turns, so each
    one's blocks are evicted before it returns: the second round reads them from disk; a fresh
    engine (a restart) reads them too; a block file damaged meanwhile is recomputed."""
    prompts = random_prompts(512, [120, 121, 122], seed=11)
    want = [hf_greedy(str(tiny_llama), tuple(p), 8) for p in prompts]
    kw = dict(num_blocks=16, max_model_len=256, kv_offload_dir=str(tmp_path), kv_offload_bytes=64 << 20)
    engine = make_engine(tiny_llama, **kw)
    assert serve(engine, prompts) == want
    engine.offload.tier.flush()
    first = engine.stats().kv_disk
    assert first["kv_disk_hit_tokens"] == 0 and first["kv_disk_blocks"] >= 3 * 7
    assert serve(engine, prompts) == want
    hits = engine.stats().kv_disk["kv_disk_hit_tokens"]
    assert hits >= 3 * 6 * 16  # (each prompt: its RAM-evicted full blocks, all but the last computed)
    engine.pool.check_integrity()
    engine.close()

    restarted = make_engine(tiny_llama, **kw)
    tier = restarted.offload.tier
    victim = restarted.hasher.hashes(prompts[1], 3)[2]  # prompt 1's third block
    path = tier.path(victim)
    path.write_bytes(path.read_bytes()[:-1] + b"\0")
    assert serve(restarted, prompts) == want
    st = restarted.stats().kv_disk
    assert st["kv_disk_corrupt"] == 1 and st["kv_disk_hit_tokens"] >= (3 * 7 - 6) * 16
    restarted.close()


def test_no_tier_without_the_flag(tiny_llama):
    engine = make_engine(tiny_llama, num_blocks=24)
    assert engine.offload is None and engine.stats().kv_disk == {}
