"""Native Gemma 2, Gemma 3 and windowed Mistral / Qwen2: greedy output == HF generate (fp32) token
for token, prompts longer than the window (32 tokens, 16-token blocks) and generation crossing it,
on both CPU attention paths (C kernels; PDSERVE_ATTENTION=torch), in a batch on a warm prefix
cache, with chunked prefill, and across a prefill -> decode KV hand-off."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pdserve.engine.config import ModelConfig
from pdserve.engine.llm_engine import PREFILLED
from pdserve.env import reload as reload_env
from pdserve.protocol.sampling import SamplingParams
from tests.conftest import hf_greedy, random_prompts
from tests.engine.family_checks import make_engine

MAX_NEW = 24
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
WINDOW = 32
FAMILIES = {  # make_model arguments; untied embeddings keep tiny models' greedy output varied
    "gemma2": dict(arch="gemma2", seed=4, tie_word_embeddings=False),
    "gemma3": dict(arch="gemma3", seed=4, tie_word_embeddings=False),
    "mistral": dict(arch="mistral", seed=4, tie_word_embeddings=False),
    "qwen2": dict(  # layer 0 full, layers 1-2 windowed (max_window_layers)
        arch="qwen2",
        seed=4,
        num_layers=3,
        tie_word_embeddings=False,
        hf_config={"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    ),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def windowed_model(request, models_dir) -> Path:
    from pdserve.modelgen.make_model import make_model

    return make_model(models_dir / f"swa-{request.param}", quiet=True, **FAMILIES[request.param])


@pytest.fixture(params=["c-kernels", "torch"])
def attention_path(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setenv("PDSERVE_ATTENTION", "torch")
    else:
        monkeypatch.delenv("PDSERVE_ATTENTION", raising=False)
    reload_env()
    return request.param


def prompts_for(vocab: int) -> list[list[int]]:
    """Past the window (100, 70, 45), inside it (20, 5), and two sharing the 100-token one's
    first 48 tokens (3 cached blocks, one of them wholly before the window)."""
    base = random_prompts(vocab, [70, 45, 20, 100, 5], seed=3)
    return base + [base[3][:48] + base[2], base[3][:48] + base[4]]


def expected(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    return [hf_greedy(str(model), tuple(p), MAX_NEW) for p in prompts]


def test_config_reads_the_windows_per_layer(windowed_model):
    cfg = ModelConfig.from_folder(windowed_model)
    want = {"Gemma2ForCausalLM": (32, 0), "Gemma3ForCausalLM": (32, 0), "MistralForCausalLM": (32, 32)}
    assert cfg.layer_windows == want.get(cfg.architecture, (0, 32, 32))
    assert cfg.impl == "native" and cfg.max_context == cfg.max_position_embeddings  # no more capping


@pytest.mark.parametrize(("arch", "pattern"), [("gemma2", None), ("gemma3", None), ("gemma3", 3)])
def test_configs_without_layer_types_get_hfs_pattern(arch, pattern, tmp_path, models_dir):
    """Checkpoints saved before transformers listed `layer_types` (most Gemma 2/3 ones on the Hub):
    the windows follow the pattern transformers derives for them."""
    from transformers import AutoConfig

    from pdserve.modelgen.make_model import make_model

    model = make_model(models_dir / f"swa-{arch}", quiet=True, **FAMILIES[arch])
    changes = {"num_hidden_layers": 7, "sliding_window_pattern": pattern}
    folder = _without(model, tmp_path, **{k: v for k, v in changes.items() if v is not None})
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["layer_types"]
    cfg.pop("_sliding_window_pattern", None)
    (folder / "config.json").write_text(json.dumps(cfg))
    hf_types = AutoConfig.from_pretrained(folder).layer_types
    assert len(set(hf_types)) == 2
    want = tuple(WINDOW if t == "sliding_attention" else 0 for t in hf_types)
    assert ModelConfig.from_folder(folder).layer_windows == want


def test_batch_on_a_warm_prefix_cache(windowed_model, attention_path):
    engine = make_engine(windowed_model, block_size=16, num_blocks=128)
    prompts = prompts_for(engine.model_config.vocab_size)
    want = expected(windowed_model, prompts)
    assert len({tuple(w) for w in want}) == len(want) and all(len(set(w)) > 3 for w in want[:4])
    assert engine.generate(prompts, GREEDY) == want
    hits = engine.scheduler.prefix_hit_tokens
    assert engine.generate(prompts, GREEDY) == want
    assert engine.scheduler.prefix_hit_tokens > hits, "the second pass was meant to hit the prefix cache"
    engine.pool.assert_all_free()


def test_chunked_prefill(windowed_model, attention_path):
    """A 13-token budget: chunks start inside and past the window, over earlier chunks' KV."""
    engine = make_engine(windowed_model, block_size=16, num_blocks=128, max_num_batched_tokens=13)
    prompts = prompts_for(engine.model_config.vocab_size)[:4]
    assert engine.generate(prompts, GREEDY) == expected(windowed_model, prompts)
    engine.pool.assert_all_free()


