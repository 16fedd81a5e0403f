"""A tiny Qwen3 "thinking" model for reasoning tests: the tiny qwen3 preset with `<think>` and
`</think>` added to its tokenizer as Qwen3's are (added, not special), and LM-head rows for them
steered so that HF's greedy answer to ASK opens with `<think>` and closes it at output step
END_AT: a random model never would on its own. The model's output is HF's (fp32) on these
weights, whatever serves it; only where the markers fall was chosen."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

ASK = [{"role": "user", "content": "Is the sky blue?"}]
END_AT = 6  # the output step whose greedy token is `</think>`
NEW_TOKENS = 20  # how many tokens HF's reference answer runs to


@dataclass(frozen=True)
class ThinkingModel:
    path: Path
    reasoning: str  # HF's greedy output between the markers
    answer: str  # and after the end marker (blank lines after it dropped, as the parser does)
    max_tokens: int = NEW_TOKENS


def make_thinking_model(out_dir: Path, seed: int = 5) -> ThinkingModel:
    from tokenizers import AddedToken
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pdserve.modelgen.make_model import make_model

    path = make_model(out_dir, preset="tiny", arch="qwen3", seed=seed, tie_word_embeddings=False, quiet=True)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in ("<think>", "</think>")])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.resize_token_embeddings(len(tok), mean_resizing=False)
    think, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    text = tok.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False)
    prompt = torch.tensor([tok.encode(text, add_special_tokens=False)])  # [1, P]
    emb, head = model.get_input_embeddings().weight.data, model.get_output_embeddings().weight.data  # [V, H]
    gen = torch.Generator().manual_seed(seed)
    emb[[think, end]] = torch.randn(2, emb.shape[1], generator=gen) * emb[: think - 1].std()
    head[[think, end, tok.eos_token_id]] = 0.0  # (and end-of-text rarely chosen: the answers run on)

    def greedy(n: int) -> torch.Tensor:
        out = model.generate(prompt, max_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)
        return out[0, prompt.shape[1] :]  # [n]

    @torch.no_grad()
    def steer(token: int, step: int) -> None:
        """Make `token` the greedy choice at output `step`: its head row along that step's final
        hidden state, one logit above the best one."""
        ids = torch.cat([prompt[0], greedy(step)]) if step else prompt[0]  # [P + step]
        h = model.model(ids[None]).last_hidden_state[0, -1]  # [H], after the final norm
        best = (head @ h).max()
        head[token] = h * (best + 1.0) / h.dot(h)

    steer(think, 0)
    steer(end, END_AT)
    out = greedy(NEW_TOKENS).tolist()
    if out[0] != think or out.index(end) != END_AT or out.count(think) + out.count(end) != 2:
        raise AssertionError(f"steering did not place the markers: {out}")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return ThinkingModel(
        path,
        reasoning=tok.decode(out[1:END_AT]),
        answer=tok.decode(out[END_AT + 1 :], skip_special_tokens=True).lstrip("\n"),
    )
