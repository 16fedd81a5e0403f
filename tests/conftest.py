"""Shared fixtures: tiny random HF model folders (made once per session) and HF references."""

from __future__ import annotations

import functools
import os
import random
from pathlib import Path

import pytest
import zmq

from pdserve.runtime.thread_waits import choose_thread_waits

# The suite's idle OpenMP threads sleep at once, as a pdserve process's that is not a decode worker
# (runtime/thread_waits.py): set before torch loads libgomp. Its in-process engines share the
# cores with the servers tests start, and so do those servers' workers, tiny models' steps among
# more processes than cores: the suite pins the setting as a user would, so they all sleep at once.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
choose_thread_waits(None)


@pytest.fixture(autouse=True)
def fresh_env_settings():
    """pdserve reads its environment once (pdserve/env.py): a test that changes the environment
    calls reload(); this makes each test start from, and leave, the settings of the environment."""
    from pdserve.env import reload

    reload()
    yield
    reload()


@pytest.fixture(autouse=True)
def cores_left_as_found():
    """A tensor-parallel engine pins its rank 0, the test's own process, and must unpin it at
    close: later tests' servers would inherit the mask. Restored either way; a leak fails the test."""
    import os

    from pdserve.engine.parallel.core_sets import pin

    before = os.sched_getaffinity(0)
    yield
    if os.sched_getaffinity(0) != before:
        pin(sorted(before))
        pytest.fail(f"the test left this process pinned to other cores than {sorted(before)}")


@pytest.fixture
def ctx():
    """A ZeroMQ context for a test's sockets, destroyed (linger 0) after it."""
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_llama(models_dir) -> Path:
    from pdserve.modelgen.make_model import make_model

    return make_model(models_dir / "tiny-llama", preset="tiny", arch="llama", seed=1)


@pytest.fixture(scope="session")
def tiny_qwen2(models_dir) -> Path:
    from pdserve.modelgen.make_model import make_model

    return make_model(models_dir / "tiny-qwen2", preset="tiny", arch="qwen2", seed=2)


@pytest.fixture(scope="session")
def real_llama(models_dir) -> Path:
    """A real small model's shape (30 layers, hidden 576; ~115M parameters): a 512-token
    prefill takes seconds here, so queueing and lease clocks behave as in production."""
    from pdserve.modelgen.make_model import make_model

    return make_model(models_dir / "real-llama", preset="real", arch="llama", seed=3)


@pytest.fixture(scope="session", params=["tiny_llama", "tiny_qwen2"])
def tiny_model(request) -> Path:
    """Both architectures: Llama with GQA, Qwen2 with qkv bias and tied embeddings."""
    return request.getfixturevalue(request.param)


@functools.lru_cache(maxsize=None)
def _hf_model(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **hf_attention(path)).eval()


def hf_attention(path: str) -> dict:
    """Eager attention for models that soft-cap attention scores (Gemma 2): some transformers
    releases (5.17) run them through SDPA, which drops the cap, so the reference would be wrong."""
    import json
    from pathlib import Path

    config = json.loads((Path(path) / "config.json").read_text())
    return {"attn_implementation": "eager"} if config.get("attn_logit_softcapping") else {}


@functools.lru_cache(maxsize=None)
def hf_greedy(path: str, prompt: tuple[int, ...], max_new_tokens: int, min_new_tokens: int = 0) -> list[int]:
    """Hugging Face transformers greedy `generate` output ids (the reference), fp32, batch 1."""
    import torch

    model = _hf_model(path)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            min_new_tokens=min_new_tokens,
            pad_token_id=model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0,
        )
    return out[0, len(prompt) :].tolist()


def random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@functools.lru_cache(maxsize=None)
def hf_beams(
    path: str,
    prompt: tuple[int, ...],
    max_new_tokens: int,
    num_beams: int,
    num_return: int,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    min_new_tokens: int = 0,
) -> list[list[int]]:
    """Hugging Face transformers beam search (`generate(num_beams=..., do_sample=False)`), fp32:
    the `num_return` best beams' output ids, each cut after its end-of-sequence token."""
    import torch

    model = _hf_model(path)
    eos = model.config.eos_token_id
    eos_ids = set(eos) if isinstance(eos, list) else {eos}
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens,
            do_sample=False,
            num_beams=num_beams,
            num_return_sequences=num_return,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            pad_token_id=min(eos_ids),
        )
    beams = []
    for row in out[:, len(prompt) :].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        beams.append(row[:end])
    return beams
