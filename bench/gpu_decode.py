"""A decode step on a GPU, eager and replayed from a CUDA graph (engine/cuda_graphs.py), against the
bandwidth bound measured in the same run: the step must read every weight and its sequences' KV
once, so its floor is those bytes over the device's copy bandwidth.

    python -m pdserve.bench.gpu_decode --shape llama3-8b --batches 1,8,32 --context 1024 [--json]

The model is built on the device with random weights (no files: an 8B model in a few seconds);
its shape is a real model's (Llama-3-8B: 32 layers, hidden 4096, GQA 32/8, vocab 128,256), bf16.
A step is the forward pass of B one-token decodes at context C (embedding, every layer, LM head);
sampling is left out (the same in both). Each figure is the median of --steps timed steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pdserve.engine.batch import ForwardBatch
from pdserve.engine.config import ModelConfig, RopeConfig
from pdserve.engine.cuda_graphs import DecodeGraphs
from pdserve.engine.models.llama import ForwardContext, LlamaForCausalLM
from pdserve.kernels import AttentionMetadata

SHAPES = {  # (vocab, hidden, intermediate, layers, heads, kv heads, head dim, rope theta)
    "llama3-8b": (128256, 4096, 14336, 32, 32, 8, 128, 500000.0),
    "llama3.2-1b": (128256, 2048, 8192, 16, 32, 8, 64, 500000.0),
    "qwen2.5-7b": (152064, 3584, 18944, 28, 28, 4, 128, 1000000.0),
}
BLOCK = 16


def random_model(shape: str, dtype: torch.dtype, max_positions: int) -> LlamaForCausalLM:
    vocab, hidden, inter, layers, heads, kv, head_dim, theta = SHAPES[shape]
    cfg = ModelConfig(
        path=f"<random {shape}>",
        architecture="LlamaForCausalLM",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        rope=RopeConfig(theta=theta),
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        qkv_bias=False,
        eos_token_ids=(0,),
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions)
    model.materialize(torch.device("cuda"), dtype)
    gen = torch.Generator("cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def decode_batch(batch: int, context: int, device: torch.device) -> ForwardBatch:
    """B sequences of `context` tokens (this step's last one included), each in its own blocks."""
    per_seq = -(-context // BLOCK)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    pos = context - 1
    attn = AttentionMetadata.build([1] * batch, [context] * batch, tables, batch, device)
    slots = [t[pos // BLOCK] * BLOCK + pos % BLOCK for t in tables]
    return ForwardBatch(
        input_ids=torch.randint(1, 1000, (batch,), device=device),
        positions=torch.full((batch,), pos, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        attn=attn,
        logits_indices=torch.arange(batch, device=device),
        sampled=[],
        logits_offsets=list(range(batch)),
        num_drafts=[0] * batch,
    )


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy GB/s, bytes read + written, best of 10."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(12):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / best / 1e9


def timed(step, steps: int, device: torch.device) -> float:
    """Median ms of `steps` runs of `step()` after 3 untimed ones."""
    times = []
    for i in range(steps + 3):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize(device)
        if i >= 3:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdserve.bench.gpu_decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    batches = [int(b) for b in args.batches.split(",")]
    max_len = max(4096, args.context)
    model = random_model(args.shape, dtype, max_len)
    cfg = model.cfg
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    per_seq = -(-args.context // BLOCK)
    kv = torch.zeros(
        (cfg.num_layers, 2, max(batches) * per_seq, BLOCK, cfg.num_kv_heads, cfg.head_dim), dtype=dtype, device=device
    )  # [L, 2, N, bs, Hkv, D]
    graphs = DecodeGraphs(model, kv, max(batches), max_len)
    copy_gbs = copy_bandwidth(device)
    rows = []
    for b in batches:
        fb = decode_batch(b, args.context, device)
        ctx = ForwardContext(fb.attn, fb.slot_mapping, kv)

        def eager(fb=fb, ctx=ctx):
            x, rope = model.embed(fb.input_ids, fb.positions)
            for layer in model.layers:
                x = layer(x, rope, ctx)
            return model.head(x, fb.logits_indices)

        eager_ms = timed(eager, args.steps, device)
        graph_ms = timed(lambda fb=fb: graphs.run(fb), args.steps, device)
        kv_bytes = b * args.context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv.element_size()
        bound_ms = (weight_bytes + kv_bytes) / (copy_gbs * 1e9) * 1e3  # each byte once, at the copy's bytes/s
        rows.append(
            {
                "batch": b,
                "context": args.context,
                "eager_ms": round(eager_ms, 3),
                "graph_ms": round(graph_ms, 3),
                "bound_ms": round(bound_ms, 3),
                "eager_of_bound": round(bound_ms / eager_ms, 3),
                "graph_of_bound": round(bound_ms / graph_ms, 3),
                "graph_tok_s": round(b / graph_ms * 1e3, 1),
            }
        )
    result = {
        "device": torch.cuda.get_device_name(device),
        "shape": args.shape,
        "dtype": args.dtype,
        "weight_gb": round(weight_bytes / 1e9, 3),
        "copy_gb_s": round(copy_gbs, 1),
        "graph_capture_s": round(graphs.capture_seconds, 2),
        "rows": rows,
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(
        f"{result['device']}: {args.shape} {args.dtype}, weights {result['weight_gb']} GB, "
        f"copy {copy_gbs:.0f} GB/s (read + written), graphs captured in {graphs.capture_seconds:.2f}s"
    )
    print("batch  context  eager ms  graph ms  bound ms  eager/bound  graph/bound  graph tok/s")
    for r in rows:
        print(
            f"{r['batch']:5d}  {r['context']:7d}  {r['eager_ms']:8.3f}  {r['graph_ms']:8.3f}  {r['bound_ms']:8.3f}"
            f"  {r['eager_of_bound']:11.1%}  {r['graph_of_bound']:11.1%}  {r['graph_tok_s']:11.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
