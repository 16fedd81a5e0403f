"""Pure-torch paged attention and KV store against a naive dense per-token reference.

`make_case` / `reference` are also used by test_triton_kernels.py (in a TRITON_INTERPRET=1
subprocess), so keep them free of pytest state.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch

from pdserve import kernels
from pdserve.env import reload as reload_env
from pdserve.kernels import AttentionMetadata, torch_attention


@dataclass
class Case:
    query: torch.Tensor  # [T, Hq, D]
    key: torch.Tensor  # [T, Hkv, D] this step's tokens (already in kv_layer)
    value: torch.Tensor  # [T, Hkv, D]
    kv_layer: torch.Tensor  # [2, N, bs, Hkv, D]
    meta: AttentionMetadata
    hist_k: list[torch.Tensor]  # per sequence [context, Hkv, D]: explicit per-token K history
    hist_v: list[torch.Tensor]
    q_lens: list[int]
    scale: float


def make_case(
    seqs: list[tuple[int, int]],
    num_decode: int,
    hq: int,
    hkv: int,
    d: int,
    bs: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    spare_blocks: int = 5,
    runs: tuple[int, ...] = (),
) -> Case:
    """`seqs` = (q_len, context_len) per sequence, decodes first. Block ids are shuffled across
    sequences, except that the sequences listed in `runs` get one run of consecutive blocks each
    (separated by a garbage block); unused slots of the pool hold large random garbage (catches
    masking bugs)."""
    g = torch.Generator().manual_seed(seed)
    counts = [-(-c // bs) for _, c in seqs]
    num_blocks = sum(counts) + spare_blocks + len(runs)
    tables: list[list[int]] = [[] for _ in seqs]
    at = 0
    for i in runs:
        tables[i] = list(range(at, at + counts[i]))
        at += counts[i] + 1  # a gap block: reading past the run hits garbage
    rest = torch.randperm(num_blocks - at, generator=g).add(at).tolist()
    for i, n in enumerate(counts):
        if i not in runs:
            tables[i], rest = rest[:n], rest[n:]
    kv_layer = (torch.randn(2, num_blocks, bs, hkv, d, generator=g) * 10).to(dtype)
    hist_k = [torch.randn(c, hkv, d, generator=g).to(dtype) for _, c in seqs]
    hist_v = [torch.randn(c, hkv, d, generator=g).to(dtype) for _, c in seqs]
    for table, hk, hv in zip(tables, hist_k, hist_v):  # the explicit, per-token way
        for pos in range(hk.shape[0]):
            kv_layer[0, table[pos // bs], pos % bs] = hk[pos]
            kv_layer[1, table[pos // bs], pos % bs] = hv[pos]
    q_lens = [q for q, _ in seqs]
    query = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)
    key = torch.cat([hk[c - q :] for (q, c), hk in zip(seqs, hist_k)])
    value = torch.cat([hv[c - q :] for (q, c), hv in zip(seqs, hist_v)])
    meta = AttentionMetadata.build(q_lens, [c for _, c in seqs], tables, num_decode)
    return Case(query, key, value, kv_layer, meta, hist_k, hist_v, q_lens, 1.0 / math.sqrt(d))


def reference(case: Case) -> torch.Tensor:
    """Dense causal attention, one query token at a time, float64; GQA by repeating KV heads."""
    hq = case.query.shape[1]
    rows = []
    t = 0
    for q_len, hk, hv in zip(case.q_lens, case.hist_k, case.hist_v):
        c = hk.shape[0]
        groups = hq // hk.shape[1]
        for j in range(q_len):
            pos = c - q_len + j
            k = hk[: pos + 1].double().repeat_interleave(groups, dim=1)  # [pos+1, Hq, D]
            v = hv[: pos + 1].double().repeat_interleave(groups, dim=1)  # [pos+1, Hq, D]
            q = case.query[t].double()  # [Hq, D]
            w = (torch.einsum("hd,shd->hs", q, k) * case.scale).softmax(-1)  # [Hq, pos+1]
            rows.append(torch.einsum("hs,shd->hd", w, v))  # [Hq, D]
            t += 1
    return torch.stack(rows)  # [T, Hq, D]


# (q_len, context_len): 3 decodes, then prefill chunks with earlier context, whole prompts,
# a one-token chunk with context, and a chunk ending exactly on a block boundary.
MIXED = [(1, 1), (1, 17), (1, 50), (7, 40), (33, 33), (1, 20), (40, 40), (5, 37), (16, 32)]
SHAPES = [(4, 2, 16), (8, 2, 64), (4, 4, 32), (6, 2, 16)]  # (Hq, Hkv, D)


def run_torch(case: Case) -> torch.Tensor:
    return torch_attention.paged_attention(case.query, case.key, case.value, case.kv_layer, case.meta, case.scale)


@pytest.mark.parametrize("bs", [16, 4])
@pytest.mark.parametrize("hq,hkv,d", SHAPES)
def test_mixed_batch_matches_reference(bs, hq, hkv, d):
    case = make_case(MIXED, 3, hq, hkv, d, bs, seed=bs + hq + d)
    out = run_torch(case)
    assert out.shape == case.query.shape and out.dtype == case.query.dtype
    torch.testing.assert_close(out.double(), reference(case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bs", [16, 4])
def test_decode_only_and_prefill_only(bs):
    dec = make_case([(1, c) for c in (1, 5, 16, 17, 64, 3)], 6, 4, 2, 32, bs, seed=1)
    torch.testing.assert_close(run_torch(dec).double(), reference(dec), atol=1e-5, rtol=1e-5)
    pre = make_case([(3, 3), (9, 30), (1, 2)], 0, 4, 2, 32, bs, seed=2)
    torch.testing.assert_close(run_torch(pre).double(), reference(pre), atol=1e-5, rtol=1e-5)


def test_decode_in_small_chunks(monkeypatch):
    """Force one-sequence gathers (and uneven chunk maxima): same result as one big batch."""
    case = make_case([(1, c) for c in (33, 2, 70, 16, 1, 48, 9)] + [(4, 20)], 7, 8, 2, 16, 16, seed=3)
    full = run_torch(case)
    for budget in (1, 3 * 2 * 80 * 2 * 16 * 4):
        monkeypatch.setattr(torch_attention, "DECODE_CHUNK_BYTES", budget)
        torch.testing.assert_close(run_torch(case), full, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(full.double(), reference(case), atol=1e-5, rtol=1e-5)


def test_prefill_chunks_on_block_runs_are_read_in_place(monkeypatch):
    """A prefill chunk with earlier context whose blocks form one run is attended on a view of
    the pool (no gather), beside gathered ones: same result as the reference."""
    seqs = [(1, 33), (1, 2), (7, 40), (33, 33), (5, 37), (9, 30)]
    case = make_case(seqs, 2, 8, 2, 16, 16, seed=11, runs=(2, 4))
    starts = case.meta.kv_run_start_cpu
    assert [starts[i] for i in (2, 4)] == [0, 4] and starts[5] == -1  # both prefill paths run
    torch.testing.assert_close(run_torch(case).double(), reference(case), atol=1e-5, rtol=1e-5)
    prefills = make_case([s for s in seqs if s[0] > 1], 0, 8, 2, 16, 16, seed=12, runs=(0, 1, 2, 3))
    calls, gather = [], torch_attention.gather_kv
    monkeypatch.setattr(torch_attention, "gather_kv", lambda *a: calls.append(a) or gather(*a))
    torch.testing.assert_close(run_torch(prefills).double(), reference(prefills), atol=1e-5, rtol=1e-5)
    assert not calls, "a run of blocks was gathered"


def test_strided_inputs_and_noncontiguous_pool():
    """q/k/v as views of a fused qkv projection; pool as a non-contiguous view."""
    case = make_case(MIXED, 3, 4, 2, 16, 4, seed=4)
    t, hq, d = case.query.shape
    hkv = case.key.shape[1]
    qkv = torch.cat([case.query.reshape(t, -1), case.key.reshape(t, -1), case.value.reshape(t, -1)], 1)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
    out = torch_attention.paged_attention(q, k, v, case.kv_layer, case.meta, case.scale)
    torch.testing.assert_close(out.double(), reference(case), atol=1e-5, rtol=1e-5)
    big = torch.zeros((2,) + case.kv_layer.shape[1:4] + (2 * d,))
    big[..., :d] = case.kv_layer
    pool = big[..., :d]  # [2, N, bs, Hkv, D], not contiguous
    out = torch_attention.paged_attention(q, k, v, pool, case.meta, case.scale)
    torch.testing.assert_close(out.double(), reference(case), atol=1e-5, rtol=1e-5)


def test_bf16():
    case = make_case(MIXED, 3, 8, 2, 64, 16, dtype=torch.bfloat16, seed=5)
    out = run_torch(case)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), reference(case), atol=3e-2, rtol=3e-2)


def test_store_kv_places_tokens_and_skips_negative_slots():
    g = torch.Generator().manual_seed(6)
    n, bs, hkv, d = 7, 4, 2, 8
    kv = torch.randn(2, n, bs, hkv, d, generator=g)
    before = kv.clone()
    t = 10
    qkv = torch.randn(t, 3 * hkv * d, generator=g)
    key = qkv[:, hkv * d : 2 * hkv * d].view(t, hkv, d)  # strided, like the model's split
    value = qkv[:, 2 * hkv * d :].view(t, hkv, d)
    slots = torch.tensor([5, -1, 0, 27, -1, 13, 14, 3, -1, 20], dtype=torch.int64)
    torch_attention.store_kv(key, value, kv, slots)
    expect = before.clone()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            expect[0, s // bs, s % bs] = key[i]
            expect[1, s // bs, s % bs] = value[i]
    assert torch.equal(kv, expect)
    kernels.store_kv(key[:0], value[:0], kv, slots[:0])  # empty step is a no-op
    assert torch.equal(kv, expect)
    all_skipped = torch.full((t,), -1, dtype=torch.int64)
    torch_attention.store_kv(key, value, kv, all_skipped)
    assert torch.equal(kv, expect)


def test_store_then_attend_roundtrip():
    """store_kv fills the pool that paged_attention reads: same as make_case's explicit fill."""
    case = make_case(MIXED, 3, 4, 2, 16, 16, seed=7)
    pool = torch.zeros_like(case.kv_layer)
    bs = pool.shape[2]
    tables = case.meta.block_tables.tolist()
    for b, (hk, hv) in enumerate(zip(case.hist_k, case.hist_v)):
        pos = torch.arange(hk.shape[0])
        slots = torch.tensor(tables[b])[pos // bs].long() * bs + pos % bs
        torch_attention.store_kv(hk, hv, pool, slots)
    out = torch_attention.paged_attention(case.query, case.key, case.value, pool, case.meta, case.scale)
    torch.testing.assert_close(out.double(), reference(case), atol=1e-5, rtol=1e-5)


def test_dispatch_on_cpu(monkeypatch):
    """Default: torch for prefills (the C kernel, when built, takes decodes: its own tests);
    PDSERVE_ATTENTION=torch is exactly the pure-torch path."""
    case = make_case(MIXED, 3, 4, 2, 16, 16, seed=8)
    ref = run_torch(case)
    monkeypatch.delenv("PDSERVE_ATTENTION", raising=False)
    reload_env()
    out = kernels.paged_attention(case.query, case.key, case.value, case.kv_layer, case.meta, case.scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    monkeypatch.setenv("PDSERVE_ATTENTION", "torch")
    reload_env()
    out = kernels.paged_attention(case.query, case.key, case.value, case.kv_layer, case.meta, case.scale)
    assert torch.equal(out, ref)
    monkeypatch.setenv("PDSERVE_ATTENTION", "bogus")
    with pytest.raises(ValueError, match="PDSERVE_ATTENTION"):  # refused when the environment is read
        reload_env()


def test_metadata_build_validates():
    meta = AttentionMetadata.build([1, 3], [5, 3], [[4, 2], [7]], 1)
    assert meta.cu_seqlens_q_cpu == [0, 1, 4]
    assert meta.block_tables.tolist() == [[4, 2], [7, 0]]
    assert meta.block_tables.dtype == meta.context_lens.dtype == meta.cu_seqlens_q.dtype == torch.int32
    assert (meta.max_q_len, meta.max_context_len, meta.num_seqs) == (3, 5, 2)
    with pytest.raises(ValueError):
        AttentionMetadata.build([2], [5], [[0]], 1)  # a "decode" with two tokens
    with pytest.raises(ValueError):
        AttentionMetadata.build([6], [5], [[0]], 0)  # more queries than context


def test_import_and_cpu_path_without_triton():
    """`import kernels` never needs triton (blocked here in a fresh interpreter)."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, kernels\n"
        "from kernels import attention\n"
        "assert not attention.triton_available()\n"
        "meta = kernels.AttentionMetadata.build([1, 2], [3, 2], [[1], [0]], 1)\n"
        "kv = torch.randn(2, 2, 4, 1, 8)\n"
        "k = torch.randn(3, 1, 8)\n"
        "kernels.store_kv(k, k, kv, torch.tensor([2, 0, 1]))\n"
        "out = kernels.paged_attention(torch.randn(3, 2, 8), k, k, kv, meta, 0.35)\n"
        "assert out.shape == (3, 2, 8) and 'triton' not in [m for m in sys.modules if sys.modules[m]]\n"
    )
    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_ATTENTION"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
