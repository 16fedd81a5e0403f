"""Families without a native path, served through transformers' modelling code with pdserve's
paged KV cache (engine/models/transformers_backend.py): greedy output == HF generate (fp32, same
weights) in a decode batch on a warm prefix cache, chunked, and handed from prefill to decode."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.engine.config import ModelConfig
from pdserve.modelgen.make_model_families import TRANSFORMERS_ARCHS
from tests.engine import family_checks


@pytest.fixture(scope="module", params=TRANSFORMERS_ARCHS)
def family(request, models_dir) -> Path:
    from pdserve.modelgen.make_model import make_model

    return make_model(models_dir / f"tiny-{request.param}", preset="tiny", arch=request.param, seed=6, quiet=True)


def test_config_is_derived_for_transformers(family):
    cfg = ModelConfig.from_folder(family)
    assert cfg.impl == "transformers"
    assert (cfg.num_layers, cfg.head_dim, cfg.vocab_size) == (2, 16, 512)
    assert cfg.fingerprint("float32").endswith("/transformers")
    assert cfg.eos_token_ids  # from generation_config.json


def test_batch_with_prefix_cache_matches_hf(family):
    engine = family_checks.check_batch_with_prefix_cache(family)
    assert engine.runner.decode_layers is None


def test_chunked_prefill_matches_hf(family):
    family_checks.check_chunked_prefill(family)


def test_prefill_to_decode_handoff_matches_hf(family):
    family_checks.check_prefill_to_decode_handoff(family)


def test_logits_equal_hf_forward(family):
    """Logits, not only their argmax: what greedy cannot see (Granite's logits_scaling, the
    attention scale) is checked here."""
    import torch

    from tests.conftest import _hf_model, random_prompts

    engine = family_checks.make_engine(family)
    prompts = random_prompts(engine.model_config.vocab_size, [11, 4], seed=9)
    runner = engine.runner
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, family_checks.GREEDY)
    sched = engine.schedule()
    fp = runner.begin(sched)
    runner.run_layers(fp)
    got = runner.logits(fp)  # [2, V]
    with torch.no_grad():
        want = torch.cat([_hf_model(str(family))(torch.tensor([p])).logits[:, -1] for p in prompts])
    assert got is not None
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
