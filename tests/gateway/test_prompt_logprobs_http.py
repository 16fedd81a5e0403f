"""Prompt logprobs over HTTP against a stub backend (made-up scores, tests/gateway/stub_backend.py):
echo (OpenAI's legacy completions shape, what lm-eval's local-completions reads), vLLM's
prompt_logprobs, max_tokens 0, streaming, the 400s, and the OpenAPI description."""

from __future__ import annotations

import pytest

from tests.gateway.stub_backend import StubBackend, stub_prompt_logprobs
from tests.gateway.test_http_api import post, run, sse_events

PROMPT = [5, 6, 7, 8]
CHAT = [{"role": "user", "content": "x"}]


@pytest.fixture
def backend():
    return StubBackend()


def completion(backend, tokenizer, **body):
    r = run(post(backend, tokenizer, "/v1/completions", {"prompt": PROMPT} | body))
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_scores_the_prompt_without_generating(backend, tokenizer):
    """lm-eval's loglikelihood request shape, with max_tokens 0 (vLLM's prompt-only scoring)."""
    body = completion(backend, tokenizer, echo=True, logprobs=1, max_tokens=0, temperature=0)
    choice = body["choices"][0]
    assert choice["text"] == tokenizer.decode(PROMPT) and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert lp["tokens"] == [tokenizer.decode([t]) for t in PROMPT]
    assert lp["token_logprobs"] == [None, -0.1, -0.2, -0.3]
    assert lp["top_logprobs"][0] is None
    assert lp["top_logprobs"][1] == {tokenizer.decode([6]): -0.1}
    assert lp["text_offset"] == [0, 1, 2, 3]
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == 4
    (sampling,) = backend.sampling.values()
    assert sampling.prompt_logprobs == 1 and sampling.max_tokens == 1  # one token ends the prefill


def test_echo_then_the_generated_tokens(backend, tokenizer):
    body = completion(backend, tokenizer, echo=True, logprobs=2, max_tokens=2)
    choice = body["choices"][0]
    generated = tokenizer.decode(PROMPT[:2])  # (the stub echoes the prompt's tokens as its output)
    assert choice["text"] == tokenizer.decode(PROMPT) + generated
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    assert lp["token_logprobs"][:4] == [None, -0.1, -0.2, -0.3] and lp["token_logprobs"][4:] == [-0.5, -0.5]
    assert lp["text_offset"] == list(range(6))
    # lm-eval's own parser (local-completions): the continuation's logprobs, the last token dropped
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    [(total, greedy)] = LocalCompletionsAPI.parse_logprobs(body, ctxlens=[2])
    assert total == pytest.approx(-0.2 - 0.3 - 0.5) and greedy  # (the stub makes each token its top one)


def test_echo_of_text_and_without_logprobs(backend, tokenizer):
    body = completion(backend, tokenizer, prompt="hello", echo=True, max_tokens=1)
    assert body["choices"][0]["text"].startswith("hello") and body["choices"][0]["logprobs"] is None
    (sampling,) = backend.sampling.values()
    assert sampling.prompt_logprobs is None  # echo without logprobs scores nothing


def test_vllm_prompt_logprobs_per_choice(backend, tokenizer):
    body = completion(backend, tokenizer, prompt_logprobs=2, max_tokens=1, n=2, seed=1)
    want = stub_prompt_logprobs(PROMPT, 2)
    for choice in body["choices"]:
        pl = choice["prompt_logprobs"]
        assert pl[0] is None and len(pl) == 4
        # the prompt token itself (its rank), then the top 2 (ranks 1, 2), without repeats
        assert pl[1] == {
            "6": {"logprob": -0.1, "rank": 1, "decoded_token": tokenizer.decode([6])},
            "1": {"logprob": want.top_logprobs[0][1], "rank": 2, "decoded_token": tokenizer.decode([1])},
        }
        assert pl[2]["7"]["rank"] == 2 and len(pl[2]) == 2
        assert "logprobs" in choice and not choice["text"].startswith(tokenizer.decode(PROMPT))


def test_chat_prompt_logprobs_beside_the_choices(backend, tokenizer):
    r = run(post(backend, tokenizer, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "prompt_logprobs": 0}))
    body = r.json()
    (prompt,) = backend.prompts.values()
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) == len(prompt)
    assert all(len(entry) == 1 for entry in body["prompt_logprobs"][1:])  # the token itself only
    assert "prompt_logprobs" not in body["choices"][0]


def test_streamed_echo_starts_each_choice_with_the_prompt(backend, tokenizer):
    whole = completion(backend, tokenizer, echo=True, logprobs=1, max_tokens=3, prompt_logprobs=1)
    r = run(
        post(
            backend,
            tokenizer,
            "/v1/completions",
            {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 3, "prompt_logprobs": 1, "stream": True},
        )
    )
    chunks = [e for e in sse_events(r.text) if e != "[DONE]"]
    items = [c["choices"][0] for c in chunks]
    assert items[0]["text"].startswith(tokenizer.decode(PROMPT))
    assert items[0]["prompt_logprobs"] == whole["choices"][0]["prompt_logprobs"]
    assert all("prompt_logprobs" not in i for i in items[1:])
    assert "".join(i["text"] for i in items) == whole["choices"][0]["text"]
    tokens = [t for i in items if i["logprobs"] for t in i["logprobs"]["tokens"]]
    lps = [t for i in items if i["logprobs"] for t in i["logprobs"]["token_logprobs"]]
    assert tokens == whole["choices"][0]["logprobs"]["tokens"]
    assert lps == whole["choices"][0]["logprobs"]["token_logprobs"]


def test_streamed_scores_only(backend, tokenizer):
    r = run(
        post(backend, tokenizer, "/v1/completions", {"prompt": PROMPT, "echo": True, "max_tokens": 0, "stream": True})
    )
    chunks = [e for e in sse_events(r.text) if e != "[DONE]"]
    assert [c["choices"][0]["text"] for c in chunks] == [tokenizer.decode(PROMPT)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": PROMPT, "echo": 1}, "echo"),
        ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": -1}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 50}, "prompt_logprobs"),  # over max_logprobs
        (
            "/v1/completions",
            {"prompt": PROMPT, "prompt_logprobs": 1, "use_beam_search": True, "n": 2},
            "prompt_logprobs",
        ),
        ("/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ],
)
def test_refused(backend, tokenizer, path, body, param):
    r = run(post(backend, tokenizer, path, body))
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert backend.started == []


def test_openapi_describes_the_fields(backend, tokenizer):
    async def go():
        from tests.gateway.test_http_api import client_for

        async with client_for(backend, tokenizer) as c:
            return (await c.get("/openapi.json")).json()

    schemas = run(go())["components"]["schemas"]
    completion_body = schemas["CompletionRequest"]["properties"]
    assert {"type": "boolean"} in completion_body["echo"]["anyOf"]
    assert "prompt_logprobs" in completion_body and "prompt_logprobs" in schemas["ChatCompletionRequest"]["properties"]
    assert completion_body["max_tokens"]["anyOf"][0]["minimum"] == 0
    assert "prompt_logprobs" in schemas["Completion"]["properties"]["choices"]["items"]["properties"]
    assert "prompt_logprobs" in schemas["ChatCompletion"]["properties"]