def test_prefill_to_decode_handoff(windowed_model):
    """P prefills (chunked), its blocks are copied into D's pool, D decodes across the window."""
    prefill = make_engine(windowed_model, block_size=16, num_blocks=128, max_num_batched_tokens=40)
    decode = make_engine(windowed_model, block_size=16, num_blocks=128)
    prompts = prompts_for(prefill.model_config.vocab_size)[:4]
    outs: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        prefill.add_request(f"r{i}", p, GREEDY, prefill_only=True)
    while prefill.has_work():
        sched = prefill.schedule()
        tables = {c.seq.request_id: list(c.seq.block_table) for c in sched.chunks}
        for o in prefill.execute(sched):
            assert o.finish_reason in (PREFILLED, "stop")
            src = tables[o.request_id]
            dst = decode.pool.allocate(len(src))
            decode.kv_cache[:, :, dst] = prefill.kv_cache[:, :, src]  # [L, 2, n, bs, Hkv, D]
            decode.add_prefilled(o.request_id, o.seq.prompt_token_ids, o.new_token_ids[0], None, GREEDY, dst)
            outs[o.request_id] = list(o.new_token_ids)
    while decode.has_work():
        for o in decode.step():
            outs[o.request_id] += o.new_token_ids
    assert [outs[f"r{i}"] for i in range(len(prompts))] == expected(windowed_model, prompts)
    decode.pool.assert_all_free()


def _without(model: Path, tmp_path: Path, **changes) -> Path:
    folder = tmp_path / f"{model.name}-changed"
    shutil.copytree(model, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize(
    ("family", "changes"),
    [
        ("mistral", {"sliding_window": None}),
        ("gemma3", {"sliding_window": 4096}),
        ("gemma2", {"attn_logit_softcapping": None}),
    ],
)
def test_the_prompts_exercise_what_they_check(family, changes, models_dir, tmp_path):
    """HF itself answers differently without the window (or a soft-cap): the checks above would
    catch an engine that ignored it."""
    from pdserve.modelgen.make_model import make_model

    model = make_model(models_dir / f"swa-{family}", quiet=True, **FAMILIES[family])
    prompts = prompts_for(512)[:4]
    assert expected(model, prompts) != expected(_without(model, tmp_path, **changes), prompts)


def test_gemma2_logprobs_are_those_of_the_soft_capped_logits(models_dir):
    """The final soft-cap keeps the argmax (tanh is monotonic): it shows in the logprobs."""
    import torch

    from pdserve.modelgen.make_model import make_model
    from tests.conftest import _hf_model

    model = make_model(models_dir / "swa-gemma2", quiet=True, **FAMILIES["gemma2"])
    prompt = prompts_for(512)[0]
    with torch.no_grad():
        logits = _hf_model(str(model))(torch.tensor([prompt])).logits[0, -1]  # [V], soft-capped by HF
    assert float(logits.abs().max()) < 8.0  # the cap of make_model's gemma2
    want = torch.log_softmax(logits.double(), -1)
    engine = make_engine(model, block_size=16, num_blocks=128)
    engine.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0.0, logprobs=3))
    out = [o for o in engine.step() if o.logprobs][0].logprobs
    assert out is not None
    top = out[0]
    assert top.top_ids == want.topk(3).indices.tolist()
    assert top.top_logprobs == pytest.approx(want.topk(3).values.tolist(), abs=1e-4)


def test_the_fused_decode_driver_says_no_to_windows(models_dir):
    from pdserve.modelgen.make_model import make_model

    engine = make_engine(make_model(models_dir / "swa-mistral", quiet=True, **FAMILIES["mistral"]))
    assert engine.model_config.layer_windows and engine.runner.decode_layers is None


def test_blocks_every_window_has_passed_go_back_to_the_pool(models_dir, attention_path):
    """Mistral (every layer windowed): a sequence holds the blocks its window still reads, not its
    whole history; the ones left behind return to the pool as it decodes (their cached contents
    still serve a later prompt sharing them), and the output stays HF's."""
    from pdserve.modelgen.make_model import make_model

    model = make_model(models_dir / "swa-mistral", quiet=True, **FAMILIES["mistral"])
    engine = make_engine(model, block_size=16, num_blocks=64, max_model_len=512)
    prompt = random_prompts(engine.model_config.vocab_size, [40], seed=11)[0]
    long = SamplingParams(max_tokens=160, temperature=0.0)
    engine.add_request("r", prompt, long)
    seq, held_most, out = engine.seqs["r"], 0, []
    while engine.has_work():
        for o in engine.step():
            out += o.new_token_ids
        if not seq.is_finished:
            held_most = max(held_most, len(seq.block_table) - seq.num_released_blocks)
    assert out == hf_greedy(str(model), tuple(prompt), 160)
    # 200 tokens span 13 blocks; the window (32) spans at most 3, plus the one being written
    assert held_most <= WINDOW // 16 + 2 and engine.scheduler.num_released_blocks >= 9
    engine.pool.assert_all_free()
    assert engine.generate([prompt], GREEDY) == [hf_greedy(str(model), tuple(prompt), MAX_NEW)]
    engine.pool.assert_all_free()
