"""--activation-quantization int8 on a GGUF file's kept K-quant blocks (Q4_K_M): the decode-size
calls quantize their input rows to int8 (kernels/cpu_quant_dot.c), so greedy output is no longer
bit for bit HF's on the dequantized weights. Measured teacher-forced: at each position of HF's
greedy continuation, the engine's next token given HF's prefix is HF's next token. The prompt rows
go through int8 as decode rows do, or through bf16 (`--prompt-linears bf16`, on any CPU)."""

from __future__ import annotations

import pytest

from pdserve.engine.models.quantized_linear import QuantizedLinear
from pdserve.kernels import quant_gemm
from tests.conftest import hf_greedy
from tests.engine import family_checks
from tests.engine.family_checks import prompts_for
from tests.engine.test_gguf_blocks_kept import _dequantized_hf_folder, k_quant_source  # noqa: F401 (fixture)
from tests.engine.test_quantization import quant_engine

pytestmark = pytest.mark.skipif(not quant_gemm.int8x_available(), reason="no C compiler: no int8-activation kernel")
NEW = 24  # HF tokens a prompt: positions measured


@pytest.mark.parametrize("prompts_in", ["int8", "bf16"])
@pytest.mark.parametrize("qtype", ["q4_k_m", "q8_0"])
def test_int8_activations_agree_with_hf_teacher_forced(k_quant_source, tmp_path, qtype, prompts_in):  # noqa: F811
    """Rows of whole super-blocks: every linear runs on the file's blocks as stored (block_gemm)."""
    from pdserve.kernels.block_gemm import BlockWeight
    from pdserve.modelgen.gguf_writer import write_gguf

    file = write_gguf(k_quant_source, tmp_path / "m.gguf", qtype)
    engine = quant_engine(file, "auto", "int8", prompt_linears=prompts_in)
    linears = [m for m in engine.runner.model.modules() if isinstance(m, QuantizedLinear)]
    assert all(m.int8_activations for m in linears)
    assert all(isinstance(p, BlockWeight) for m in linears for p in m.parts)
    assert [m.bf16_prompts for m in linears].count(True) == (
        len(linears) - 1 if prompts_in == "bf16" else 0
    )  # not the head
    tag = "auto+int8x-blocks" + ("+bf16-prompts" if prompts_in == "bf16" else "")
    assert engine.model_config.weights_tag.endswith(tag)  # its KV is neither fp32 activations' nor a group-wise copy's
    reference = _dequantized_hf_folder(k_quant_source, file, tmp_path / "hf")
    prompts = prompts_for(engine.model_config.vocab_size)
    want = [hf_greedy(str(reference), tuple(p), NEW) for p in prompts]
    assert max(map(len, prompts)) <= min(quant_gemm.FEW_ROWS.values())  # a step's rows: the int8 kernel's
    # one at a time, so each step computes one prompt's rows past its cached prefix (few: the int8 kernel)
    got = family_checks.teacher_forced(engine, prompts, want)
    expected = [t for w in want for t in w]
    agree = sum(a == b for a, b in zip(got, expected))
    print(f"{qtype}: teacher-forced top-1 agreement with HF: {agree}/{len(expected)}")
    assert agree >= 0.99 * len(expected), f"{agree} of {len(expected)} positions agree with HF"
    engine.pool.assert_all_free()


def test_auto_quantizes_the_activations_of_a_gguf_files_kept_blocks_only(tmp_path):
    from pdserve.engine.config import EngineConfig, resolve_activations

    file, folder = tmp_path / "m.gguf", str(tmp_path)
    file.write_bytes(b"GGUF" + bytes(12))  # is_gguf reads the magic
    assert resolve_activations("auto", "auto", str(file)) == "int8"  # as llama.cpp runs the file
    assert resolve_activations("auto", "none", str(file)) == "none"  # dequantized: float linears
    assert resolve_activations("auto", "auto", folder) == "none"  # a float folder
    assert resolve_activations("auto", "int4", folder) == "none"  # quantized at load: weight-only, as before
    assert (
        resolve_activations("int8", "int4", folder) == "int8"
        and resolve_activations("none", "auto", str(file)) == "none"
    )
    with pytest.raises(ValueError, match="applies to quantized weights"):
        EngineConfig(model=folder, quantization="none", activation_quantization="int8")


def test_blocks_as_stored_and_a_group_wise_copy_never_share_a_fingerprint(tmp_path):
    """One rank runs a K-quant file's blocks as stored (x per 256), tensor parallelism a group-wise
    copy (x per 32): their KV differs, so their pools must not pair; a Q4_0 file's is the same."""
    from dataclasses import replace

    from pdserve.engine.config import ModelConfig, quantized
    from pdserve.modelgen.gguf_writer import write_gguf
    from pdserve.modelgen.make_model import make_model

    folder = make_model(tmp_path / "src", preset="tiny", arch="llama", seed=3, quiet=True)
    file = write_gguf(folder, tmp_path / "m.gguf", "q8_0")
    cfg = ModelConfig.from_folder(file)
    one_rank, tp = (quantized(cfg, "auto", "int8", blocks_as_stored=b).fingerprint("float32") for b in (True, False))
    assert one_rank != tp and one_rank.endswith("+int8x-blocks") and tp.endswith("+int8x")
    assert quantized(cfg, "int8", "int8", blocks_as_stored=True).weights_tag.endswith("int8+int8x-blocks")
    q4_0 = replace(cfg, weights_tag="gguf-Q4_0+F32")
    assert {quantized(q4_0, "auto", "int8", blocks_as_stored=b).weights_tag for b in (True, False)} == {
        "gguf-Q4_0+F32+auto+int8x"
    }
