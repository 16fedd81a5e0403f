"""Tensor parallelism in the engine (engine/parallel/): greedy output at TP=2 equals HF's (fp32)
and TP=1's, for Llama with GQA (2 KV heads split over 2 ranks) and Qwen2 with one KV head
(replicated on both ranks), through the engine's modes: a batch on a warm prefix cache, chunked
prefill, preemption, and copy-on-write of shared blocks (n > 1)."""

from __future__ import annotations

import pytest

from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.engine.parallel.shard import TensorParallelShard
from pdserve.protocol.sampling import SamplingParams
from tests.conftest import hf_greedy, random_prompts
from tests.engine.tensor_parallel_models import single_kv_head_qwen2, tp_engine

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


@pytest.fixture(scope="module")
def one_kv_head(models_dir):
    return single_kv_head_qwen2(models_dir / "tiny-qwen2-1kv")


@pytest.fixture(scope="module", params=["tiny_llama", "one_kv_head"])
def model(request):
    return request.getfixturevalue(request.param)


def prompts_for(vocab: int) -> list[list[int]]:
    """Mixed lengths; the last two share a 20-token prefix with the third (prefix cache hits)."""
    base = random_prompts(vocab, [5, 17, 33, 24, 3], seed=7)
    return base + [base[2][:20] + base[4], base[2][:20] + base[1][:9]]


def expected(model, prompts):
    return [hf_greedy(str(model), tuple(p), MAX_NEW) for p in prompts]


def run_with_preemption(engine: LLMEngine, prompts: list[list[int]]) -> tuple[list[list[int]], list[str]]:
    outs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    preempted: list[str] = []
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    while engine.has_work():
        sched = engine.schedule()
        preempted += [s.request_id for s in sched.preempted]
        for o in engine.execute(sched):
            outs[o.request_id] += o.new_token_ids
        engine.pool.check_integrity()
    return [outs[f"r{i}"] for i in range(len(prompts))], preempted


def test_tp2_greedy_equals_hf_and_tp1(model):
    prompts = prompts_for(ModelConfig.from_folder(model).vocab_size)
    want = expected(model, prompts)
    single = tp_engine(model, 1)
    assert single.generate(prompts, GREEDY) == want
    engine = tp_engine(model, 2)
    try:
        assert engine.kv_cache.shape[-2] == 1  # this rank's KV heads: 2 split over 2, or 1 replicated
        assert engine.generate(prompts, GREEDY) == want  # one batch
        hits = engine.scheduler.prefix_hit_tokens
        assert engine.generate(prompts, GREEDY) == want  # again, on the warm prefix cache
        assert engine.scheduler.prefix_hit_tokens > hits, "the second pass was meant to hit the prefix cache"
        pair = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, n=2)  # members share the prompt's last block
        copies = 0
        schedule = engine.schedule

        def counting_schedule():
            nonlocal copies
            sched = schedule()
            copies += len(sched.block_copies)
            return sched

        engine.schedule = counting_schedule  # type: ignore[method-assign]
        assert engine.generate_choices(prompts[:3], pair) == [[w, w] for w in want[:3]]
        assert copies, "the members were meant to copy their shared last block (copy-on-write on every rank)"
        engine.pool.assert_all_free()
    finally:
        engine.close()


def test_tp2_chunked_prefill_and_preemption_equal_hf(model):
    prompts = prompts_for(ModelConfig.from_folder(model).vocab_size)
    want = expected(model, prompts)
    chunked = tp_engine(model, 2, max_num_batched_tokens=7)  # every prompt but the shortest in chunks
    try:
        assert chunked.generate(prompts, GREEDY) == want
        chunked.pool.assert_all_free()
    finally:
        chunked.close()
    small = tp_engine(model, 2, num_blocks=24, max_model_len=96)  # 96 token slots for ~230 tokens of work
    try:
        outs, preempted = run_with_preemption(small, prompts)
        assert preempted, "the pool was meant to be small enough to force preemption"
        assert outs == want
        small.pool.assert_all_free()
    finally:
        small.close()


