"""Mixtures of experts served natively (engine/models/moe.py): Qwen3-MoE (a dense first layer,
top-k renormalised), Qwen2-MoE (a gated shared expert, qkv bias) and Mixtral; greedy output ==
HF generate (fp32) in every engine mode, the router exact against HF's, and experts split by
rank under tensor parallelism."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.config import ModelConfig
from pdserve.engine.models.moe import SparseMoeBlock
from tests.engine import family_checks

ARCHS = {"qwen3_moe": 31, "qwen2_moe": 32, "mixtral": 33}  # arch -> seed


@pytest.fixture(scope="module", params=list(ARCHS))
def moe_model(request, models_dir) -> Path:
    from pdserve.modelgen.make_model import make_model

    arch = request.param
    return make_model(models_dir / f"tiny-{arch}", preset="tiny", arch=arch, seed=ARCHS[arch], quiet=True)


def test_config_reads_the_mixture(moe_model):
    cfg = ModelConfig.from_folder(moe_model)
    assert cfg.impl == "native" and cfg.num_experts in (4, 8) and cfg.experts_per_token == 2
    want = {
        "Qwen3MoeForCausalLM": (True, 0, (0,)),
        "Qwen2MoeForCausalLM": (False, 128, ()),
        "MixtralForCausalLM": (True, 0, ()),
    }[cfg.architecture]
    assert (cfg.norm_topk_prob, cfg.shared_expert_intermediate_size, cfg.dense_layers) == want


def test_batch_with_prefix_cache_matches_hf(moe_model):
    engine = family_checks.check_batch_with_prefix_cache(moe_model)
    assert engine.runner.decode_layers is None  # experts: the per-layer path, not the C driver
    layers = engine.runner.model.layers
    cfg = engine.model_config
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in layers] == [
        cfg.moe_layer(i) for i in range(cfg.num_layers)
    ]


def test_chunked_prefill_matches_hf(moe_model):
    family_checks.check_chunked_prefill(moe_model)


def test_prefill_to_decode_handoff_matches_hf(moe_model):
    family_checks.check_prefill_to_decode_handoff(moe_model)


def test_the_router_and_experts_equal_hf_layer_by_layer(moe_model):
    """One MoE block's output on random hidden states equals HF's block, to fp32 rounding, and
    picks the same experts."""
    from transformers import AutoModelForCausalLM

    engine = family_checks.make_engine(moe_model)
    hf = AutoModelForCausalLM.from_pretrained(str(moe_model), dtype=torch.float32).eval()
    cfg = engine.model_config
    layer = next(i for i in range(cfg.num_layers) if cfg.moe_layer(i))
    ours = engine.runner.model.layers[layer].mlp
    theirs = hf.model.layers[layer].mlp
    x = torch.randn(37, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, hf_weights, hf_experts = theirs.gate(x)
        weights, experts = ours.route(x)
        assert torch.equal(experts, hf_experts)
        torch.testing.assert_close(weights, hf_weights, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(ours(x), theirs(x[None])[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("arch", "budget"), [("qwen2_moe", 512), ("qwen3_moe", 7)])
def test_tp2_splits_experts_by_rank_and_equals_hf(models_dir, arch, budget):
    """Two ranks, each holding half the experts (and rank 0 the shared expert): greedy output is
    HF's, in one batch (Qwen2-MoE) and chunked (Qwen3-MoE, its dense layer split by rows)."""
    from pdserve.modelgen.make_model import make_model
    from tests.engine.tensor_parallel_models import tp_engine

    model = make_model(models_dir / f"tiny-{arch}", preset="tiny", arch=arch, seed=ARCHS[arch], quiet=True)
    prompts = family_checks.prompts_for(ModelConfig.from_folder(model).vocab_size)
    want = family_checks.expected(model, prompts)
    engine = tp_engine(model, 2, max_num_batched_tokens=budget)
    try:
        assert engine.generate(prompts, family_checks.GREEDY) == want
        engine.pool.assert_all_free()
    finally:
        engine.close()


def test_a_rank_builds_only_its_experts(moe_model):
    """Rank 1 of 2 holds experts E/2..E-1 under their model-wide numbers, and no shared expert."""
    from pdserve.engine.models.llama import LlamaForCausalLM
    from pdserve.engine.parallel.shard import TensorParallelShard

    cfg = ModelConfig.from_folder(moe_model)

    class Rank1:
        shard = TensorParallelShard(1, 2)

        def all_reduce(self, x):
            return x

    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, 64, Rank1())  # type: ignore[arg-type]
    block = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock))
    assert list(block.experts) == [str(e) for e in range(cfg.num_experts // 2, cfg.num_experts)]
    assert block.shared_expert is None and block.shared_expert_gate is None


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_a_streamed_folder_is_the_hubs_layout_and_serves_as_hf(tmp_path, arch):
    """`make-model --stream` (a tensor at a time, bf16): one tensor per expert under the hub's
    names, and the folder served natively equals HF on it."""
    from safetensors import safe_open

    from pdserve.engine.weights import safetensors_files
    from pdserve.modelgen.make_model import make_model_main
    from pdserve.modelgen.streamed_model import write_streamed

    folder = write_streamed(tmp_path / arch, "tiny", arch, seed=5)
    names = {n for f in safetensors_files(folder) for n in safe_open(str(f), "pt").keys()}
    expert = "block_sparse_moe.experts.7.w2.weight" if arch == "mixtral" else "mlp.experts.7.down_proj.weight"
    assert f"model.layers.1.{expert}" in names and not any(n.endswith("gate_up_proj") for n in names)
    cfg = ModelConfig.from_folder(folder)
    assert cfg.num_experts == 8 and cfg.impl == "native"
    family_checks.check_chunked_prefill(folder)
    assert make_model_main(["--out", str(tmp_path / "cli"), "--arch", arch, "--stream", "--layers", "1"]) == 0
    assert ModelConfig.from_folder(tmp_path / "cli").num_layers == 1


def test_transformers_5s_stacked_expert_tensors_load(tmp_path, models_dir):
    """A checkpoint saved from transformers 5's own state (experts stacked: mlp.experts.gate_up_proj
    [E, 2I, H], down_proj [E, H, I]) loads into one module per expert and generates HF's tokens."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from pdserve.modelgen.make_model import make_model

    source = make_model(
        models_dir / "tiny-qwen3_moe", preset="tiny", arch="qwen3_moe", seed=ARCHS["qwen3_moe"], quiet=True
    )
    stacked = tmp_path / "stacked"
    shutil.copytree(source, stacked, ignore=shutil.ignore_patterns("*.safetensors*"))
    state = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).state_dict()
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in state)
    state.pop("lm_head.weight", None)  # tied: the embedding's
    save_file({n: t.contiguous() for n, t in state.items()}, str(stacked / "model.safetensors"))
    family_checks.check_chunked_prefill(stacked)
