"""A GGUF file's UNUSED-type tokens (a converter pads a vocabulary with them: `[PAD123]`) stand for
no text, as llama.cpp renders them; transformers' conversion of the file decodes them as their
placeholder strings, so the gateway leaves them out of the text it streams (each streams as an
empty chunk, as llama-server's do)."""

from __future__ import annotations

import json

import gguf
from starlette.testclient import TestClient

from pdserve.engine.gguf_file import unrendered_token_ids
from pdserve.gateway.app import create_app
from pdserve.gateway.detokenizer import IncrementalDetokenizer
from tests.gateway.stub_backend import StubBackend

T = gguf.TokenType


def test_a_gguf_files_unused_tokens_are_the_unrendered_ones(tmp_path, tokenizer_dir):
    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list(["a", "[PAD1]", "<s>", "b", "[PAD4]"])
    writer.add_token_types([T.NORMAL, T.UNUSED, T.CONTROL, T.BYTE, T.UNUSED])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert unrendered_token_ids(path) == {1, 4}
    assert unrendered_token_ids(tokenizer_dir) == frozenset()  # an HF folder: none


def test_the_detokenizer_gives_them_no_text(tokenizer):
    ids = tokenizer.encode("hello world, again", add_special_tokens=False)
    pad = len(tokenizer) - 1  # a stand-in for one
    detok = IncrementalDetokenizer(tokenizer, unrendered=frozenset({pad}))
    text = "".join(detok.add(i) for i in [ids[0], pad, *ids[1:], pad]) + detok.flush()
    assert text == tokenizer.decode(ids)


def test_the_gateway_streams_them_as_no_text(tokenizer):
    """The stub backend echoes the prompt: its unrendered ids come back as tokens, counted in the
    usage, but not as text, streamed or not."""
    ids = tokenizer.encode("one two three", add_special_tokens=False)
    pad = len(tokenizer) - 1
    prompt = [ids[0], pad, *ids[1:], pad]
    app = create_app(StubBackend(), tokenizer, model_name="m", max_model_len=64, unrendered_token_ids=frozenset({pad}))
    body = {"model": "m", "prompt": prompt, "max_tokens": len(prompt)}
    with TestClient(app) as client:
        whole = client.post("/v1/completions", json=body).json()
        chunks = client.post("/v1/completions", json=body | {"stream": True}).text.splitlines()
    assert whole["choices"][0]["text"] == tokenizer.decode(ids), whole
    assert whole["usage"]["completion_tokens"] == len(prompt)
    events = [json.loads(c.removeprefix("data: ")) for c in chunks if c.startswith("data: {")]
    texts = [e["choices"][0]["text"] for e in events if e["choices"]]
    assert "".join(texts) == tokenizer.decode(ids)
    assert texts.count("") >= 2  # each of them an empty chunk, as llama-server streams them (timing clients see it)
