"""A constraint under --reasoning-parser starts when the reasoning ends (engine/structured/
grammar.py after_reasoning): the thinking is free (any bytes, even a split character), only the
end marker leaves it, end-of-text waits for the answer, and the answer is held to the constraint;
for every constraint kind, with the markers as added tokens (Qwen3's) or spelled as text."""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import pytest
from tokenizers import AddedToken
from transformers import AutoTokenizer

from pdserve.engine.structured.grammar import after_reasoning
from pdserve.gateway.reasoning import END, START, marker_lark
from pdserve.protocol.sampling import StructuredOutput

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
CONSTRAINTS = {
    "json_schema": (StructuredOutput("json_schema", json.dumps(SCHEMA)), '{"a":12}', '{"a":"x"}'),
    "regex": (StructuredOutput("regex", "[0-9]{2}"), "42", "4x"),
    "choice": (StructuredOutput("choice", json.dumps(["yes", "no"])), "no", "maybe"),
    "lark": (StructuredOutput("lark", 'start: "ok" NUM\nNUM: /[0-9]/'), "ok7", "ko"),
    "gbnf": (StructuredOutput("grammar", 'root ::= "a" [0-9]'), "a3", "b3"),
}


@pytest.fixture(scope="module", params=["added tokens", "text"])
def vocab(request, tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    if request.param == "added tokens":
        tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in (START, END)])
    llg = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=[tok.eos_token_id])
    return tok, llg


def consumes(vocab, c: StructuredOutput, pieces: list[str]) -> tuple[bool, bool]:
    """(every token accepted, the grammar may end there) for `pieces` tokenized one by one."""
    tok, llg = vocab
    m = llguidance.LLMatcher(llg, c.spec, log_level=0)
    assert not m.get_error(), m.get_error()
    ids = [t for p in pieces for t in (tok.encode(p, add_special_tokens=False) if p != "EOS" else [tok.eos_token_id])]
    ok = all(m.consume_token(t) for t in ids)
    return ok, ok and m.is_accepting()


@pytest.mark.parametrize("kind", CONSTRAINTS)
def test_the_answer_is_held_to_the_constraint_after_free_reasoning(vocab, kind):
    tok, _ = vocab
    base, good, bad = CONSTRAINTS[kind]
    start, end = (marker_lark(tok, m) for m in (START, END))
    closed = after_reasoning(base, False, start, end)
    free = ["\n", bad, ' {"b": [', "café"]  # anything goes while thinking (but end-of-text)
    assert consumes(vocab, closed, [START, *free, END, "\n\n", good]) == (True, True)
    assert consumes(vocab, closed, [good]) == (True, True)  # no reasoning: the answer at once
    assert not consumes(vocab, closed, [START, "x", END, bad])[1]
    assert not consumes(vocab, closed, [START, "x", "EOS"])[0]  # end-of-text waits for the answer
    assert not consumes(vocab, closed, ["so", END, good])[0]  # reasoning opens with the start marker
    opened = after_reasoning(base, True, start, end)
    assert consumes(vocab, opened, [*free, END, good]) == (True, True)
    assert consumes(vocab, opened, [good]) == (True, False)  # still thinking: the answer comes after the end
    assert not consumes(vocab, opened, ["x", END, "\n\n\n", good])[0]  # two blank lines at most


def test_a_split_character_is_free_text_while_thinking(vocab):
    tok, llg = vocab
    c = after_reasoning(CONSTRAINTS["regex"][0], True, *(marker_lark(tok, m) for m in (START, END)))
    m = llguidance.LLMatcher(llg, c.spec, log_level=0)
    # a lone byte-level piece of a multi-byte character (what random or small models write)
    pieces = [t for t in range(len(tok)) if "\ufffd" in tok.decode([t])]
    assert pieces and m.consume_token(pieces[0])


def test_markers_are_named_as_the_tokenizer_holds_them(tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert marker_lark(tok, END) == '"</think>"'
    tok.add_tokens([AddedToken(END, special=False, normalized=False)])
    assert marker_lark(tok, END) == "</think>"
