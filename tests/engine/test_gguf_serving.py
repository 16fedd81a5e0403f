"""A q8_0 GGUF file served 1P1D (real processes: gateway and workers each read the file; KV over
shared memory): completions and chat completions through HTTP == HF generate (fp32) on the file's
weights dequantized, the chat prompt built with the chat template read from the file."""

from __future__ import annotations

import pytest
from openai import OpenAI

from pdserve.engine.gguf_file import load_tokenizer
from tests.conftest import hf_greedy, random_prompts
from tests.e2e.cluster import running_server
from tests.engine.gguf_fixtures import dequantized_folder, gguf_file

pytestmark = pytest.mark.slow

MAX_NEW = 10
ONE_P_ONE_D = ["--prefill-workers", "1", "--decode-workers", "1", "--kv-transport", "shm"]


def test_gguf_1p1d_greedy_matches_hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-serve")
    file, reference = gguf_file(root, "llama", "q8_0"), str(dequantized_folder(root, "llama", "q8_0"))
    tok = load_tokenizer(file)
    prompts = random_prompts(tok.vocab_size, [7, 23], seed=13)
    want = [tok.decode(hf_greedy(reference, tuple(p), MAX_NEW), skip_special_tokens=True) for p in prompts]
    messages = [{"role": "user", "content": "the server model token"}]
    chat_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    want_chat = tok.decode(hf_greedy(reference, tuple(chat_ids), MAX_NEW), skip_special_tokens=True)
    # fp32 activations (the default quantizes a GGUF's decode activations to int8: not bit for bit)
    flags = ["--max-num-batched-tokens", "16", "--activation-quantization", "none"]
    with running_server(file, *ONE_P_ONE_D, *flags) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        got = [
            client.completions.create(model=model, prompt=p, max_tokens=MAX_NEW, temperature=0).choices[0].text
            for p in prompts
        ]
        chat = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_NEW, temperature=0)
    assert any(want) and got == want
    assert chat.usage.prompt_tokens == len(chat_ids) and chat.choices[0].message.content == want_chat
