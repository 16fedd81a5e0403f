"""Phi-3: fused qkv_proj / gate_up_proj checkpoints, partial rotary (Phi-4-mini: 0.75) and longrope
scaling; greedy output == HF generate (fp32). Longrope is served up to
original_max_position_embeddings, where HF uses the short factors (ModelConfig.max_context)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.config import ModelConfig
from pdserve.engine.models.rotary import RotaryEmbedding
from pdserve.kernels import decode_layers
from tests.conftest import hf_greedy, random_prompts
from tests.engine import family_checks

ORIGINAL = 64  # the tiny longrope model's original_max_position_embeddings (max_position_embeddings 1024)


@pytest.fixture(scope="module")
def tiny_phi3(models_dir) -> Path:
    """Phi-3-mini's layout: fused weights, full rotary, plain RoPE."""
    from pdserve.modelgen.make_model import make_model

    return make_model(models_dir / "tiny-phi3", preset="tiny", arch="phi3", seed=6, quiet=True)


@pytest.fixture(scope="module")
def tiny_phi4_mini(models_dir) -> Path:
    """Phi-4-mini's: rotary over 3/4 of each head (12 of 16 dims), longrope (attention factor > 1)."""
    from pdserve.modelgen.make_model import make_model

    return make_model(
        models_dir / "tiny-phi4-mini",
        preset="tiny",
        arch="phi3",
        seed=7,
        quiet=True,
        hf_config={"partial_rotary_factor": 0.75, "original_max_position_embeddings": ORIGINAL},
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0, 1.05, 1.3, 1.8, 2.5, 3.0],
            "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 24.0],
        },
    )


@pytest.fixture(params=["tiny_phi3", "tiny_phi4_mini"])
def phi_model(request) -> Path:
    return request.getfixturevalue(request.param)


def test_config_reads_phi3_and_phi4_mini(tiny_phi3, tiny_phi4_mini):
    plain = ModelConfig.from_folder(tiny_phi3)
    assert (plain.architecture, plain.rotary_dims, plain.rope.kind, plain.max_context) == (
        "Phi3ForCausalLM",
        16,
        "default",
        1024,
    )
    mini = ModelConfig.from_folder(tiny_phi4_mini)
    assert (mini.rotary_dims, mini.rope.kind, mini.rope.factor, mini.max_context) == (12, "longrope", 16.0, ORIGINAL)
    assert mini.rope.attention_factor > 1.0


def test_longrope_tables_match_transformers(tiny_phi4_mini):
    """cos/sin (short factors, attention factor, 12 rotary dims) equal HF's below the original length."""
    from transformers import AutoConfig
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    hf = Phi3RotaryEmbedding(AutoConfig.from_pretrained(tiny_phi4_mini))
    pos = torch.arange(ORIGINAL).unsqueeze(0)  # [1, P]: seq_len == original, HF's short factors
    cos, sin = hf(torch.zeros(1, ORIGINAL, 16), pos)  # [1, P, 12]
    cfg = ModelConfig.from_folder(tiny_phi4_mini)
    ours = RotaryEmbedding(cfg.rope, cfg.rotary_dims, cfg.max_context)
    assert ours.cos.shape == cos[0].shape
    assert torch.equal(ours.cos, cos[0]) and torch.equal(ours.sin, sin[0])


def test_batch_with_prefix_cache_matches_hf(phi_model):
    engine = family_checks.check_batch_with_prefix_cache(phi_model)
    partial = engine.model_config.rotary_dims < engine.model_config.head_dim
    if partial:
        assert engine.runner.decode_layers is None  # partial rotary: per-layer torch path
    elif decode_layers.available():
        assert engine.runner.decode_layers is not None  # Phi-3-mini's layer is Llama's: the C driver


def test_chunked_prefill_matches_hf(phi_model):
    family_checks.check_chunked_prefill(phi_model)


def test_prefill_to_decode_handoff_matches_hf(phi_model):
    family_checks.check_prefill_to_decode_handoff(phi_model)


def test_longrope_each_side_of_original_length(tiny_phi4_mini):
    """A prompt just below original_max_position_embeddings runs (chunked) to the limit with HF's
    tokens (short factors throughout); one past it is refused, as HF would switch to long factors."""
    engine = family_checks.make_engine(tiny_phi4_mini, max_num_batched_tokens=16, max_model_len=1024)
    assert engine.max_model_len == ORIGINAL
    below, above = random_prompts(engine.model_config.vocab_size, [ORIGINAL - 5, ORIGINAL + 1], seed=9)
    got = engine.generate([below], family_checks.GREEDY)[0]
    assert got == hf_greedy(str(tiny_phi4_mini), tuple(below), 5)  # stops at the limit: 5 tokens
    with pytest.raises(ValueError, match="longrope's original_max_position_embeddings"):
        engine.add_request("long", above, family_checks.GREEDY)
    engine.pool.assert_all_free()
