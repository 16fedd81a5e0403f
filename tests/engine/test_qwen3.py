"""Qwen3: q/k norm, explicit head_dim, no qkv bias; greedy output == HF generate (fp32)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pdserve.engine.config import ModelConfig
from tests.engine import family_checks


@pytest.fixture(scope="module")
def tiny_qwen3(models_dir) -> Path:
    """head_dim 32 with hidden 64 and 4 heads: q is twice as wide as the hidden state, as in Qwen3."""
    from pdserve.modelgen.make_model import make_model

    return make_model(models_dir / "tiny-qwen3", preset="tiny", arch="qwen3", seed=4, quiet=True)


def test_config_reads_qwen3(tiny_qwen3):
    cfg = ModelConfig.from_folder(tiny_qwen3)
    assert (cfg.architecture, cfg.head_dim, cfg.qk_norm, cfg.qkv_bias, cfg.o_bias) == (
        "Qwen3ForCausalLM",
        32,
        True,
        False,
        False,
    )
    assert cfg.head_dim * cfg.num_heads != cfg.hidden_size


def test_batch_with_prefix_cache_matches_hf(tiny_qwen3):
    engine = family_checks.check_batch_with_prefix_cache(tiny_qwen3)
    assert engine.runner.decode_layers is not None  # q/k norm runs in the C decode driver too


def test_chunked_prefill_matches_hf(tiny_qwen3):
    family_checks.check_chunked_prefill(tiny_qwen3)


def test_prefill_to_decode_handoff_matches_hf(tiny_qwen3):
    family_checks.check_prefill_to_decode_handoff(tiny_qwen3)


def test_attention_bias_biases_qkv_and_o(models_dir):
    from pdserve.modelgen.make_model import make_model

    folder = make_model(
        models_dir / "tiny-qwen3-bias", arch="qwen3", seed=5, quiet=True, hf_config={"attention_bias": True}
    )
    cfg = ModelConfig.from_folder(folder)
    assert cfg.qkv_bias and cfg.o_bias
    family_checks.check_chunked_prefill(folder)


@pytest.mark.parametrize(("use", "windows"), [(True, (0, 48)), (False, ())])
def test_sliding_window_is_served_per_layer_as_for_qwen2(tmp_path, tiny_qwen3, use, windows):
    """Windowed from layer max_window_layers on (no more capping of the context: the attention
    kernels take each layer's window; tests/engine/test_sliding_window_models.py checks outputs)."""
    folder = tmp_path / "swa"
    shutil.copytree(tiny_qwen3, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(use_sliding_window=use, sliding_window=48, max_window_layers=1)
    cfg.pop("layer_types", None)
    (folder / "config.json").write_text(json.dumps(cfg))
    mc = ModelConfig.from_folder(folder)
    assert (mc.layer_windows, mc.max_context) == (windows, 1024)
