"""Whether a draft model can draft for a target (torch-free: the CLI checks it at start)."""

from __future__ import annotations

from pdserve.engine.config import ModelConfig


def check_draft_fits(target: ModelConfig, draft: ModelConfig) -> None:
    """The draft must speak the target's tokens: same vocabulary size and end-of-sequence ids."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"draft model {draft.path} has a vocabulary of {draft.vocab_size} tokens, the target "
            f"{target.vocab_size}: a draft model needs the target's tokenizer"
        )
    if set(draft.eos_token_ids) != set(target.eos_token_ids):
        raise ValueError(
            f"draft model {draft.path} ends sequences with {list(draft.eos_token_ids)}, the target with "
            f"{list(target.eos_token_ids)}: a draft model needs the target's tokenizer"
        )
