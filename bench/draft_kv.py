"""`python -m pdserve.bench.draft_kv`: what shipping a draft model's KV from the prefill pool
costs and saves (engine/spec/draft_model.py, prefill_node/kv_streamer.py), per prompt length:

    prefill_s         the prefill worker's step for the prompt, without / with the draft beside
    kv_bytes          one request's KV frames: the target's layers / plus the draft's (measured:
                      the frames a ZMQ sender puts on an ipc:// link to a KvReceiver, timed too)
    first_spec_s      the decode worker's first step after admission (it proposes, so the draft's
                      KV of the prompt is needed: rebuilt there, or shipped), wall and CPU seconds

One process, fp32, `--threads` torch threads; the transfer is a real sender/receiver pair.
Best of `--repeats` for each timing.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import zmq

from pdserve.bench.speculation import cut_layers
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import PREFILLED, LLMEngine
from pdserve.engine.spec.config import SpeculativeConfig
from pdserve.kvtransfer.lease import LeaseTable
from pdserve.kvtransfer.receiver import KvReceiver
from pdserve.kvtransfer.sender import ZmqKvSender
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import KvDone
from pdserve.protocol.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
AUTH = FrameAuth(b"b" * 32, encryption="off")


def engine(model: str, draft: str | None, max_len: int) -> LLMEngine:
    spec = SpeculativeConfig(method="draft_model", model=draft, num_speculative_tokens=4) if draft else None
    cache = CacheConfig(block_size=16, num_blocks=2 * (max_len // 16 + 2))
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=max_len, max_model_len=max_len + 64)
    return LLMEngine(
        EngineConfig(model=model, dtype="float32", cache=cache, scheduler=sched, speculative=spec), show_progress=False
    )


def prefill(p: LLMEngine, rid: str, prompt: list[int]) -> tuple[float, int, list[int]]:
    """(seconds, first token, blocks) of a prefill-only step."""
    p.add_request(rid, prompt, GREEDY, prefill_only=True)
    blocks: list[int] = []

    def stored(layer: int) -> None:
        if not blocks:
            blocks.extend(p.seqs[rid].block_table)

    t0 = time.perf_counter()
    outs = p.step(on_layer_stored=stored)
    seconds = time.perf_counter() - t0
    assert [o.finish_reason for o in outs] == [PREFILLED]
    return seconds, outs[0].new_token_ids[0], blocks


def transfer(
    p: LLMEngine, d: LLMEngine, rid: str, src: list[int], draft: bool, tmp: str
) -> tuple[int, float, list[int]]:
    """Send `src` blocks' KV (and the draft's) to a receiver over ipc://: (bytes, seconds, D's blocks)."""
    ctx = zmq.Context()
    dd = d.draft
    leases = LeaseTable(d.model_config.num_layers, draft_layers=dd.kv_cache.shape[0] if dd else 0)
    dst = d.pool.allocate(len(src))
    try:
        with KvReceiver(
            ctx, AUTH, f"ipc://{tmp}/kv-{rid}.sock", d.kv_cache, leases, draft_kv_cache=dd.kv_cache if dd else None
        ) as rx:
            tx = ZmqKvSender(ctx, AUTH, rx.addr)
            lease = leases.grant(rid, dst, ttl_s=60)
            layers = [p.kv_cache[j] for j in range(p.kv_cache.shape[0])]  # [2, N, bs, Hkv, D] each
            if draft:
                assert p.draft is not None
                layers += [p.draft.kv_cache[j] for j in range(p.draft.kv_cache.shape[0])]
            t0 = time.perf_counter()
            sent = sum(tx.send_layer(rid, lease, j, kv, src, dst) for j, kv in enumerate(layers))
            tx.send_done(KvDone(request_id=rid, lease_epoch=lease.epoch, num_layers=len(layers), kv_bytes=sent))
            done: list[KvDone] = []
            while not done and time.perf_counter() - t0 < 30:
                done += rx.poll(50)
            seconds = time.perf_counter() - t0
            assert [x.request_id for x in done] == [rid], rx.dropped
            leases.release(rid)
            tx.close()
    finally:
        ctx.destroy(linger=0)
    return sent, seconds, dst


def first_spec_step(d: LLMEngine, rid: str, prompt: list[int], first: int, blocks: list[int], shipped: bool):
    """Admit on D and time its first step (a proposal + verification): (wall s, CPU s)."""
    d.add_prefilled(rid, prompt, first, None, GREEDY, blocks, draft_kv_blocks=len(blocks) if shipped else 0)
    w0, c0 = time.perf_counter(), time.process_time()
    d.step()
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    assert d.speculator is not None and d.speculator.stats.num_drafts > 0, "the first step did not speculate"
    d.abort(rid)
    return wall, cpu


def run(args: argparse.Namespace) -> list[dict]:
    torch.set_num_threads(args.threads)
    max_len = max(args.prompt_lens)
    p_plain, p_draft = engine(args.model, None, max_len), engine(args.model, args.draft_model, max_len)
    d = engine(args.model, args.draft_model, max_len)
    vocab = p_plain.model_config.vocab_size
    rows = []
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-dkv-") as tmp:
        for n in args.prompt_lens:
            best: dict[str, float] = {}

            def keep(key: str, value: float) -> None:
                best[key] = min(best.get(key, float("inf")), value)

            bytes_of: dict[bool, int] = {}
            for r in range(args.repeats + 1):  # round 0 warms up, untimed
                prompt = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(100 * n + r)).tolist()
                plain_s, _, _ = prefill(p_plain, f"plain-{n}-{r}", prompt)
                draft_s, first, src = prefill(p_draft, f"draft-{n}-{r}", prompt)
                for shipped in (False, True):
                    rid = f"{'shipped' if shipped else 'rebuilt'}-{n}-{r}"
                    sent, send_s, dst = transfer(p_draft, d, rid, src, shipped, tmp)
                    wall, cpu = first_spec_step(d, rid, prompt, first, dst, shipped)
                    bytes_of[shipped] = sent
                    if r:
                        keep(f"send_s_{shipped}", send_s)
                        keep(f"first_wall_{shipped}", wall)
                        keep(f"first_cpu_{shipped}", cpu)
                if r:
                    keep("prefill_plain", plain_s)
                    keep("prefill_draft", draft_s)
            d.pool.assert_all_free()
            rows.append(
                {
                    "prompt_tokens": n,
                    "kv_bytes_target": bytes_of[False],
                    "kv_bytes_with_draft": bytes_of[True],
                    **{k: round(v, 4) for k, v in best.items()},
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdserve.bench.draft_kv", description=__doc__)
    ap.add_argument("--model", required=True)
    drafts = ap.add_mutually_exclusive_group(required=True)
    drafts.add_argument("--draft-model")
    drafts.add_argument("--cut-draft", type=int, help="draft: the model's first N layers")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pdserve-cut-draft-") as tmp:
        if args.cut_draft is not None:
            args.draft_model = str(cut_layers(args.model, Path(tmp) / "draft", args.cut_draft))
        run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
