"""Gemma 2 and Gemma 3 as GGUF files (engine/gguf_file.py, gguf_weights.py, gguf_writer.py), laid
out as llama.cpp's converter does (norms stored as 1 + w, windows, soft-caps and the local rope base
as metadata): the config read back equals the folder's, and the engine's log-probabilities on the
file equal HF's on the folder at every generated position, across the 32-token windows, whole and
in chunks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.config import ModelConfig
from pdserve.engine.gguf_file import load_tokenizer
from pdserve.modelgen.gguf_writer import write_gguf
from pdserve.modelgen.make_model import make_model
from pdserve.protocol.sampling import SamplingParams
from tests.conftest import _hf_model, random_prompts
from tests.engine.family_checks import make_engine
from tests.engine.test_sliding_window_models import FAMILIES

MAX_NEW = 12
TOP = 5


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma(request, tmp_path_factory) -> tuple[Path, Path]:
    """(HF folder, its GGUF file): tied embeddings (llama.cpp's Gemma has no output tensor) and
    query_pre_attn_scalar = head_dim (what llama.cpp derives: GGUF has no key for it)."""
    root = tmp_path_factory.mktemp(f"gguf-{request.param}")
    kw = dict(FAMILIES[request.param], tie_word_embeddings=True, hf_config={"query_pre_attn_scalar": 16})
    folder = make_model(root / "hf", quiet=True, **kw)
    return folder, write_gguf(folder, root / "model.gguf")


def test_config_reads_back_as_the_folders(gemma):
    folder, file = gemma
    want, got = ModelConfig.from_folder(folder), ModelConfig.from_folder(file)
    for field in ("architecture", "family", "layer_windows", "attn_softcap", "final_softcap", "rope", "local_rope"):
        assert getattr(got, field) == getattr(want, field), field
    assert got.attn_scale == pytest.approx(want.attn_scale) and got.norms_plus_one and not want.norms_plus_one
    assert any(got.layer_windows) and 0 in got.layer_windows  # sliding and full layers both


def hf_logprobs(folder: Path, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = _hf_model(str(folder))(torch.tensor([ids])).logits[0].float()  # [T, V]
    return logits.log_softmax(-1)


@pytest.mark.parametrize("budget", [512, 13])
def test_logprobs_on_the_file_equal_hf_on_the_folder(gemma, budget):
    folder, file = gemma
    engine = make_engine(file, block_size=16, num_blocks=128, max_num_batched_tokens=budget)
    prompts = random_prompts(engine.model_config.vocab_size, [70, 45, 20, 5], seed=3)
    sp = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, logprobs=TOP)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, sp)
    tokens: dict[str, list] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_work():
        for o in engine.step():
            tokens[o.request_id] += o.logprobs or []
    for i, p in enumerate(prompts):
        got = tokens[f"r{i}"]
        assert len(got) == MAX_NEW
        ids = p + [t.token_id for t in got]
        want = hf_logprobs(folder, ids)[len(p) - 1 : len(ids) - 1]  # [MAX_NEW, V]: each generated position
        top = want.topk(TOP)
        for j, t in enumerate(got):
            assert t.token_id == int(top.indices[j, 0])  # greedy: HF's argmax
            assert t.top_ids == top.indices[j].tolist()
            assert max(abs(a - b) for a, b in zip(t.top_logprobs, top.values[j].tolist())) < 1e-4
    engine.pool.assert_all_free()


def test_tokenizer_reads_back(gemma):
    folder, file = gemma
    text = "Gemma from a GGUF file: 123 tokens, café!"
    assert load_tokenizer(file).encode(text) == load_tokenizer(folder).encode(text)


def test_a_scale_llama_cpp_would_derive_otherwise_is_refused(tmp_path):
    folder = make_model(tmp_path / "hf", quiet=True, **dict(FAMILIES["gemma2"], tie_word_embeddings=True))
    with pytest.raises(ValueError, match="query_pre_attn_scalar 32: llama.cpp derives 16"):
        write_gguf(folder, tmp_path / "model.gguf")