def test_ranks_hold_their_slices_of_the_weights(tiny_llama):
    """Rank 0 of 2 loads q heads 0-1, KV head 0, the first half of the MLP and vocabulary."""
    import torch
    from safetensors.torch import load_file

    from pdserve.engine.weights import load_weights

    cfg = ModelConfig.from_folder(tiny_llama)
    (hf,) = [load_file(str(f)) for f in tiny_llama.glob("*.safetensors")]

    class Rank0:  # what LlamaForCausalLM reads of its group
        shard = TensorParallelShard(0, 2)

        def all_reduce(self, x):
            return x

    model = LlamaForCausalLM(cfg, 64, Rank0())  # type: ignore[arg-type]
    load_weights(model, tiny_llama, show_progress=False)
    d, attn = cfg.head_dim, model.decoder_layers[0].self_attn
    q, k, v = attn.qkv_proj.weight.split([2 * d, d, d])
    assert torch.equal(q, hf["model.layers.0.self_attn.q_proj.weight"][: 2 * d])
    assert torch.equal(k, hf["model.layers.0.self_attn.k_proj.weight"][:d])
    assert torch.equal(v, hf["model.layers.0.self_attn.v_proj.weight"][:d])
    assert torch.equal(attn.o_proj.weight, hf["model.layers.0.self_attn.o_proj.weight"][:, : 2 * d])
    half = cfg.intermediate_size // 2
    mlp = model.decoder_layers[0].mlp
    assert torch.equal(mlp.gate_up_proj.weight[half:], hf["model.layers.0.mlp.up_proj.weight"][:half])
    assert torch.equal(mlp.down_proj.weight, hf["model.layers.0.mlp.down_proj.weight"][:, :half])
    assert torch.equal(model.embed_tokens.weight, hf["model.embed_tokens.weight"][: cfg.vocab_size // 2])


def test_shards_cover_heads_and_replicate_a_lone_kv_head(tiny_llama):
    cfg = ModelConfig.from_folder(tiny_llama)  # 4 heads, 2 KV heads
    assert [TensorParallelShard(r, 2).kv_heads(cfg) for r in range(2)] == [(0, 1), (1, 2)]
    assert [TensorParallelShard(r, 4).kv_heads(cfg) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [TensorParallelShard(r, 4).heads(cfg) for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        TensorParallelShard(0, 3).check(cfg)


def test_refuses_what_is_not_built(tiny_llama):
    for kw, msg in [
        ({"quantization": "int8"}, "quantization"),
        ({"model_impl": "transformers"}, "native model path"),
        ({"device": "cuda"}, "CPU"),
        ({"tensor_parallel_size": 0}, ">= 1"),
    ]:
        with pytest.raises(ValueError, match=msg):
            EngineConfig(model=str(tiny_llama), **{"tensor_parallel_size": 2, **kw})
    with pytest.raises(ValueError, match="does not divide"):
        tp_engine(tiny_llama, 8)  # 4 heads: refused before any rank starts


def test_cli_flag_reaches_every_role_and_a_tp_prefill_worker_runs_one_lane(tiny_llama):
    import argparse

    from pdserve.cli.engine_args import add_engine_args, engine_config

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", str(tiny_llama), "--tensor-parallel-size", "2"])
    for role in ("colocated", "prefill", "decode"):
        assert engine_config(args, role).tensor_parallel_size == 2
    args.lanes = 2  # (`pdserve prefill --lanes 2`)
    with pytest.raises(SystemExit, match="runs one lane"):
        engine_config(args, "prefill")


def test_tp2_with_ngram_speculation_equals_hf(tiny_llama):
    """Verification rows (several logits rows per sequence) through the TP runner's gathered LM
    head: greedy output still HF's, with drafts both proposed and accepted."""
    from pdserve.engine.spec.config import SpeculativeConfig

    spec = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 4}')
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_llama),
            dtype="float32",
            tensor_parallel_size=2,
            speculative=spec,
            cache=CacheConfig(num_blocks=128),
            scheduler=SchedulerConfig(max_model_len=256),
        ),
        show_progress=False,
    )
    try:
        prompts = random_prompts(engine.model_config.vocab_size, [9, 17, 30], seed=5)
        got = engine.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0))
        assert got == [hf_greedy(str(tiny_llama), tuple(p), 40) for p in prompts]
        stats = engine.speculator.stats if engine.speculator else None
        assert stats is not None and stats.num_accepted_tokens > 0
        engine.pool.assert_all_free()
    finally:
        engine.close()


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_tp2_gemma_equals_hf(models_dir, family):
    """Gemma's extra norms, GeLU MLP, soft-capping (2), q/k norms and local rope (3) and 32-token
    sliding windows, sharded over two ranks: greedy output still HF's, chunked prefill too."""
    from pdserve.modelgen.make_model import make_model
    from tests.engine.test_sliding_window_models import FAMILIES
    from tests.engine.test_sliding_window_models import prompts_for as windowed_prompts

    model = make_model(models_dir / f"swa-{family}", quiet=True, **FAMILIES[family])
    prompts = windowed_prompts(ModelConfig.from_folder(model).vocab_size)
    want = expected(model, prompts)
    for budget in (512, 13):
        engine = tp_engine(model, 2, block_size=16, num_blocks=128, max_num_batched_tokens=budget)
        try:
            assert engine.kv_cache.shape[-2] == ModelConfig.from_folder(model).num_kv_heads // 2
            assert engine.generate(prompts, GREEDY) == want
            engine.pool.assert_all_free()
        finally:
            engine.close()
