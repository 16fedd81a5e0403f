"""A model served through transformers' modelling code (GPT-NeoX at the bench shape) keeps its
stream exact when the decode worker running it is SIGKILLed mid-stream: the request migrates to
the other decode worker (the prompt and what was generated are prefilled again there) and the
text equals HF greedy, no token lost or doubled; every live ledger balances afterwards."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tests.conftest import random_prompts
from tests.reliability.test_process_faults import check_killed_decode_worker_migrates_exactly

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bench_neox(tmp_path_factory):
    from pdserve.modelgen.make_model import make_model

    return make_model(tmp_path_factory.mktemp("neox") / "neox", preset="bench", arch="gpt_neox", seed=3, quiet=True)


def test_killed_decode_worker_migrates_a_transformers_model_exactly(bench_neox):
    tok = AutoTokenizer.from_pretrained(bench_neox)
    prompt = random_prompts(tok.vocab_size, [21], seed=23)[0]
    # 400 tokens: seconds of decoding through the transformers path, time to catch it mid-stream
    check_killed_decode_worker_migrates_exactly(
        bench_neox, prompt, 400, "--max-model-len", "1024", "--model-impl", "transformers"
    )
