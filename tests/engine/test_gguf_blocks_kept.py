"""A GGUF file's quantized blocks kept as they are (engine/quantize.py `from_gguf_blocks`): for
every kept type, the values our format holds, in the torch reference and in the C kernel's
widening, equal ggml's own dequantization (the gguf package's) to the bit; and the C linear on
them matches a float matmul of those values."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pdserve.engine.quantize import KEPT_GGUF_TYPES, from_gguf_blocks
from pdserve.kernels import quant_gemm
from pdserve.modelgen.random_blocks import random_blocks
from tests.conftest import hf_greedy


@pytest.mark.parametrize("qtype", KEPT_GGUF_TYPES, ids=lambda t: t.name)
def test_kept_blocks_hold_ggmls_values_to_the_bit(qtype):
    rows, n_in = 40, 512
    raw = random_blocks(qtype, rows, n_in)
    want = torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32)).reshape(rows, n_in)
    w = from_gguf_blocks(raw, qtype, n_in)
    torch.testing.assert_close(quant_gemm.dequantize(w), want, rtol=0, atol=0)
    if quant_gemm.available():
        torch.testing.assert_close(quant_gemm.widen_rows(w, 0, rows), want, rtol=0, atol=0)  # the C widening
    kind = {8: "int8", 4: "int4"}[w.bits]
    assert (kind, w.scale_group, w.affine) == {
        "Q8_0": ("int8", 32, False),
        "Q4_0": ("int4", 32, False),
        "Q4_1": ("int4", 32, True),
        "Q4_K": ("int4", 32, True),
        "Q5_K": ("int8", 32, True),
        "Q6_K": ("int8", 16, False),
    }[qtype.name]


@pytest.mark.parametrize("qtype", KEPT_GGUF_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 16, 40])
def test_kept_blocks_linear_matches_a_float_matmul(qtype, m):
    rows, n_in = 36, 512
    raw = random_blocks(qtype, rows, n_in, seed=1)
    w = from_gguf_blocks(raw, qtype, n_in)
    x = torch.randn(m, n_in, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(rows)
    dense = quant_gemm.dequantize(w)  # [rows, n_in]
    want = x @ dense.T + bias  # [m, rows]
    scale = (x.abs() @ dense.abs().T).max().item()  # fp32 sums of this size round at ~1e-7 of it
    torch.testing.assert_close(quant_gemm.linear(x, w, bias), want, rtol=0, atol=2e-6 * scale)


@pytest.fixture(scope="module")
def k_quant_source(tmp_path_factory):
    """A llama whose linears' rows are whole 256-element K-quant super-blocks."""
    from pdserve.modelgen.make_model import make_model

    folder = tmp_path_factory.mktemp("kq") / "src"
    return make_model(folder, preset="tiny", arch="llama", seed=31, quiet=True, hidden_size=256, intermediate_size=512)


@pytest.mark.parametrize("qtype", ["q4_k_m", "q5_k", "q6_k", "q4_1"])
def test_a_k_quant_file_is_served_from_its_blocks_as_its_dequantized_floats_are(k_quant_source, tmp_path, qtype):
    """--quantization auto (the default) keeps every linear's blocks (q4_k_m: Q4_K q/k with a
    Q6_K v, so the fused qkv runs as two formats) and generates what the file's dequantized float
    weights generate (--quantization none), and what HF transformers generates on those very
    values (the source folder with every weight replaced by the file's, dequantized): 0 tokens differ."""
    from pdserve.engine.models.quantized_linear import QuantizedLinear
    from pdserve.modelgen.gguf_writer import write_gguf
    from tests.engine.test_quantization import GREEDY, prompts_for, quant_engine

    file = write_gguf(k_quant_source, tmp_path / "m.gguf", qtype)
    kept = quant_engine(file, "auto")
    layer = kept.runner.model.layers[0]
    linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    assert all(isinstance(m, QuantizedLinear) for m in linears)
    if qtype == "q4_k_m":
        qkv = layer.self_attn.qkv_proj.parts
        assert [(p.bits, p.affine, p.scale_group) for p in qkv] == [(4, True, 32), (8, False, 16)]
    dense = sum(m.in_features * m.out_features * 4 for m in linears)
    assert sum(p.nbytes() for m in linears for p in m.parts) < dense / 2.5  # kept small in memory
    prompts = prompts_for(kept.model_config.vocab_size)
    got = kept.generate(prompts, GREEDY)
    assert got == quant_engine(file, "none").generate(prompts, GREEDY)
    reference = _dequantized_hf_folder(k_quant_source, file, tmp_path / "hf")
    want = [hf_greedy(str(reference), tuple(p), GREEDY.max_tokens) for p in prompts]
    differing = sum(a != b for g, w in zip(got, want) for a, b in zip(g, w)) + sum(
        abs(len(g) - len(w)) for g, w in zip(got, want)
    )
    assert differing == 0, f"{differing} of {sum(map(len, want))} tokens differ from HF"
    kept.pool.assert_all_free()


