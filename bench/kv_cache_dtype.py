"""What `--kv-cache-dtype int8|fp8` cost and buy against fp32 KV, on the real-shape model.

    python -m pdserve.bench.kv_cache_dtype [--model DIR] [--sequences 8] [--length 256]
        [--context 4096] [--steps 32] [--rounds 5]

Without --model: `pdserve make-model --preset real` (30 layers, hidden 576, 9 heads / 3 KV
heads of 64, vocab 49152; random weights) with max_position_embeddings 8192, so a ~4k context
fits; made once under the system temp directory.

(a) **Agreement**: an fp32-KV engine generates `--length` greedy tokens after each of
`--sequences` random prompts; an int8-KV and an fp8-KV engine then each read prompt +
continuation in one prefill (attention reads each position's quantized K/V, as a decode step
would) and at every continuation position their top-1 token is compared with the fp32 engine's
(teacher-forced). The control: the fp32-KV engine read the same way (prefill vs the decode steps
that made the tokens: what float summation order alone flips).
(b) **Bytes per token**: the pool's bytes per token of context (all layers, K and V), and the
bytes one request's blocks take on the KV wire (a real ZmqKvSender -> KvReceiver over ipc).
(c) **Decode step time**: one sequence at `--context` tokens, `--steps` one-token decode steps
each round (the prompt prefilled once, then found in the prefix cache); rounds alternate fp32 /
int8 / fp8 (noise hits all alike), the steps of every round pooled: median and best; and the
decode attention kernel alone for one layer at that context (best of 2 x 50, A/B/C/A/B/C).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import zmq

from pdserve.bench.machine import best_of
from pdserve.engine.config import CacheConfig, EngineConfig, KvCacheDtype, SchedulerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kernels import kv_quant
from pdserve.kvtransfer.lease import LeaseTable
from pdserve.kvtransfer.receiver import KvReceiver
from pdserve.kvtransfer.sender import ZmqKvSender
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import KvDone
from pdserve.protocol.sampling import SamplingParams

KV_DTYPES: tuple[KvCacheDtype, ...] = ("auto", "int8", "fp8")
QUANTIZED: tuple[KvCacheDtype, ...] = ("int8", "fp8")


def default_model() -> str:
    from pdserve.modelgen.make_model import make_model

    out = Path(tempfile.gettempdir()) / "pdserve-bench" / "real-llama-8k"
    if (out / "config.json").exists():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return str(make_model(out, preset="real", arch="llama", seed=3, quiet=True, max_position_embeddings=8192))


def engine(model: str, kv_cache_dtype: KvCacheDtype, max_model_len: int, num_blocks: int) -> LLMEngine:
    cache = CacheConfig(block_size=16, num_blocks=num_blocks, kv_cache_dtype=kv_cache_dtype)
    sched = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=max_model_len)
    return LLMEngine(EngineConfig(model=model, dtype="float32", cache=cache, scheduler=sched), show_progress=False)


def teacher_forced(eng: LLMEngine, prompts: list[list[int]], want: list[list[int]]) -> tuple[int, int]:
    """(agreeing, total): at each continuation position, the engine's top-1 token given the
    reference prefix, from one prefill's prompt-logprob ranks (rank 1: its most likely token)."""
    scoring = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    for i, (p, w) in enumerate(zip(prompts, want)):
        eng.add_request(f"tf{i}", p + w[:-1], scoring)
    ranks: dict[str, list[int]] = {}
    while eng.has_work():
        for o in eng.step():
            if o.prompt_logprobs is not None:
                ranks[o.request_id] = o.prompt_logprobs.ranks
    tails = [ranks[f"tf{i}"][len(p) - 1 :] for i, p in enumerate(prompts)]  # entry i scores token i + 1
    return sum(r == 1 for t in tails for r in t), sum(len(t) for t in tails)


