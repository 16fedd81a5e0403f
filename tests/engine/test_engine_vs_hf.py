"""Greedy output equals HF transformers token for token (fp32) in every engine mode."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import PREFILLED, LLMEngine
from pdserve.protocol.sampling import SamplingParams
from tests.conftest import hf_greedy, random_prompts

LENGTHS = [5, 17, 33, 64, 3]
MAX_NEW = 20
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


def make_engine(model, **kw) -> LLMEngine:
    cache = CacheConfig(
        block_size=kw.pop("block_size", 16),
        num_blocks=kw.pop("num_blocks", 128),
        kv_cache_dtype=kw.pop("kv_cache_dtype", "auto"),
        kv_offload_dir=kw.pop("kv_offload_dir", None),
        kv_offload_bytes=kw.pop("kv_offload_bytes", 1 << 30),
    )
    sched = SchedulerConfig(
        max_num_seqs=kw.pop("max_num_seqs", 16),
        max_num_batched_tokens=kw.pop("max_num_batched_tokens", 512),
        max_model_len=kw.pop("max_model_len", 256),
    )
    return LLMEngine(EngineConfig(model=str(model), dtype="float32", cache=cache, scheduler=sched), show_progress=False)


def expected(model, prompts):
    return [hf_greedy(str(model), tuple(p), MAX_NEW) for p in prompts]


def prompts_for(engine):
    return random_prompts(engine.model_config.vocab_size, LENGTHS, seed=3)


def test_batch_of_one(tiny_model):
    engine = make_engine(tiny_model)
    prompts = prompts_for(engine)
    for p, want in zip(prompts, expected(tiny_model, prompts)):
        assert engine.generate([p], GREEDY)[0] == want
    engine.pool.assert_all_free()


def test_ragged_batch_of_mixed_lengths(tiny_model):
    engine = make_engine(tiny_model)
    prompts = prompts_for(engine)
    assert engine.generate(prompts, GREEDY) == expected(tiny_model, prompts)
    engine.pool.assert_all_free()


def test_decode_batches_of_up_to_32_rows(tiny_model):
    """24 sequences decoding together: steps of 17-32 rows, which run in the few-row panel GEMM and
    the one-call driver where it built with AVX-512 (`panel_gemm.few_rows()` 32), oneDNN else."""
    engine = make_engine(tiny_model, max_num_seqs=32, num_blocks=256)
    prompts = random_prompts(engine.model_config.vocab_size, [3 + 5 * i for i in range(24)], seed=11)
    assert engine.generate(prompts, GREEDY) == expected(tiny_model, prompts)
    engine.pool.assert_all_free()


def test_chunked_prefill_tiny_budget(tiny_model):
    # 7-token budget with 4-token blocks: chunks straddle blocks and attend to earlier chunks.
    engine = make_engine(tiny_model, max_num_batched_tokens=7, block_size=4, num_blocks=256)
    prompts = prompts_for(engine)
    assert engine.generate(prompts, GREEDY) == expected(tiny_model, prompts)
    engine.pool.assert_all_free()


def test_preemption_gives_same_output(tiny_model):
    # 160 token slots for ~220 tokens of work: later arrivals get preempted and recomputed.
    engine = make_engine(tiny_model, block_size=4, num_blocks=40, max_model_len=160)
    prompts = prompts_for(engine)
    preempted = []
    outs: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
        outs[f"r{i}"] = []
    while engine.has_work():
        sched = engine.schedule()
        preempted += [s.request_id for s in sched.preempted]
        for o in engine.execute(sched):
            outs[o.request_id] += o.new_token_ids
        engine.pool.check_integrity()
    assert preempted, "the pool was meant to be small enough to force preemption"
    assert [outs[f"r{i}"] for i in range(len(prompts))] == expected(tiny_model, prompts)
    engine.pool.assert_all_free()


def test_prefill_engine_hands_kv_to_decode_engine(tiny_model):
    """Disaggregation at engine level: P prefills (chunked), blocks are copied into D's pool."""
    prefill = make_engine(tiny_model, max_num_batched_tokens=24, block_size=4, num_blocks=256)
    decode = make_engine(tiny_model, block_size=4, num_blocks=256)
    prompts = prompts_for(prefill)
    outs = {}
    for i, p in enumerate(prompts):
        prefill.add_request(f"r{i}", p, GREEDY, prefill_only=True)
    while prefill.has_work():
        sched = prefill.schedule()
        tables = {c.seq.request_id: list(c.seq.block_table) for c in sched.chunks}
        for o in prefill.execute(sched):
            assert o.finish_reason in (PREFILLED, "stop")
            src = tables[o.request_id]
            dst = decode.pool.allocate(len(src))
            decode.kv_cache[:, :, dst] = prefill.kv_cache[:, :, src]  # [L, 2, n, bs, H, D]
            done = decode.add_prefilled(o.request_id, o.seq.prompt_token_ids, o.new_token_ids[0], None, GREEDY, dst)
            outs[o.request_id] = list(o.new_token_ids)
            assert all(d.finish_reason == "stop" for d in done)
    prefill.pool.assert_all_free()
    while decode.has_work():
        for o in decode.step():
            outs[o.request_id] += o.new_token_ids
    assert [outs[f"r{i}"] for i in range(len(prompts))] == expected(tiny_model, prompts)
    decode.pool.assert_all_free()


