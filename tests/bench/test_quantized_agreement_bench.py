"""`python -m pdserve.bench.quantized_agreement`: pdserve's int8 / int4 engine agrees with HF on
the very values its kernels hold at every teacher-forced position, on both kernel paths; int8
stays closer to fp32 than int4, each beside its noise control."""

from __future__ import annotations

import torch

from pdserve.bench.quantized_agreement import _quantized_copy, engine_logits, measure


def test_int8_agrees_more_than_int4_and_both_are_measured_against_their_noise(tiny_llama):
    res = measure(str(tiny_llama), sequences=2, length=32)
    engine_rows = {f"pdserve {s} vs HF on its values, chunks of {c}" for s in ("int8", "int4") for c in (512, 32)}
    assert set(res) == {"int8", "int8-sized noise", "int4", "int4-sized noise", "fp32"} | engine_rows
    assert all(res[r]["agreement"] == 1.0 for r in engine_rows)  # the kernels: HF on the same values
    assert 0 < res["int4"]["agreement"] <= res["int8"]["agreement"] <= 1
    assert res["int8"]["mean_kl"] < res["int4"]["mean_kl"]


@torch.inference_mode()
def test_engine_logits_are_every_positions_and_fail_on_other_weights(tiny_llama):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    tokens = torch.randint(3, ref.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
    got = engine_logits(str(tiny_llama), "int4", tokens, chunk=16)  # [1, 40, V] over three steps
    assert got.shape == (1, 40, ref.config.vocab_size)
    torch.testing.assert_close(got, _quantized_copy(ref, "int4")(tokens).logits.float(), rtol=0, atol=1e-3)
    assert (got - ref(tokens).logits.float()).abs().max() > 1e-2  # fp32's own weights differ: not int4's
