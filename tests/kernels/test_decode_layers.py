"""The fused decode layers (kernels/cpu_decode_layers.c) give bit for bit the per-op path's hidden
states and KV, and take only the steps they are for."""

from __future__ import annotations

import pytest
import torch

from pdserve.env import reload as reload_env
from pdserve.kernels import decode_layers
from pdserve.kernels.panel_gemm import few_rows
from pdserve.kernels.quant_gemm import FEW_ROWS as QUANT_FEW_ROWS
from tests.conftest import random_prompts
from tests.engine.test_engine_vs_hf import GREEDY, make_engine

pytestmark = pytest.mark.skipif(not decode_layers.available(), reason="the C kernels did not build")
QUANT_ROWS = min(QUANT_FEW_ROWS.values())  # a quantized stack's driver takes steps up to this many rows


def engine_at_decode(model, batch: int, kv_cache_dtype: str = "auto"):
    """An engine whose `batch` requests (prompts of varied lengths) have all reached decode."""
    engine = make_engine(model, max_num_seqs=max(32, batch), num_blocks=256, kv_cache_dtype=kv_cache_dtype)
    return to_decode(engine, batch)


def to_decode(engine, batch: int):
    lengths = [3 + 7 * i % 50 for i in range(batch)]
    for i, p in enumerate(random_prompts(engine.model_config.vocab_size, lengths, seed=batch)):
        engine.add_request(f"r{i}", p, GREEDY)
    while engine.scheduler.waiting or any(s.num_uncomputed > 1 for s in engine.scheduler.running):
        engine.step()
    engine.step()  # one decode step, so the KV holds decoded tokens too
    return engine


def fused(engine, fp) -> torch.Tensor | None:
    """The driver on the layers the engine's runner described at start-up."""
    assert engine.runner.decode_layers is not None  # fp32 CPU, panels built: described
    return engine.runner.model.fused_decode(engine.runner.decode_layers, fp.x, fp.rope, fp.ctx)


def per_op_layers(model, fp) -> torch.Tensor:
    x = fp.x
    for layer in model.layers:
        x = layer(x, fp.rope, fp.ctx)
    return x


def assert_fused_equals_per_op(engine, fp) -> None:
    """The driver's hidden states and stored K, V equal, bit for bit, the per-op path's for step `fp`
    (the K, V are really written: the pool changes)."""
    model, kv = engine.runner.model, engine.runner.kv_cache
    kv_before = kv.clone()
    out = fused(engine, fp)
    assert out is not None
    kv_fused = kv.clone()
    kv.copy_(kv_before)
    assert torch.equal(out, per_op_layers(model, fp))
    assert torch.equal(kv_fused, kv) and not torch.equal(kv, kv_before)  # the same K, V stored


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])  # int8, fp8: the driver's tables for them
@pytest.mark.parametrize("batch", [1, 3, few_rows()])
@torch.inference_mode()
def test_fused_equals_per_op_bit_for_bit(tiny_model, batch, kv_cache_dtype):
    engine = engine_at_decode(tiny_model, batch, kv_cache_dtype)
    fp = engine.launch(engine.schedule())
    assert fp.ctx.attn.num_decode_seqs == fp.ctx.attn.num_seqs == batch
    assert_fused_equals_per_op(engine, fp)


@pytest.fixture(scope="module")
def tiny_qwen3(models_dir):
    from pdserve.modelgen.make_model import make_model

    return make_model(models_dir / "tiny-qwen3", preset="tiny", arch="qwen3", seed=4, quiet=True)


@pytest.mark.parametrize("batch", [1, 3])
@torch.inference_mode()
def test_qk_norm_layers_fused_equal_per_op_bit_for_bit(tiny_qwen3, batch):
    """Qwen3's per-head q and k norms, in the driver too."""
    engine = engine_at_decode(tiny_qwen3, batch)
    assert engine.model_config.qk_norm
    assert_fused_equals_per_op(engine, engine.launch(engine.schedule()))


