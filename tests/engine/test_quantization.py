"""--quantization int8|int4 (engine/models/quantized_linear.py): greedy output equals HF generate
on the model's weights quantized and dequantized to fp32 (the same values the kernels read), in a
decode batch with prefix-cache hits; a GGUF file's Q8_0 / Q4_0 blocks are served as stored and
equal the file's dequantized-float run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.engine.gguf_weights import gguf_tensors
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.models.quantized_linear import QuantizedLinear
from pdserve.engine.quantize import quantize
from pdserve.kernels.quant_gemm import dequantize
from tests.engine.family_checks import GREEDY, expected, prompts_for
from tests.engine.gguf_fixtures import gguf_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quant_engine(model: Path, quantization: str, activations: str = "none", prompt_linears: str = "auto") -> LLMEngine:
    cfg = EngineConfig(
        model=str(model),
        dtype="float32",
        quantization=quantization,
        activation_quantization=activations,
        prompt_linears=prompt_linears,
        cache=CacheConfig(block_size=4, num_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=256),
    )
    return LLMEngine(cfg, show_progress=False)


def dequantized_reference(src: Path, scheme: str, out: Path) -> Path:
    """An HF folder: `src` with every linear (and the LM head, untied) quantized and dequantized."""
    from transformers import AutoModelForCausalLM

    if (out / "config.json").is_file():
        return out
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.rpartition(".")[2] in LINEARS:
                module.weight.copy_(dequantize(quantize(module.weight, scheme)))
        head = dequantize(quantize(model.lm_head.weight, scheme))
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(head)
    model.save_pretrained(out)
    for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / extra).is_file():
            (out / extra).write_bytes((src / extra).read_bytes())
    return out


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_greedy_equals_hf_on_dequantized_weights(tiny_model, scheme, tmp_path_factory):
    engine = quant_engine(tiny_model, scheme)
    model = engine.runner.model
    assert isinstance(model.lm_head, QuantizedLinear) and isinstance(model.layers[0].mlp.down_proj, QuantizedLinear)
    assert engine.runner.decode_layers is not None  # the one-call driver runs quantized linears too
    assert engine.model_config.fingerprint(torch.float32).endswith(f"/{scheme}")
    reference = dequantized_reference(tiny_model, scheme, tmp_path_factory.mktemp(f"deq-{scheme}"))
    prompts = prompts_for(engine.model_config.vocab_size)
    want = expected(reference, prompts)
    assert engine.generate(prompts, GREEDY) == want
    assert engine.generate(prompts, GREEDY) == want  # again, on the warm prefix cache
    if scheme == "int4":  # the reference is not the float model's output in disguise
        assert want != expected(tiny_model, prompts)
    engine.pool.assert_all_free()


@pytest.mark.parametrize("qtype,scheme", [("q8_0", "int8"), ("q4_0", "int4"), ("q8_0", "auto"), ("q4_0", "auto")])
def test_gguf_blocks_served_as_stored(tmp_path_factory, qtype, scheme):
    root = tmp_path_factory.mktemp("gguf-quant")
    file = gguf_file(root, "llama", qtype)
    engine = quant_engine(file, scheme)
    # the first layer's q rows are the file's blocks (q/k permutation undone), bit for bit
    stored = {name: t for name, t in gguf_tensors(file, ModelConfig.from_folder(file))}
    q = stored["model.layers.0.self_attn.q_proj.weight"]
    qkv = engine.runner.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantizedLinear)
    n_q = q.shape[0]
    block = 34 if qtype == "q8_0" else 18
    raw = np.ascontiguousarray(q.hf_rows()).reshape(n_q, -1, block)[..., 2:].reshape(n_q, -1)
    assert np.array_equal(qkv.q0.data[:n_q].view(torch.uint8).numpy(), raw)
    torch.testing.assert_close(dequantize(qkv.weight)[:n_q], q.dequantize(), rtol=0, atol=0)
    prompts = prompts_for(engine.model_config.vocab_size)
    float_run = quant_engine(file, "none").generate(prompts, GREEDY)
    assert engine.generate(prompts, GREEDY) == float_run


@pytest.mark.parametrize(("family", "scheme"), [("gemma2", "int8"), ("gemma3", "int4")])
def test_gemma_quantized_equals_hf_on_dequantized_weights(family, scheme, models_dir, tmp_path_factory):
    """Gemma's linears (its GeLU MLP, soft-capped scores and logits, 32-token windows) quantized."""
    from pdserve.modelgen.make_model import make_model
    from tests.engine.test_sliding_window_models import FAMILIES
    from tests.engine.test_sliding_window_models import prompts_for as windowed_prompts

    model = make_model(models_dir / f"swa-{family}", quiet=True, **FAMILIES[family])
    engine = quant_engine(model, scheme)
    assert isinstance(engine.runner.model.layers[0].mlp.down_proj, QuantizedLinear)
    reference = dequantized_reference(model, scheme, tmp_path_factory.mktemp(f"deq-{family}-{scheme}"))
    prompts = windowed_prompts(engine.model_config.vocab_size)[:5]
    want = expected(reference, prompts)
    assert engine.generate(prompts, GREEDY) == want
    assert want != expected(model, prompts)  # the reference is not the float model's output in disguise
    engine.pool.assert_all_free()
