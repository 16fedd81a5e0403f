"""Qwen3, Phi-3 (fused qkv and gate_up) and windowed Mistral (native paths) keep a stream exact
when the decode worker running it is SIGKILLed mid-stream: the request migrates (its prompt and
what was generated are prefilled again on the other decode worker; Mistral's far past its 32-token
window) and the text equals HF greedy, no token lost or doubled; the killed worker is restarted
and every live ledger balances afterwards. (Gemma: test_gemma_migration.py; the transformers
backend's families: test_transformers_migration.py.)"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tests.conftest import random_prompts
from tests.reliability.test_process_faults import check_killed_decode_worker_migrates_exactly

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["qwen3", "phi3", "mistral"])
def family(request, tmp_path_factory):
    from pdserve.modelgen.make_model import make_model

    folder = tmp_path_factory.mktemp(request.param) / request.param
    # the bench shape: seconds of decoding, time to catch the stream mid-way
    return make_model(folder, preset="bench", arch=request.param, seed=6, quiet=True)


def test_killed_decode_worker_migrates_a_native_family_stream_exactly(family):
    tok = AutoTokenizer.from_pretrained(family)
    prompt = random_prompts(tok.vocab_size, [40], seed=29)[0]
    check_killed_decode_worker_migrates_exactly(family, prompt, 200, "--max-model-len", "1024")
