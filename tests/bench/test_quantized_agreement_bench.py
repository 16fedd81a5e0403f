"""`python -m pdserve.bench.quantized_agreement`: int8 stays closer to fp32 than int4, and each
scheme's figures sit beside its noise control."""

from __future__ import annotations

from pdserve.bench.quantized_agreement import measure


def test_int8_agrees_more_than_int4_and_both_are_measured_against_their_noise(tiny_llama):
    res = measure(str(tiny_llama), sequences=2, length=32)
    assert set(res) == {"int8", "int8-sized noise", "int4", "int4-sized noise", "fp32"}
    assert 0 < res["int4"]["agreement"] <= res["int8"]["agreement"] <= 1
    assert res["int8"]["mean_kl"] < res["int4"]["mean_kl"]