def _dequantized_hf_folder(source, file, out):
    """`source` (an HF folder) with every weight replaced by `file`'s, dequantized to fp32."""
    from transformers import AutoModelForCausalLM

    from pdserve.engine.config import ModelConfig
    from pdserve.engine.gguf_weights import gguf_tensors
    from pdserve.modelgen.hf_state import copy_into_hf_state

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    state = model.state_dict()
    with torch.no_grad():
        for name, tensor in gguf_tensors(file, ModelConfig.from_folder(file)):
            copy_into_hf_state(state, name, tensor.dequantize())
    model.save_pretrained(out)
    for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (out / extra).write_bytes((source / extra).read_bytes())
    return out


def test_kept_linears_are_never_dequantized_at_load(k_quant_source, tmp_path, monkeypatch):
    """Loading reads a kept linear's blocks straight into its QuantizedLinear: no float copy of
    its weight is ever made (so a Q4_K_M file loads in about its own size, not fp32's)."""
    from pdserve.engine.gguf_weights import GgufTensor
    from pdserve.modelgen.gguf_writer import write_gguf
    from tests.engine.test_quantization import quant_engine

    file = write_gguf(k_quant_source, tmp_path / "m.gguf", "q4_k_m")
    dequantized: list[tuple[int, ...]] = []
    original = GgufTensor.dequantize
    monkeypatch.setattr(GgufTensor, "dequantize", lambda self: dequantized.append(self.shape) or original(self))
    engine = quant_engine(file, "auto")
    mc = engine.model_config
    assert dequantized and all(len(shape) == 1 or shape == (mc.vocab_size, mc.hidden_size) for shape in dequantized)


@pytest.mark.parametrize("tied", [True, False])
def test_the_embedding_table_stays_its_blocks(tmp_path, tied):
    """A GGUF file's embedding table in a kept type stays quantized (no float vocab x hidden
    table): each looked-up row equals the file's dequantized row, and a tied LM head shares the
    very tensors."""
    from pdserve.engine.models.quantized_embedding import QuantizedEmbedding
    from pdserve.modelgen.gguf_writer import write_gguf
    from pdserve.modelgen.make_model import make_model
    from tests.engine.test_quantization import GREEDY, prompts_for, quant_engine

    src = make_model(tmp_path / "src", preset="tiny", arch="llama", seed=5, quiet=True, tie_word_embeddings=tied)
    file = write_gguf(src, tmp_path / "m.gguf", "q8_0")
    kept, dense = quant_engine(file, "auto"), quant_engine(file, "none")
    model = kept.runner.model
    assert isinstance(model.embed_tokens, QuantizedEmbedding)
    ids = torch.tensor([[0, 5, 7], [model.embed_tokens.num_embeddings - 1, 5, 1]])
    want = dense.runner.model.embed_tokens.weight[ids]  # [2, 3, H]: the file's rows, dequantized at load
    assert torch.equal(model.embed_tokens(ids), want)
    assert (model.embed_tokens.q.data_ptr() == model.lm_head.q0.data_ptr()) == tied  # one copy of the blocks
    prompts = prompts_for(kept.model_config.vocab_size)
    assert kept.generate(prompts, GREEDY) == dense.generate(prompts, GREEDY)