def agreement(model: str, sequences: int, length: int) -> dict[str, tuple[int, int]]:
    g = torch.Generator().manual_seed(7)
    fp32 = engine(model, "auto", 64 + length + 8, sequences * (64 + length) // 16 + 64)
    vocab = fp32.model_config.vocab_size
    prompts = [torch.randint(3, vocab, (64,), generator=g).tolist() for _ in range(sequences)]
    want = fp32.generate(prompts, SamplingParams(max_tokens=length, temperature=0.0, ignore_eos=True))
    res: dict[str, tuple[int, int]] = {
        k: teacher_forced(engine(model, k, 64 + length + 8, sequences * (64 + length) // 16 + 64), prompts, want)
        for k in QUANTIZED
    }
    return {**res, "fp32 (control)": teacher_forced(fp32, prompts, want)}


def shipped_bytes_per_token(eng: LLMEngine, tokens: int) -> float:
    """Bytes one request's `tokens` of KV take on the wire: every layer's blocks, sent as stored."""
    spec, pool = eng.kv_spec, eng.runner.kv_cache  # [L, 2, N, bs, Hkv, D (int8, fp8: + 4)]
    blocks = list(range(-(-tokens // spec.block_size)))
    auth, ctx = FrameAuth(b"b" * 32, encryption="off"), zmq.Context()
    dst = torch.zeros(spec.shape(len(blocks)), dtype=spec.dtype)
    leases = LeaseTable(spec.num_layers)
    with tempfile.TemporaryDirectory() as tmp, KvReceiver(ctx, auth, f"ipc://{tmp}/kv", dst, leases) as receiver:
        lease = leases.grant("r", blocks, ttl_s=60)
        sender = ZmqKvSender(ctx, auth, receiver.addr)
        sent = sum(sender.send_layer("r", lease, i, pool[i], blocks, blocks) for i in range(spec.num_layers))
        sender.send_done(KvDone(request_id="r", lease_epoch=lease.epoch, num_layers=spec.num_layers, kv_bytes=sent))
        done: list[KvDone] = []
        deadline = time.monotonic() + 30
        while not done and time.monotonic() < deadline:
            done = receiver.poll(50)
        sender.close()
        assert done and torch.equal(dst, pool[:, :, blocks]) and receiver.bytes_received == sent
    ctx.destroy(linger=0)
    return sent / (len(blocks) * spec.block_size)


def decode_steps(eng: LLMEngine, prompt: list[int], steps: int) -> list[float]:
    """Seconds of each one-token decode step of one sequence after `prompt` (steps with a prefill
    chunk, the prompt's, left out)."""
    eng.add_request("d", prompt, SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True))
    times: list[float] = []
    while eng.has_work():
        sched = eng.schedule()
        t0 = time.perf_counter()
        eng.execute(sched)
        if sched.chunks and all(c.num_tokens == 1 for c in sched.chunks):
            times.append(time.perf_counter() - t0)
    return times


def attention_seconds(eng: LLMEngine, context: int) -> float:
    """One layer's decode attention for one sequence at `context` tokens (the C kernel)."""
    from pdserve.kernels import attention
    from pdserve.kernels.metadata import AttentionMetadata

    mc, layer = eng.model_config, eng.runner.kv_cache[0]  # [2, N, bs, Hkv, D (int8, fp8: + 4)]
    bs = layer.shape[2]
    table = [list(range(-(-context // bs)))]
    meta = AttentionMetadata.build([1], [context], table, 1)
    q = torch.randn(1, mc.num_heads, mc.head_dim)
    kv = torch.randn(1, mc.num_kv_heads, mc.head_dim)
    return best_of(lambda: attention.paged_attention(q, kv, kv, layer, meta, mc.head_dim**-0.5), 50)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: the real preset, 8k positions)")
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--length", type=int, default=256, help="greedy tokens per sequence (a)")
    ap.add_argument("--context", type=int, default=4096, help="decode context in tokens (c)")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per round (c)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    model = args.model or default_model()
    print(f"model {model}, {torch.get_num_threads()} threads")

    res = agreement(model, args.sequences, args.length)
    for label, (agree, total) in res.items():
        print(f"(a) teacher-forced top-1 vs fp32-KV greedy, {label:<15} {agree}/{total} = {agree / total * 100:.2f}%")

    engines = {
        k: engine(model, k, args.context + args.steps + 16, -(-(args.context + args.steps + 16) // 16) + 8)
        for k in KV_DTYPES
    }
    mem = {k: e.kv_spec.bytes_per_block / e.kv_spec.block_size for k, e in engines.items()}
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(3, engines["auto"].model_config.vocab_size, (args.context,), generator=g).tolist()
    steps: dict[str, list[float]] = {k: [] for k in KV_DTYPES}
    for e in engines.values():
        decode_steps(e, prompt, 1)  # the prompt prefilled once: later rounds find it cached
    for _ in range(args.rounds):
        for k, e in engines.items():
            steps[k] += decode_steps(e, prompt, args.steps)
    wire = {k: shipped_bytes_per_token(e, args.context) for k, e in engines.items()}  # the last round's KV
    attn = {k: attention_seconds(e, args.context) for k, e in engines.items()}
    attn = {k: min(attn[k], attention_seconds(e, args.context)) for k, e in engines.items()}  # A/B/C/A/B/C
    for k in KV_DTYPES:
        print(f"(b) {k:<5} KV bytes/token: pool {mem[k]:.0f}, shipped {wire[k]:.0f}")
    for k in QUANTIZED:
        print(f"(b) {k} / fp32 bytes: pool {mem[k] / mem['auto']:.3f}, shipped {wire[k] / wire['auto']:.3f}")
    med = {k: statistics.median(v) for k, v in steps.items()}
    best = {k: min(v) for k, v in steps.items()}
    for k in KV_DTYPES:
        print(
            f"(c) {k:<5} decode step at {args.context} tokens ({len(steps[k])} steps): median {med[k] * 1e3:.1f} ms,"
            f" best {best[k] * 1e3:.1f} ms; attention/layer best {attn[k] * 1e6:.0f} us"
        )
    for k in QUANTIZED:
        print(
            f"(c) {k} / fp32 time: decode step median {med[k] / med['auto']:.3f}, best {best[k] / best['auto']:.3f};"
            f" attention {attn[k] / attn['auto']:.3f}"
        )
    for k in QUANTIZED:  # the pools these engines ran on are the format's
        fmt = kv_quant.format_of(engines[k].runner.kv_cache)
        assert fmt is not None and fmt.kv_cache_dtype == k
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
