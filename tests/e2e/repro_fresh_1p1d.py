"""Fresh-start check of 1P1D exactness under chunked prefill: start a new 1P1D server (24-token
prefill budget), send four prompts x4 at once with mixed max_tokens, compare each text with HF's
greedy output; repeat with a new server each time. Before the prompt-tail scheduling fix (a
prompt's last token left alone by chunking was a decode, so its KV never reached the decode
worker: engine/scheduler.py `_decodes`) about 1 fresh start in 5-15 mismatched here, and 8 of 126
on 2-core slices of a 16-core machine; a warm server's later rounds seldom chunk that way. Not a
pytest test (minutes of server starts); the fix's regression tests are
tests/prefill_node/test_kv_streamer_plan.py and tests/e2e/test_kv_matches_colocated.py.

    python -m tests.e2e.repro_fresh_1p1d --starts 20 [--spec] [-- extra serve flags]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import random
import tempfile
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from pdserve.modelgen.make_model import make_model
from tests.conftest import hf_greedy, random_prompts
from tests.e2e.cluster import running_server

MAX_NEW = 40
SPEC = json.dumps(  # tests/e2e/test_speculation.py's config
    {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 1,
        "measure_payoff": False,
    }
)


def one_start(model: Path, extra: list[str], seed: int) -> int:
    tok = AutoTokenizer.from_pretrained(model)
    phrase = random_prompts(tok.vocab_size, [6], seed=8)[0]
    prompts = random_prompts(tok.vocab_size, [7, 30], seed=11) + [phrase * 3, phrase + [5, 9] + phrase]
    want = [hf_greedy(str(model), tuple(p), MAX_NEW) for p in prompts]
    rng = random.Random(seed)
    jobs = [(i, rng.choice([3, 6, 11, MAX_NEW])) for i in range(len(prompts)) for _ in range(4)]
    rng.shuffle(jobs)

    def complete(base: str, job: tuple[int, int]) -> str:
        body = {"prompt": prompts[job[0]], "max_tokens": job[1], "temperature": 0}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        r.raise_for_status()
        return r.json()["choices"][0]["text"]

    bad = 0
    with running_server(model, "--max-num-batched-tokens", "24", *extra) as base:
        with cf.ThreadPoolExecutor(len(jobs)) as pool:
            got = list(pool.map(lambda j: complete(base, j), jobs))
    for (i, n), text in zip(jobs, got):
        expected = tok.decode(want[i][:n], skip_special_tokens=True)
        if text != expected:
            bad += 1
            print(f"prompt {i} max_tokens {n}:\n  got  {text!r}\n  want {expected!r}", flush=True)
    return bad


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--starts", type=int, default=20)
    ap.add_argument("--spec", action="store_true", help="with n-gram speculation (the test's config)")
    ap.add_argument("extra", nargs="*", help="more `pdserve serve` flags (after --)")
    args = ap.parse_args()
    model = make_model(Path(tempfile.mkdtemp()) / "tiny-llama", preset="tiny", arch="llama", seed=1)
    extra = (["--speculative-config", SPEC] if args.spec else []) + args.extra
    hits = 0
    for k in range(args.starts):
        bad = one_start(model, extra, k)
        hits += bad > 0
        print(f"start {k}: {bad} mismatched", flush=True)
    print(f"{hits} of {args.starts} fresh starts had a mismatch")


if __name__ == "__main__":
    main()
