"""How closely pdserve serves a GGUF file against HF transformers on the file's own weights:
teacher-forced top-1 agreement at real size.

    python -m pdserve.bench.gguf_agreement --model FILE.gguf --source HF_DIR [--prompts 4] [--new 64]
        [--llama-server PATH/llama-server]

HF's model is `--source` (the folder the file was converted from: its config) with every weight
replaced by the file's, dequantized to fp32 (exact: GGUF dequantization is arithmetic on the
stored values). HF greedily continues random prompts; then, at each position of each
continuation, pdserve's engine (the file served as `pdserve serve` would: kept blocks, int8
activations unless `--activation-quantization none`) is given HF's prefix and asked for one greedy
token. Agreement is the share of positions where it picks HF's token. The prefix cache makes each
ask one row: a prompt's, in bf16 where `--prompt-linears` resolves to it (auto: on CPUs with
AVX-512 BF16), else on the int8-activation kernels as decode steps are. With `--llama-server`,
llama.cpp is asked the same on the same file (one greedy token a position, its prompt cache
reused), so a figure below 100% can be read against the other implementation that rounds its
activations to int8.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def dequantized_hf_model(source: str, file: str) -> Any:
    """`source`'s HF model (a PreTrainedModel, built from its config.json alone) with every weight
    the file's, dequantized to fp32: the source's own weights are never read (at fp32 they would
    be held twice while transformers converts them; a 4-layer Qwen3-MoE of real width ran out of
    24 GiB so)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from pdserve.engine.config import ModelConfig
    from pdserve.engine.gguf_weights import gguf_tensors
    from pdserve.modelgen.hf_state import copy_into_hf_state

    with no_init_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source), dtype=torch.float32)
    state = model.state_dict()
    filled: set[str] = set()
    with torch.no_grad():
        for name, tensor in gguf_tensors(file, ModelConfig.from_folder(file)):
            copy_into_hf_state(state, name, tensor.dequantize())
            filled.add(name)
    if model.config.tie_word_embeddings:  # the head is the table: tied now (from_config leaves it its own, unset)
        model.tie_weights()
        if model.get_output_embeddings().weight.data_ptr() != model.get_input_embeddings().weight.data_ptr():
            raise SystemExit("transformers did not tie the LM head to the embedding table")
        filled.add("lm_head.weight")
    experts = {n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    missing = set(state) - filled - experts
    if missing:
        raise SystemExit(f"the file has no values for {sorted(missing)[:8]}")
    return model.eval()


def llamacpp_agreement(server: str, file: str, prompts: list[list[int]], want: list[list[int]], threads: int) -> int:
    """Positions where llama-server, given HF's prefix, picks HF's next token (greedy)."""
    import httpx

    from pdserve.bench.servers import free_port, llamacpp_spec, running

    port = free_port()
    spec = llamacpp_spec(port, server, file, 1, 1024, threads)
    if spec.skip_reason:
        raise SystemExit(spec.skip_reason)
    base, agree = f"http://127.0.0.1:{port}", 0
    with tempfile.TemporaryDirectory() as logs, running(spec, base, Path(logs) / "llama-server.log"):
        with httpx.Client(timeout=300) as client:
            for p, w in zip(prompts, want):
                for k in range(len(w)):
                    body = {"prompt": p + w[:k], "n_predict": 1, "temperature": 0, "top_k": 1, "ignore_eos": True}
                    got = client.post(f"{base}/completion", json={**body, "cache_prompt": True, "return_tokens": True})
                    got.raise_for_status()
                    agree += got.json()["tokens"][0] == w[k]
    return agree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a GGUF file")
    ap.add_argument("--source", required=True, help="the HF folder the file was converted from")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--new", type=int, default=64, help="HF tokens a prompt: the positions measured")
    ap.add_argument("--activation-quantization", default="auto", choices=["auto", "none", "int8"])
    ap.add_argument(
        "--prompt-linears",
        default="auto",
        choices=["auto", "int8", "bf16"],
        help="how the file's blocks multiply the asks (each a prompt's one row past its cached prefix)",
    )
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--llama-server", help="llama.cpp's llama-server: asked the same on the same file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.protocol.sampling import SamplingParams

    t0 = time.perf_counter()
    hf = dequantized_hf_model(args.source, args.model)
    vocab = hf.config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    want = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=args.new,
                min_new_tokens=args.new,  # the end-of-sequence ids masked: the engine's asks below too
                do_sample=False,
                pad_token_id=0,
            )
            want.append(out[0, len(p) :].tolist())
    del hf
    print(f"HF greedy: {args.prompts} x {args.new} tokens in {time.perf_counter() - t0:.0f} s", flush=True)

    cfg = EngineConfig(
        model=args.model,
        activation_quantization=args.activation_quantization,
        prompt_linears=args.prompt_linears,
        cache=CacheConfig(block_size=16, num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512, max_model_len=512),
    )
    engine = LLMEngine(cfg, show_progress=False)
    one = SamplingParams(max_tokens=1, min_tokens=1, temperature=0.0)  # as HF's min_new_tokens
    agree = total = 0
    for i, (p, w) in enumerate(zip(prompts, want)):
        got = [engine.generate([p + w[:k]], one)[0][0] for k in range(len(w))]
        agree += sum(a == b for a, b in zip(got, w))
        differ = [(k, a, b) for k, (a, b) in enumerate(zip(got, w)) if a != b]
        if differ:
            print(f"  differ at (position, pdserve, HF): {differ[:8]}", flush=True)
        total += len(w)
        print(f"prompt {i + 1}/{len(prompts)}: {agree}/{total} positions agree so far", flush=True)
    tag = engine.model_config.weights_tag
    print(f"{args.model} ({tag}): teacher-forced top-1 agreement with HF {agree}/{total} ({agree / total:.1%})")
    if args.llama_server:
        del engine
        theirs = llamacpp_agreement(args.llama_server, args.model, prompts, want, args.threads)
        print(
            f"llama.cpp on the same file: teacher-forced top-1 agreement with HF {theirs}/{total} ({theirs / total:.1%})"
        )


if __name__ == "__main__":
    main()
