"""Gemma 2 and Gemma 3 (native, 32-token sliding windows, soft-capping) keep a stream exact when
the decode worker running it is SIGKILLed mid-stream: the request migrates (its prompt and what
was generated are prefilled again on the other decode worker, far past the window) and the text
equals HF greedy, no token lost or doubled; the killed worker is restarted and every live ledger
balances afterwards."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tests.conftest import random_prompts
from tests.reliability.test_process_faults import check_killed_decode_worker_migrates_exactly

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma(request, tmp_path_factory):
    from pdserve.modelgen.make_model import make_model

    folder = tmp_path_factory.mktemp(request.param) / request.param
    # the bench shape: seconds of decoding, time to catch the stream mid-way
    return make_model(folder, preset="bench", arch=request.param, seed=4, quiet=True, tie_word_embeddings=False)


def test_killed_decode_worker_migrates_a_gemma_stream_exactly(gemma):
    tok = AutoTokenizer.from_pretrained(gemma)
    prompt = random_prompts(tok.vocab_size, [40], seed=23)[0]  # past the window from the start
    check_killed_decode_worker_migrates_exactly(gemma, prompt, 200, "--max-model-len", "1024")
