"""The model maker writes real HF folders; the loader reads sharded ones and real-style configs."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve.engine.config import ModelConfig
from pdserve.modelgen.make_model import make_model


def digest(folder):
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(folder.glob("*.safetensors")))).hexdigest()


def test_deterministic_bytes(tmp_path):
    a = make_model(tmp_path / "a", "tiny", "llama", seed=3, quiet=True)
    b = make_model(tmp_path / "b", "tiny", "llama", seed=3, quiet=True)
    c = make_model(tmp_path / "c", "tiny", "llama", seed=4, quiet=True)
    assert digest(a) == digest(b) != digest(c)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()


def test_folder_loads_in_transformers_with_tokenizer_and_chat_template(tiny_qwen2):
    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    text = "Hello wörld 🙂 日本語"
    assert tok.decode(tok.encode(text)) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat.endswith("<|im_start|>assistant\n")
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2)
    cfg = json.loads((tiny_qwen2 / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["tie_word_embeddings"]
    assert model.model.layers[0].self_attn.q_proj.bias is not None


def test_logits_are_well_spread(tiny_llama):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    gaps = []
    with torch.no_grad():
        for seed in range(8):
            ids = torch.randint(3, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(seed))
            top2 = model(ids).logits[0, -1].topk(2).values
            gaps.append(float(top2[0] - top2[1]))
    assert sorted(gaps)[len(gaps) // 2] > 1e-3


def test_sharded_folder_loads_identically(tmp_path, tiny_llama):
    from tests.engine.test_engine_vs_hf import GREEDY, make_engine, prompts_for

    sharded = make_model(tmp_path / "sharded", "tiny", "llama", seed=1, max_shard_size="100KB", quiet=True)
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 1
    a, b = make_engine(tiny_llama), make_engine(sharded)
    prompts = prompts_for(a)[:2]
    assert a.generate(prompts, GREEDY) == b.generate(prompts, GREEDY)


def test_config_reads_rope_scaling_and_refuses_unknown_types(tmp_path, tiny_llama):
    import shutil

    folder = tmp_path / "scaled"
    shutil.copytree(tiny_llama, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = 500000.0
    cfg["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    mc = ModelConfig.from_folder(folder)
    assert mc.rope.kind == "llama3" and mc.rope.theta == 500000.0 and mc.rope.factor == 8.0
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported rope scaling"):
        ModelConfig.from_folder(folder, "native")
    assert ModelConfig.from_folder(folder).impl == "transformers"  # auto: transformers' rope code serves it


def test_llama3_rope_matches_transformers(tmp_path):
    """Our RoPE tables (incl. llama3 scaling) equal HF's for the same config."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from pdserve.engine.config import RopeConfig
    from pdserve.engine.models.rotary import RotaryEmbedding

    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    hf_cfg = LlamaConfig(hidden_size=64, num_attention_heads=2, rope_parameters=rope, max_position_embeddings=512)
    hf = LlamaRotaryEmbedding(hf_cfg)
    pos = torch.arange(300).unsqueeze(0)
    cos, sin = hf(torch.zeros(1, 300, 32), pos)
    ours = RotaryEmbedding(RopeConfig(theta=500000.0, kind="llama3", factor=8.0, original_max_position=64), 32, 512)
    assert torch.allclose(ours.cos[:300], cos[0], atol=1e-6) and torch.allclose(ours.sin[:300], sin[0], atol=1e-6)
