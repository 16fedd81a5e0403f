"""A model served through transformers' modelling code (GPT-NeoX at the bench shape) keeps its
stream exact when the decode worker running it is SIGKILLed mid-stream: the request migrates to
the other decode worker (the prompt and what was generated are prefilled again there) and the
text equals HF greedy, no token lost or doubled; every live ledger balances afterwards."""

from __future__ import annotations

import os
import signal

import pytest
from transformers import AutoTokenizer

from tests.conftest import random_prompts
from tests.reliability.procs import busy_worker_pid, live_workers, served, wait_until
from tests.reliability.test_process_faults import Stream, check_after, greedy, hf_text

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bench_neox(tmp_path_factory):
    from pdserve.engine.make_model import make_model

    return make_model(tmp_path_factory.mktemp("neox") / "neox", preset="bench", arch="gpt_neox", seed=3, quiet=True)


def test_killed_decode_worker_migrates_a_transformers_model_exactly(bench_neox):
    n = 400  # seconds of decoding through the transformers path: time to catch it mid-stream
    tok = AutoTokenizer.from_pretrained(bench_neox)
    prompt = random_prompts(tok.vocab_size, [21], seed=23)[0]
    want = hf_text(tok, bench_neox, prompt, n)
    with served(bench_neox, "--decode-workers", "2", "--max-model-len", "1024", "--model-impl", "transformers") as s:
        assert wait_until(lambda: len(live_workers(s.base, "decode")) == 2, 90) is not None
        stream = Stream(s.base, {**greedy(n, prompt), "logprobs": 1})  # one event per token
        stream.wait_pieces(2)
        killed = busy_worker_pid(s.base, "decode")
        assert killed is not None, "no decode worker reports the running request"
        os.kill(killed, signal.SIGKILL)
        assert stream.finish is None, "not caught mid-stream"
        stream.join()
        assert stream.finish == "length" and stream.text == want  # migrated: nothing lost or doubled
        assert len(stream.pieces) == n
        assert wait_until(lambda: len(live_workers(s.base, "decode")) == 2, 90) is not None  # restarted
        check_after(s.base)