@torch.inference_mode()
def test_steps_it_is_not_for_run_layer_by_layer(tiny_llama, monkeypatch):
    engine = engine_at_decode(tiny_llama, few_rows() + 1)
    fp = engine.launch(engine.schedule())
    assert fp.x.shape[0] == few_rows() + 1 and fused(engine, fp) is None  # too many rows
    small = engine_at_decode(tiny_llama, 2)
    fp = small.launch(small.schedule())
    fp.ctx.on_layer_stored = lambda layer: None
    assert fused(small, fp) is None  # a prefill worker streams per layer
    fp.ctx.on_layer_stored = None
    monkeypatch.setenv("PDSERVE_FUSED_DECODE", "off")
    reload_env()
    assert fused(small, fp) is None
    monkeypatch.setenv("PDSERVE_FUSED_DECODE", "on")
    reload_env()
    assert fused(small, fp) is not None


@torch.inference_mode()
def test_prefill_in_the_batch_runs_layer_by_layer(tiny_llama):
    engine = engine_at_decode(tiny_llama, 2)
    engine.add_request("late", random_prompts(engine.model_config.vocab_size, [9], seed=9)[0], GREEDY)
    fp = engine.launch(engine.schedule())
    assert fp.ctx.attn.num_decode_seqs < fp.ctx.attn.num_seqs
    assert fused(engine, fp) is None


@torch.inference_mode()
def test_slot_past_the_pool_is_refused(tiny_llama):
    engine = engine_at_decode(tiny_llama, 1)
    fp = engine.launch(engine.schedule())
    fp.ctx.slot_mapping.fill_(engine.runner.kv_cache.shape[2] * engine.runner.kv_cache.shape[3])
    with pytest.raises(IndexError, match="past the KV pool"):
        fused(engine, fp)


def test_greedy_output_is_the_same_with_it_off(tiny_model, monkeypatch):
    """The engine's decode steps take the driver by default (counted), and give the same tokens
    without it."""
    calls = []
    run = decode_layers.DecodeLayers.run
    monkeypatch.setattr(decode_layers.DecodeLayers, "run", lambda self, *a: calls.append(1) or run(self, *a))
    engine = make_engine(tiny_model)
    prompts = random_prompts(engine.model_config.vocab_size, [5, 40, 17], seed=4)
    on = engine.generate(prompts, GREEDY)
    assert len(calls) >= GREEDY.max_tokens - 1  # every decode step of the batch
    monkeypatch.setenv("PDSERVE_FUSED_DECODE", "off")
    reload_env()
    calls.clear()
    assert make_engine(tiny_model).generate(prompts, GREEDY) == on
    assert not calls


@pytest.fixture(scope="module")
def k_quant_llama(tmp_path_factory):
    """Rows of whole 256-input K-quant blocks: a Q4_K_M file keeps every linear quantized, qkv
    in two formats (Q4_K q/k rows, Q6_K v rows: two segments the driver puts side by side)."""
    from pdserve.modelgen.gguf_writer import write_gguf
    from pdserve.modelgen.make_model import make_model

    root = tmp_path_factory.mktemp("kq")
    folder = make_model(
        root / "hf", preset="tiny", arch="llama", seed=31, quiet=True, hidden_size=256, intermediate_size=512
    )
    return write_gguf(folder, root / "m.gguf", "q4_k_m")


@pytest.mark.skipif(not decode_layers.quantized_available(), reason="the quantized GEMM did not build")
@pytest.mark.parametrize("batch", [1, few_rows(), QUANT_ROWS])
@pytest.mark.parametrize("source", ["int8", "int4", "q4_k_m", "int4+int8x", "q4_k_m+int8x"])
@torch.inference_mode()
def test_quantized_layers_fused_equal_per_op_bit_for_bit(tiny_llama, k_quant_llama, source, batch):
    """+int8x: the linears quantize their input rows (--activation-quantization int8), in both paths."""
    from pdserve.engine.models.quantized_linear import QuantizedLinear
    from tests.engine.test_quantization import quant_engine

    source, _, activations = source.partition("+")
    model_path, quantization = (k_quant_llama, "auto") if source == "q4_k_m" else (tiny_llama, source)
    engine = to_decode(quant_engine(model_path, quantization, "int8" if activations else "none"), batch)
    model = engine.runner.model
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantizedLinear) and isinstance(model.layers[0].mlp.down_proj, QuantizedLinear)
    assert qkv.int8_activations == bool(activations)
    if source == "q4_k_m":  # Q4_K q/k, Q6_K v: a group-wise segment a format, or each tensor's blocks
        assert len(qkv.parts) == (3 if activations else 2)
    assert_fused_equals_per_op(engine, engine.launch(engine.schedule()))
