"""/tokenize and /detokenize in vLLM's shapes: text or chat messages (through the chat template,
tools included) to token ids and back, the API key when the server has one, 400/404 as elsewhere."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from pdserve.gateway.app import create_app
from tests.gateway.stub_backend import StubBackend
from tests.gateway.tool_template import QWEN_TOOLS_TEMPLATE

CHAT = [{"role": "user", "content": "hi there"}]
TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture
def client(tokenizer):
    backend = StubBackend()
    backend.healthy = False  # no worker is needed to tokenize
    app = create_app(backend, tokenizer, model_name="m", max_model_len=64, chat_template=QWEN_TOOLS_TEMPLATE)
    with TestClient(app) as c:
        yield c


def test_text_round_trips(client, tokenizer):
    r = client.post("/tokenize", json={"model": "m", "prompt": "hello world", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode("hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 64
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    bare = client.post("/tokenize", json={"prompt": "hello world", "add_special_tokens": False}).json()
    assert bare["tokens"] == tokenizer.encode("hello world", add_special_tokens=False) and bare["token_strs"] is None
    back = client.post("/detokenize", json={"model": "m", "tokens": bare["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": "hello world"}


def test_chat_messages_go_through_the_template_as_chat_completions_would(client, tokenizer):
    def template(add_generation_prompt: bool) -> list[int]:
        text = tokenizer.apply_chat_template(
            CHAT, chat_template=QWEN_TOOLS_TEMPLATE, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        return tokenizer.encode(text, add_special_tokens=False)

    ids = client.post("/tokenize", json={"messages": CHAT}).json()["tokens"]
    assert ids == template(True) and "hi there" in tokenizer.decode(ids)
    no_prompt = client.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()["tokens"]
    assert no_prompt == template(False) != ids
    with_tools = client.post("/tokenize", json={"messages": CHAT, "tools": [TOOL]}).json()["tokens"]
    assert '"name": "get_time"' in tokenizer.decode(with_tools)


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "messages": CHAT}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "frob": 1}, 400, "frob"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        (
            "/tokenize",
            {"messages": CHAT, "continue_final_message": True, "add_generation_prompt": True},
            400,
            "continue_final_message",
        ),
        ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
        ("/detokenize", {"tokens": [1, 999999]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {}, 400, "tokens"),
    ],
)
def test_bad_bodies_are_refused_naming_the_field(client, path, body, status, param):
    r = client.post(path, json=body)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text


def test_the_api_key_guards_them(tokenizer):
    app = create_app(StubBackend(), tokenizer, model_name="m", max_model_len=64, api_key="sekret")
    with TestClient(app) as c:
        assert c.post("/tokenize", json={"prompt": "x"}).status_code == 401
        assert c.post("/detokenize", json={"tokens": [1]}).status_code == 401
        ok = c.post("/tokenize", json={"prompt": "x"}, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