def test_seeded_sampling_is_reproducible_across_batches(tiny_llama):
    engine = make_engine(tiny_llama)
    prompts = prompts_for(engine)
    sp = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=1234)
    alone = engine.generate([prompts[1]], sp)[0]
    together = engine.generate(prompts, sp)[1]
    assert alone == together
    engine.pool.assert_all_free()


def test_refuses_unsupported_architecture(tmp_path, tiny_llama):
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="supported: LlamaForCausalLM"):  # auto: transformers serves it
        LLMEngine(EngineConfig(model=str(bad), dtype="float32", model_impl="native"), show_progress=False)


def test_refuses_kv_cache_that_cannot_hold_one_sequence(tiny_llama):
    with pytest.raises(ValueError, match="KV cache too small"):
        make_engine(tiny_llama, num_blocks=3, block_size=4, max_model_len=64)


def test_loader_rejects_missing_and_leftover_weights(tmp_path, tiny_llama):
    import shutil

    from safetensors.torch import load_file, save_file

    for mutate, msg in [
        (lambda d: d.pop("model.norm.weight"), "missing weights"),
        (lambda d: d.__setitem__("model.extra.weight", torch.zeros(2)), "unexpected"),
        (lambda d: d.__setitem__("model.norm.weight", torch.zeros(3)), "shape"),
    ]:
        folder = tmp_path / msg.replace(" ", "_")
        shutil.copytree(tiny_llama, folder)
        files = list(folder.glob("*.safetensors"))
        assert len(files) == 1
        tensors = load_file(str(files[0]))
        mutate(tensors)
        save_file(tensors, str(files[0]), metadata={"format": "pt"})
        with pytest.raises(ValueError, match=msg):
            make_engine(folder)


@pytest.mark.parametrize(
    "arch,overrides", [("llama", {"tie_word_embeddings": False}), ("qwen2", {"tie_word_embeddings": False})]
)
def test_untied_embeddings_match_hf(tmp_path, arch, overrides):
    from pdserve.modelgen.make_model import make_model

    model = make_model(tmp_path / arch, "tiny", arch, seed=7, quiet=True, **overrides)
    engine = make_engine(model)
    prompts = prompts_for(engine)
    assert engine.generate(prompts, GREEDY) == expected(model, prompts)


def test_mistral_architecture_matches_hf(tmp_path, tiny_llama):
    """Mistral = Llama without qkv bias plus a sliding window; within the window it is exact."""
    import json
    import shutil

    folder = tmp_path / "mistral"
    shutil.copytree(tiny_llama, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=512)
    (folder / "config.json").write_text(json.dumps(cfg))
    engine = make_engine(folder)
    assert engine.max_model_len <= 512
    prompts = prompts_for(engine)
    assert engine.generate(prompts, GREEDY) == expected(folder, prompts)
