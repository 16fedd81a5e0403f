"""`--dtype auto` on the CPU: fp32 (the decode driver and prefill attention kernels are fp32; a
bf16 decode step of the real-shape model ran 2.3x slower), bf16 only where fp32 weights would take
over half the machine's memory on a CPU with bf16 matrix units, and fp32 whenever the linears are
kept quantized (their kernels take fp32 activations)."""

from __future__ import annotations

from dataclasses import replace

import torch

from pdserve.engine import config as cfgmod
from pdserve.engine.config import ModelConfig, keeps_weights_quantized, quantized, resolve_dtype

CPU = torch.device("cpu")
GIB = 1 << 30


def test_auto_is_fp32_on_the_cpu_unless_fp32_weights_would_not_fit(monkeypatch):
    monkeypatch.setattr(cfgmod, "cpu_has_fast_bf16", lambda: True)
    monkeypatch.setattr(cfgmod, "machine_memory_bytes", lambda: 24 * GIB)
    assert resolve_dtype("auto", CPU, params=135_000_000) == torch.float32
    assert resolve_dtype("auto", CPU, params=3_000_000_000) == torch.float32  # 12 GB of 24 GiB
    assert resolve_dtype("auto", CPU, params=7_000_000_000) == torch.bfloat16  # 28 GB: half the bytes
    assert resolve_dtype("auto", CPU, quantized_weights=True, params=7_000_000_000) == torch.float32
    assert resolve_dtype("bfloat16", CPU, quantized_weights=True) == torch.bfloat16  # asked for: kept
    assert resolve_dtype("float32", CPU, params=7_000_000_000) == torch.float32  # asked for: kept
    monkeypatch.setattr(cfgmod, "cpu_has_fast_bf16", lambda: False)
    assert resolve_dtype("auto", CPU, params=7_000_000_000) == torch.float32  # bf16 would be slow here
    monkeypatch.setattr(cfgmod, "machine_memory_bytes", lambda: None)
    monkeypatch.setattr(cfgmod, "cpu_has_fast_bf16", lambda: True)
    assert resolve_dtype("auto", CPU, params=7_000_000_000) == torch.float32  # memory unknown


def test_the_machine_memory_is_read(monkeypatch):
    memory = cfgmod.machine_memory_bytes()
    assert memory is not None and memory > 256 << 20


def test_approx_params_counts_the_dense_weights(tiny_llama):
    from transformers import AutoModelForCausalLM

    mc = ModelConfig.from_folder(str(tiny_llama), "auto")
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama))
    dense = sum(p.numel() for n, p in hf.named_parameters() if p.dim() == 2)  # no norms, no biases
    assert mc.approx_params == dense


def test_which_configs_keep_their_weights_quantized(tiny_llama, tmp_path):
    mc = ModelConfig.from_folder(str(tiny_llama), "auto")
    assert not keeps_weights_quantized(quantized(mc, "auto"))  # a float folder stays float
    assert keeps_weights_quantized(quantized(mc, "int8")) and keeps_weights_quantized(quantized(mc, "int4"))
    (tmp_path / "m.gguf").write_bytes(b"GGUF" + bytes(12))  # is_gguf reads the magic
    gguf = replace(mc, path=str(tmp_path / "m.gguf"), weights_tag="gguf-Q4_0+F32")
    assert keeps_weights_quantized(quantized(gguf, "auto"))  # a GGUF file's blocks kept
    assert not keeps_weights_quantized(quantized(gguf, "none"))  # dequantized to --dtype
