"""`--dtype auto` on the CPU: bf16 where the CPU has bf16 matrix units, but fp32 when the linears
are kept quantized (their kernels and the one-call decode driver take fp32 activations; a bf16
Q4_0 decode step ran 2.3x slower than an fp32 one here)."""

from __future__ import annotations

from dataclasses import replace

import torch

from pdserve.engine import config as cfgmod
from pdserve.engine.config import ModelConfig, keeps_weights_quantized, quantized, resolve_dtype

CPU = torch.device("cpu")


def test_auto_is_fp32_for_quantized_weights_on_a_bf16_cpu(monkeypatch):
    monkeypatch.setattr(cfgmod, "cpu_has_fast_bf16", lambda: True)
    assert resolve_dtype("auto", CPU) == torch.bfloat16
    assert resolve_dtype("auto", CPU, quantized_weights=True) == torch.float32
    assert resolve_dtype("bfloat16", CPU, quantized_weights=True) == torch.bfloat16  # asked for: kept
    monkeypatch.setattr(cfgmod, "cpu_has_fast_bf16", lambda: False)
    assert resolve_dtype("auto", CPU) == torch.float32


def test_which_configs_keep_their_weights_quantized(tiny_llama, tmp_path):
    mc = ModelConfig.from_folder(str(tiny_llama), "auto")
    assert not keeps_weights_quantized(quantized(mc, "auto"))  # a float folder stays float
    assert keeps_weights_quantized(quantized(mc, "int8")) and keeps_weights_quantized(quantized(mc, "int4"))
    (tmp_path / "m.gguf").write_bytes(b"GGUF" + bytes(12))  # is_gguf reads the magic
    gguf = replace(mc, path=str(tmp_path / "m.gguf"), weights_tag="gguf-Q4_0+F32")
    assert keeps_weights_quantized(quantized(gguf, "auto"))  # a GGUF file's blocks kept
    assert not keeps_weights_quantized(quantized(gguf, "none"))  # dequantized to --dtype
