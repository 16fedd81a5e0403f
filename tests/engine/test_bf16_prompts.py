"""--prompt-linears bf16 on a GGUF file's K-quant blocks: a step's prompt rows go through the bf16
kernel, its decode rows through the int8 one, so every token's logits (its logprob, to the bit)
depend neither on how prompts were batched or chunked, nor on which decodes shared their steps."""

from __future__ import annotations

import pytest

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kernels import block_gemm
from pdserve.protocol.sampling import SamplingParams
from tests.engine.family_checks import prompts_for
from tests.engine.test_gguf_blocks_kept import k_quant_source  # noqa: F401 (fixture)

pytestmark = pytest.mark.skipif(not block_gemm.available(), reason="no C compiler")
SAMPLING = SamplingParams(max_tokens=6, temperature=0.0, logprobs=4, ignore_eos=True)


@pytest.fixture(scope="module")
def q4_k_m_file(k_quant_source, tmp_path_factory):  # noqa: F811
    from pdserve.modelgen.gguf_writer import write_gguf

    return write_gguf(k_quant_source, tmp_path_factory.mktemp("bf16p") / "m.gguf", "q4_k_m")


def bf16_engine(file, budget: int = 512) -> LLMEngine:
    config = EngineConfig(
        model=str(file),
        dtype="float32",
        prompt_linears="bf16",
        cache=CacheConfig(block_size=4, num_blocks=512),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=budget, max_model_len=256),
    )
    return LLMEngine(config, show_progress=False)


def run(engine: LLMEngine, prompts: list[list[int]], stagger: bool = False) -> list[list[tuple]]:
    """Each prompt's tokens, each with the 4 likeliest and their logprobs; `stagger`: each prompt
    added a step after the last."""
    out: dict[str, list[tuple]] = {f"r{i}": [] for i in range(len(prompts))}
    pending = list(enumerate(prompts))
    while pending or engine.has_work():
        for i, p in pending[: 1 if stagger else len(pending)]:
            engine.add_request(f"r{i}", p, SAMPLING)
        pending = pending[1:] if stagger else []
        for o in engine.step():
            assert o.logprobs is not None
            out[o.request_id] += [(t.token_id, t.top_ids, t.top_logprobs) for t in o.logprobs]
    engine.pool.assert_all_free()
    return [out[f"r{i}"] for i in range(len(prompts))]


def test_prompt_rows_take_bf16_and_decode_rows_int8(q4_k_m_file, monkeypatch):
    """A step of decodes and a prompt's chunk: each linear on the blocks gets the decodes' rows in
    int8 and the chunk's in bf16 (the LM head: its sampled rows in int8)."""
    engine = bf16_engine(q4_k_m_file)
    calls: list[tuple[str, int]] = []
    for name in ("linear", "linear_bf16"):
        real = getattr(block_gemm, name)
        monkeypatch.setattr(
            block_gemm,
            name,
            lambda x, w, b, _n=name, _f=real, **kw: calls.append((_n, x.shape[0])) or _f(x, w, b, **kw),
        )
    prompts = prompts_for(engine.model_config.vocab_size)
    engine.add_request("a", prompts[1], SAMPLING)
    engine.add_request("b", prompts[3], SAMPLING)
    engine.step()  # both prompts: 17 + 24 rows, all in bf16 (the head: 2 sampled rows)
    assert {c for c in calls if c[0] == "linear_bf16"} == {("linear_bf16", 41)}
    assert {c for c in calls if c[0] == "linear"} == {("linear", 2)}
    engine.add_request("c", prompts[2], SAMPLING)
    calls.clear()
    engine.step()  # 2 decodes + a 33-token prompt
    assert {c for c in calls if c[0] == "linear_bf16"} == {("linear_bf16", 33)}
    assert ("linear", 2) in calls and ("linear", 3) in calls  # the decodes' rows; the head's 3 rows
    while engine.has_work():
        engine.step()


def test_logprobs_do_not_depend_on_batching_chunking_or_neighbours(q4_k_m_file):
    prompts = prompts_for(bf16_engine(q4_k_m_file).model_config.vocab_size)
    together = run(bf16_engine(q4_k_m_file), prompts)
    assert run(bf16_engine(q4_k_m_file, budget=7), prompts) == together  # chunks of 7 beside decodes
    assert run(bf16_engine(q4_k_m_file), prompts, stagger=True) == together  # each prompt beside others' decodes
    alone = bf16_engine(q4_k_m_file)
    assert [run(alone, [p])[0] for p in prompts] == together  # one at a time (cached prefixes reused)
