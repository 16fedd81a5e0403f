"""--reasoning-parser qwen3 on a Qwen3-layout model served 1P1D and colocated (tests/e2e/
thinking_model.py: HF's greedy answer thinks for a few tokens, then answers): `reasoning_content`
and `content` split where HF's output has `</think>`, streamed and not; with a JSON schema the
reasoning runs free (HF's tokens again) and the constraint starts after `</think>`, so the answer
validates; a forced tool call is made after the reasoning too; a request moved mid-reasoning
resumes under the same grammar."""

from __future__ import annotations

import json

import jsonschema
import pytest
from openai import OpenAI

from tests.e2e.cluster import running_server
from tests.e2e.thinking_model import ASK, END_AT, ThinkingModel, make_thinking_model

pytestmark = pytest.mark.slow

MODES = {"1P1D": ["--prefill-workers", "1", "--decode-workers", "1"], "colocated": ["--colocated"]}
VERDICT = {
    "type": "object",
    "properties": {"sky": {"enum": ["blue", "grey"]}, "sure": {"type": "boolean"}},
    "required": ["sky", "sure"],
    "additionalProperties": False,
}
LOOKUP = {"type": "object", "properties": {"q": {"enum": ["sky"]}}, "required": ["q"], "additionalProperties": False}


@pytest.fixture(scope="module")
def thinking(tmp_path_factory) -> ThinkingModel:
    return make_thinking_model(tmp_path_factory.mktemp("thinking") / "qwen3")


@pytest.mark.parametrize("mode", MODES)
def test_reasoning_splits_where_hf_ends_it_and_constraints_start_after(thinking, mode):
    with running_server(thinking.path, *MODES[mode], "--reasoning-parser", "qwen3") as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        ask = dict(model=model, messages=ASK, temperature=0, max_tokens=thinking.max_tokens)
        message = client.chat.completions.create(**ask).choices[0].message
        assert (getattr(message, "reasoning_content", None), message.content) == (thinking.reasoning, thinking.answer)
        deltas = [c.choices[0].delta for c in client.chat.completions.create(**ask, stream=True) if c.choices]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == thinking.reasoning
        assert "".join(d.content or "" for d in deltas) == thinking.answer

        fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT}}
        for stream in (False, True):
            kw = dict(ask, max_tokens=64, response_format=fmt)
            if stream:
                deltas = [c.choices[0].delta for c in client.chat.completions.create(**kw, stream=True) if c.choices]
                reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
                content = "".join(d.content or "" for d in deltas)
            else:
                choice = client.chat.completions.create(**kw).choices[0]
                assert choice.finish_reason == "stop"
                reasoning, content = getattr(choice.message, "reasoning_content", None), choice.message.content
            assert reasoning == thinking.reasoning, stream
            jsonschema.validate(json.loads(content), VERDICT)

        tools = [{"type": "function", "function": {"name": "lookup", "parameters": LOOKUP}}]
        r = client.chat.completions.create(**dict(ask, max_tokens=64), tools=tools, tool_choice="required")
        message = r.choices[0].message
        assert getattr(message, "reasoning_content", None) == thinking.reasoning
        (call,) = message.tool_calls
        assert call.function.name == "lookup"
        jsonschema.validate(json.loads(call.function.arguments), LOOKUP)


@pytest.mark.parametrize("moved_at", [3, END_AT + 1])  # mid-reasoning; just after </think>
def test_a_request_moved_mid_reasoning_resumes_under_the_same_grammar(thinking, moved_at):
    """Migration replays the output under the wrapped grammar (resumed_tokens): moved after k
    tokens, greedy, the rest is what the unmoved request made, reasoning and valid answer alike."""
    from transformers import AutoTokenizer

    from pdserve.engine.structured.grammar import after_reasoning
    from pdserve.protocol.sampling import SamplingParams, StructuredOutput
    from tests.engine.test_engine_vs_hf import make_engine
    from tests.engine.test_structured_output import run

    tok = AutoTokenizer.from_pretrained(thinking.path)
    text = tok.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(text, add_special_tokens=False)
    c = after_reasoning(StructuredOutput("json_schema", json.dumps(VERDICT)), False, "<think>", "</think>")
    (whole, reason) = run(
        make_engine(thinking.path), {"r": (prompt, SamplingParams(max_tokens=64, temperature=0.0, structured=c))}
    )["r"]
    assert reason == "stop" and whole[END_AT] == tok.convert_tokens_to_ids("</think>")
    moved = SamplingParams(
        max_tokens=64 - moved_at, temperature=0.0, structured=StructuredOutput(c.kind, c.spec, moved_at)
    )
    (rest, reason) = run(make_engine(thinking.path), {"r": (prompt + whole[:moved_at], moved)})["r"]
    assert reason == "stop" and whole[:moved_at] + rest == whole
    jsonschema.validate(json.loads(tok.decode(whole[END_AT + 1 :], skip_special_tokens=True)), VERDICT)
