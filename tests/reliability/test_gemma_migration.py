"""Gemma 2 and Gemma 3 (native, 32-token sliding windows, soft-capping) keep a stream exact when
the decode worker running it is SIGKILLed mid-stream: the request migrates (its prompt and what
was generated are prefilled again on the other decode worker, far past the window) and the text
equals HF greedy, no token lost or doubled; the killed worker is restarted and every live ledger
balances afterwards."""

from __future__ import annotations

import os
import signal

import pytest
from transformers import AutoTokenizer

from tests.conftest import random_prompts
from tests.reliability.procs import busy_worker_pid, live_workers, served, wait_until
from tests.reliability.test_process_faults import Stream, check_after, greedy, hf_text

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["gemma2", "gemma3"])
def gemma(request, tmp_path_factory):
    from pdserve.engine.make_model import make_model

    folder = tmp_path_factory.mktemp(request.param) / request.param
    # the bench shape: seconds of decoding, time to catch the stream mid-way
    return make_model(folder, preset="bench", arch=request.param, seed=4, quiet=True, tie_word_embeddings=False)


def test_killed_decode_worker_migrates_a_gemma_stream_exactly(gemma):
    n = 200
    tok = AutoTokenizer.from_pretrained(gemma)
    prompt = random_prompts(tok.vocab_size, [40], seed=23)[0]  # past the window from the start
    want = hf_text(tok, gemma, prompt, n)
    with served(gemma, "--decode-workers", "2", "--max-model-len", "1024") as s:
        assert wait_until(lambda: len(live_workers(s.base, "decode")) == 2, 90) is not None
        stream = Stream(s.base, {**greedy(n, prompt), "logprobs": 1})  # one event per token
        stream.wait_pieces(5)
        killed = busy_worker_pid(s.base, "decode")
        assert killed is not None, "no decode worker reports the running request"
        os.kill(killed, signal.SIGKILL)
        assert stream.finish is None, "not caught mid-stream"
        stream.join()
        assert stream.finish == "length" and stream.text == want  # migrated: nothing lost or doubled
        assert len(stream.pieces) == n
        assert wait_until(lambda: len(live_workers(s.base, "decode")) == 2, 90) is not None  # restarted
        check_after(s.base)
