"""EleutherAI's lm-eval harness against pdserve: its `local-completions` model (loglikelihoods from
echo + logprobs, generations from plain completions) on a small multiple-choice task and a
generate_until task made from local files, compared with lm-eval's own `hf` backend on the same
model folder: every choice's loglikelihood within 1e-3, its is_greedy and every greedy
generation equal; disaggregated (1P1D) and colocated."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import tiny_llama_server

pytestmark = pytest.mark.slow

TOL = 1e-3
MC_DOCS = [
    {"question": "The sky on a clear day is", "choices": ["blue", "green", "loud"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["three", "four", "five apples"], "answer": 1},
    {"question": "A cat says", "choices": ["woof", "moo", "meow"], "answer": 2},
    {"question": "Water freezes at zero degrees", "choices": ["Celsius", "Kelvin", "of freedom"], "answer": 0},
]
GEN_DOCS = [
    {"question": "Once upon a time", "answer": "there"},
    {"question": "The capital of France is", "answer": "Paris"},
    {"question": "def add(a, b):", "answer": "return"},
]
MC_TASK = """task: pdserve_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: question
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
"""
GEN_TASK = """task: pdserve_tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: question
doc_to_target: answer
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 12
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""
TASKS = ["pdserve_tiny_mc", "pdserve_tiny_gen"]


def write_tasks(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, docs, yaml in (("mc", MC_DOCS, MC_TASK), ("gen", GEN_DOCS, GEN_TASK)):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (folder / f"{name}.yaml").write_text(yaml.format(data=data))
    return folder


def evaluate(model: str, model_args: dict, task_dir: Path) -> dict[str, list]:
    """lm-eval's per-document responses of each task: (loglikelihood, is_greedy) per choice, or
    the generation."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=TASKS,
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),  # (not its 10k tasks)
        batch_size=1,
        log_samples=True,
        bootstrap_iters=0,
    )
    assert out is not None
    return {task: [s["resps"] for s in sorted(out["samples"][task], key=lambda s: s["doc_id"])] for task in TASKS}


@functools.lru_cache(maxsize=None)
def hf_reference(model: Path, task_dir: Path) -> dict[str, list]:
    return evaluate("hf", {"pretrained": str(model), "dtype": "float32", "device": "cpu"}, task_dir)


@pytest.mark.parametrize("mode", ["1P1D", "colocated"])
def test_local_completions_match_the_hf_backend(request, tiny_llama, tmp_path_factory, mode, record_property):
    task_dir = write_tasks(tmp_path_factory.getbasetemp() / "lm_eval_tasks")
    want = hf_reference(tiny_llama, task_dir)
    # requests only, no counter read: the package's shared servers (tests/e2e/conftest.py)
    with tiny_llama_server(request, *(["--colocated"] if mode == "colocated" else [])) as base:
        served = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        got = evaluate(
            "local-completions",
            {
                "model": served,
                "base_url": f"{base}/v1/completions",
                "tokenizer": str(tiny_llama),
                "tokenizer_backend": "huggingface",
                "tokenized_requests": True,
                "num_concurrent": 1,
                "max_retries": 1,
                "max_length": 512,
                "timeout": 60,
            },
            task_dir,
        )
    worst = 0.0
    for doc_got, doc_want in zip(got["pdserve_tiny_mc"], want["pdserve_tiny_mc"], strict=True):
        for [(ll, greedy)], [(ll_hf, greedy_hf)] in zip(doc_got, doc_want, strict=True):
            worst = max(worst, abs(ll - ll_hf))
            assert abs(ll - ll_hf) <= TOL and greedy == greedy_hf
    assert got["pdserve_tiny_gen"] == want["pdserve_tiny_gen"]
    record_property("max_loglikelihood_diff_vs_lm_eval_hf", worst)
    choices = sum(len(d["choices"]) for d in MC_DOCS)
    print(f"{mode}: max |loglikelihood - lm-eval hf| = {worst:.2e} over {choices} choices")
