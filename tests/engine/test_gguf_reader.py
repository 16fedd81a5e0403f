"""engine/gguf_reader.py reads what ggml's own reader reads: every metadata value (scalars, strings,
arrays of numbers and of strings) and every tensor's type, dims and data view, on files of every
type pdserve writes; a file's converted tokenizer is cached once and reloaded the same."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from pdserve.engine.gguf_reader import GgufFile, GgufFormatError
from tests.engine.gguf_fixtures import gguf_file


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf-reader")


@pytest.mark.parametrize("arch,qtype", [("llama", "q4_k_m"), ("qwen2", "q8_0"), ("phi3", "f16"), ("qwen3", "f32")])
def test_reads_what_ggmls_reader_reads(root, arch, qtype):
    path = gguf_file(root, arch, qtype)
    ours, theirs = GgufFile(path), gguf.GGUFReader(path)
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]  # (ggml's reader lists the header too)
    assert list(ours.fields) == keys and "tokenizer.ggml.tokens" in keys
    for k in keys:
        assert ours.fields[k].contents() == theirs.fields[k].contents(), k
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type and a.shape.tolist() == b.shape.tolist()
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype
        assert np.array_equal(a.data, b.data), a.name


def test_refuses_what_is_not_gguf(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"GGUF" + (99).to_bytes(4, "little") + bytes(16))
    with pytest.raises(GgufFormatError, match="version 99"):
        GgufFile(tmp_path / "x.gguf")
    (tmp_path / "y.gguf").write_bytes(b"GGML" + bytes(20))
    with pytest.raises(GgufFormatError, match="not a GGUF file"):
        GgufFile(tmp_path / "y.gguf")


def test_the_converted_tokenizer_is_cached_once_and_reloaded_the_same(root, tmp_path, monkeypatch):
    from pdserve import env
    from pdserve.engine import gguf_file as gf

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    env.reload()
    try:
        path = gguf_file(root, "llama", "q8_0")
        converted = gf.load_tokenizer(path)
        (cached,) = [p for p in (tmp_path / "gguf-tokenizers").iterdir() if p.is_dir()]
        calls = []
        monkeypatch.setattr(gf, "_convert_tokenizer", lambda p: calls.append(p))
        again = gf.load_tokenizer(path)  # from the cache: no conversion
        assert calls == [] and (cached / "tokenizer_config.json").is_file()
        text = "the server model token " + converted.decode(list(range(5, 200, 7)))
        assert again.encode(text) == converted.encode(text) and again.chat_template == converted.chat_template
        assert again.eos_token_id == converted.eos_token_id and len(again) == len(converted)
    finally:
        monkeypatch.delenv("PDSERVE_CACHE_DIR")
        env.reload()
