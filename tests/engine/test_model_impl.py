"""`--model-impl auto|native|transformers`: which path serves a folder, what is refused (naming
why), and that the transformers path equals the native one on a Llama folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.scheduler import ScheduledChunk, SchedulerOutput
from pdserve.engine.sequence import Sequence
from tests.conftest import random_prompts
from tests.engine import family_checks


@pytest.fixture(scope="module")
def tiny_olmo2(models_dir) -> Path:
    from pdserve.modelgen.make_model import make_model

    return make_model(models_dir / "impl-olmo2", preset="tiny", arch="olmo2", seed=2, quiet=True)


def _engine(model: Path, impl: str) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(model),
            dtype="float32",
            model_impl=impl,
            cache=CacheConfig(block_size=4, num_blocks=128),
            scheduler=SchedulerConfig(max_num_batched_tokens=64, max_model_len=256),
        ),
        show_progress=False,
    )


def test_auto_is_native_where_native_exists(tiny_llama, tiny_olmo2):
    assert ModelConfig.from_folder(tiny_llama).impl == "native"
    assert ModelConfig.from_folder(tiny_olmo2).impl == "transformers"
    assert ModelConfig.from_folder(tiny_llama, "transformers").impl == "transformers"


def test_native_refuses_an_architecture_it_lacks(tiny_olmo2):
    with pytest.raises(ValueError, match=r"--model-impl native: unsupported architecture \['Olmo2ForCausalLM'\]"):
        ModelConfig.from_folder(tiny_olmo2, "native")
    with pytest.raises(ValueError, match="model_impl must be one of"):
        ModelConfig.from_folder(tiny_olmo2, "vllm")


def test_transformers_on_llama_equals_native_and_hf(tiny_llama):
    prompts = random_prompts(512, [5, 19, 33], seed=3)
    native = _engine(tiny_llama, "native").generate(prompts, family_checks.GREEDY)
    hf_path = _engine(tiny_llama, "transformers")
    assert hf_path.model_config.fingerprint(torch.float32) != ModelConfig.from_folder(tiny_llama).fingerprint(
        torch.float32
    ), "pools of the two paths must not share KV"
    assert hf_path.generate(prompts, family_checks.GREEDY) == native == family_checks.expected(tiny_llama, prompts)


def test_quantization_is_refused_on_the_transformers_path(tiny_olmo2):
    with pytest.raises(ValueError, match="--quantization is served on the native model path only"):
        LLMEngine(EngineConfig(model=str(tiny_olmo2), dtype="float32", quantization="int8"), show_progress=False)


def test_each_layer_reports_its_kv_stored_in_order(tiny_olmo2):
    """Prefill workers stream a layer's KV from `on_layer_stored`: called once per layer, in order,
    after the layer's KV is in the pool."""
    engine = _engine(tiny_olmo2, "transformers")
    seq = Sequence("r", [5, 6, 7, 8, 9, 10], 6, family_checks.GREEDY)
    seq.block_table = engine.pool.allocate(2)
    stored: list[tuple[int, list[bool]]] = []
    slots = torch.tensor([seq.block_table[i // 4] * 4 + i % 4 for i in range(6)])
    runner = engine.runner

    def on_stored(layer: int) -> None:
        kv = runner.kv_cache.flatten(2, 3)[:, :, slots]  # [L, 2, 6, Hkv, D]
        stored.append((layer, [bool((kv[i] != 0).all()) for i in range(kv.shape[0])]))  # which layers hold KV

    fp = runner.begin(SchedulerOutput(prefills=[ScheduledChunk(seq, 6)]), on_stored)
    runner.run_layers(fp, 1)
    runner.run_layers(fp)
    assert stored == [(0, [True, False]), (1, [True, True])]


def _folder(tmp_path: Path, cfg: dict) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


BASE = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, eos_token_id=1)


@pytest.mark.parametrize(
    ("cfg", "why"),
    [
        ({"architectures": ["T5ForConditionalGeneration"], "is_encoder_decoder": True}, "encoder-decoder"),
        ({"architectures": ["LlavaForConditionalGeneration"], "vision_config": {}}, "multimodal"),
        ({"architectures": ["BertForMaskedLM"], "model_type": "bert"}, "not a causal language model"),
        ({"architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": 50.0}, "soft-capping"),
        ({"architectures": ["BloomForCausalLM"], "model_type": "bloom"}, "alibi"),
        ({"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "dynamic"}}, "dynamic NTK"),
        (
            {"architectures": ["Gemma3ForCausalLM"], "layer_types": ["sliding_attention", "full_attention"]},
            "different attention types",
        ),
    ],
)
def test_what_cannot_work_is_refused_naming_why(tmp_path, cfg, why):
    """Through transformers (Gemma 2/3 are native under auto: models/gemma.py)."""
    with pytest.raises(ValueError, match=why):
        ModelConfig.from_folder(_folder(tmp_path, {**BASE, **cfg}), "transformers")


def test_a_model_type_transformers_cannot_build_is_refused_at_load(tmp_path):
    folder = _folder(tmp_path, {**BASE, "architectures": ["MadeUpForCausalLM"], "model_type": "made_up"})
    assert ModelConfig.from_folder(folder).impl == "transformers"
    with pytest.raises(ValueError, match="made_up"):
        LLMEngine(EngineConfig(model=str(folder), dtype="float32"), show_progress=False)


def test_a_sliding_window_caps_the_context_so_it_never_cuts(tmp_path):
    cfg = {**BASE, "architectures": ["Olmo2ForCausalLM"], "sliding_window": 64, "max_position_embeddings": 4096}
    mc = ModelConfig.from_folder(_folder(tmp_path, cfg))
    assert (mc.impl, mc.max_context) == ("transformers", 64)


def test_layers_of_different_steps_run_on_threads_at_once(tiny_olmo2):
    """Prefill lanes run layers of different steps on their own threads at the same time: each
    step's logits equal what it gives alone."""
    import threading

    engine = _engine(tiny_olmo2, "transformers")
    runner = engine.runner
    seqs = []
    for i, n in enumerate((9, 14)):
        seq = Sequence(f"r{i}", random_prompts(512, [n], seed=i)[0], n, family_checks.GREEDY)
        seq.block_table = engine.pool.allocate(4)
        seqs.append(seq)

    def logits(seq: Sequence) -> torch.Tensor:
        fp = runner.begin(SchedulerOutput(prefills=[ScheduledChunk(seq, seq.num_tokens)]))
        for _ in range(len(runner.model.layers)):
            runner.run_layers(fp, 1)
        out = runner.logits(fp)
        assert out is not None
        return out

    alone = [logits(s) for s in seqs]
    results: dict[int, list[bool]] = {0: [], 1: []}

    def lane(i: int) -> None:
        for _ in range(30):
            results[i].append(torch.equal(logits(seqs[i]), alone[i]))

    threads = [threading.Thread(target=lane, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {0: [True] * 30, 1: [True] * 30}


def test_the_flag_reaches_the_engine_config(tiny_llama):
    import argparse

    from pdserve.cli.engine_args import add_engine_args, engine_config

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config(parser.parse_args(["--model", str(tiny_llama)]), "colocated").model_impl == "auto"
    args = parser.parse_args(["--model", str(tiny_llama), "--model-impl", "transformers"])
    assert engine_config(args, "colocated").model_impl == "transformers"
