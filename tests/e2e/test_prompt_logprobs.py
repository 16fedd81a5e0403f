"""Prompt logprobs through real servers on loopback equal Hugging Face transformers' log_softmax
of the model's logits over the prompt (fp32, |diff| <= 1e-4): echo (OpenAI's legacy shape) and
vLLM's prompt_logprobs, disaggregated (the prefill worker's, whole and chunked; a group's through
the decode worker; a decode worker prefilling itself) and colocated, a cached prefix included."""

from __future__ import annotations

import functools

import httpx
import pytest
import torch

from tests.conftest import _hf_model, hf_greedy, random_prompts
from tests.e2e.conftest import tiny_llama_server

pytestmark = pytest.mark.slow

TOL = 1e-4
LENGTHS = [7, 30, 65]
TOP = 2

MODES = {
    "1P1D": [],
    "1P1D-chunked-zmq": ["--kv-transport", "zmq-tcp", "--max-num-batched-tokens", "16"],
    "1P1D-decode-prefills": ["--prefill-placement", "local"],
    "colocated": ["--colocated"],
}


@functools.lru_cache(maxsize=None)
def hf_scores(path: str, prompt: tuple[int, ...]) -> torch.Tensor:
    """[L - 1, V]: log_softmax of HF's logits at each prompt position but the last."""
    with torch.no_grad():
        logits = _hf_model(path)(torch.tensor([prompt])).logits[0].float()  # [L, V]
    return logits[:-1].log_softmax(dim=-1)


def post(base: str, body: dict) -> dict:
    r = httpx.post(f"{base}/v1/completions", json={"temperature": 0} | body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def check_echo(model, prompt: list[int], choice: dict, tok) -> float:
    """echo + logprobs: the prompt's part against HF; the largest |diff| of a token's logprob."""
    lp = choice["logprobs"]
    want = hf_scores(str(model), tuple(prompt))
    want_lp = want.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
    n = len(prompt)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    got = torch.tensor(lp["token_logprobs"][1:n])
    diff = (got - want_lp).abs().max().item()
    assert diff <= TOL, diff
    top = want.topk(TOP, dim=-1)
    for i in range(1, n):
        names = [tok.decode([t]) for t in top.indices[i - 1].tolist()]
        got_top = lp["top_logprobs"][i]
        for name, value in zip(names, top.values[i - 1].tolist()):
            if names.count(name) == 1:  # (two ids with one text share a key)
                assert abs(got_top[name] - value) <= TOL
    return diff


def check_vllm(model, prompt: list[int], prompt_logprobs: list) -> float:
    """vLLM's prompt_logprobs against HF: each token's logprob and rank, and the top ids."""
    want = hf_scores(str(model), tuple(prompt))
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(prompt)
    worst = 0.0
    for i, t in enumerate(prompt[1:]):
        entry = prompt_logprobs[i + 1]
        row = want[i]
        diff = abs(entry[str(t)]["logprob"] - row[t].item())
        worst = max(worst, diff)
        assert diff <= TOL
        assert entry[str(t)]["rank"] == int((row > row[t]).sum()) + 1
        for tid in row.topk(TOP).indices.tolist():
            assert abs(entry[str(tid)]["logprob"] - row[tid].item()) <= TOL
    return worst


@pytest.mark.parametrize("mode", list(MODES))
def test_prompt_logprobs_match_hf(request, tiny_llama, mode, record_property):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompts = random_prompts(tok.vocab_size, LENGTHS, seed=21)
    worst = 0.0
    with tiny_llama_server(request, *MODES[mode]) as base:  # 1P1D and colocated: shared (conftest.py)
        for prompt in prompts:
            post(base, {"prompt": prompt, "max_tokens": 2})  # its full blocks now in the prefix caches
            # lm-eval's loglikelihood request, with max_tokens 0 (the prompt scored, nothing generated)
            scored = post(base, {"prompt": prompt, "echo": True, "logprobs": TOP, "max_tokens": 0})
            choice = scored["choices"][0]
            assert choice["text"] == tok.decode(prompt) and len(choice["logprobs"]["tokens"]) == len(prompt)
            assert scored["usage"]["completion_tokens"] == 0
            worst = max(worst, check_echo(tiny_llama, prompt, choice, tok))
            # vLLM's field, with a generation that still equals HF greedy
            out = post(base, {"prompt": prompt, "prompt_logprobs": TOP, "max_tokens": 4, "logprobs": 0})
            worst = max(worst, check_vllm(tiny_llama, prompt, out["choices"][0]["prompt_logprobs"]))
            assert out["choices"][0]["text"] == tok.decode(hf_greedy(str(tiny_llama), tuple(prompt), 4))
        # a group (n = 2): one prefill, its scores with the first output (disaggregated: via KvDone)
        group = post(base, {"prompt": prompts[1], "prompt_logprobs": TOP, "max_tokens": 3, "n": 2, "seed": 3})
        for choice in group["choices"]:
            worst = max(worst, check_vllm(tiny_llama, prompts[1], choice["prompt_logprobs"]))
    record_property("max_abs_diff_vs_hf", worst)
    print(f"{mode}: max |prompt logprob - HF| = {worst:.2e}")
