"""bench/gguf_agreement.py's reference: HF's model on a GGUF file's own values. A tied LM head must
be the file's embedding table (transformers' from_config leaves an unset head of its own, whose
logits once made the reference a random one)."""

from __future__ import annotations

import pytest
import torch

from pdserve.bench.gguf_agreement import dequantized_hf_model


@pytest.mark.parametrize("tied", [True, False])
def test_the_reference_is_the_source_model_on_the_files_values(tmp_path, tied):
    """An f32 file holds the source's values exactly: the reference's logits are the source's."""
    from transformers import AutoModelForCausalLM

    from pdserve.modelgen.gguf_writer import write_gguf
    from pdserve.modelgen.make_model import make_model

    src = make_model(tmp_path / "src", preset="tiny", arch="llama", seed=4, quiet=True, tie_word_embeddings=tied)
    file = write_gguf(src, tmp_path / "m.gguf", "f32")
    ref = dequantized_hf_model(str(src), str(file))
    want = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 99, 3, 42, 7]])
    with torch.no_grad():
        got, expected = ref(ids).logits, want(ids).logits
    assert expected.std() > 0  # (a head of zeros gives every token one logit)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
