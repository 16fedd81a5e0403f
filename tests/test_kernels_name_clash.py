"""Our top-level `kernels` package vs Hugging Face's PyPI package `kernels` (hub kernels).

How transformers 5.x probes for HF `kernels` (transformers/utils/import_utils.py):
`is_kernels_available()` -> `_is_package_available("kernels", return_version=True)`:
  1. `importlib.util.find_spec("kernels")` -- finds OURS, so "exists" is True;
  2. version: `importlib.metadata.version("kernels")` fails (no distribution of that name), then
     the distributions owning the top-level name (`packages_distributions()`: "pdserve" when pdserve
     is installed) -> pdserve's own version; with no metadata at all (bare source checkout) it
     imports our package and reads `__version__` (absent -> "N/A");
  3. available only if KERNELS_MIN_VERSION <= version < KERNELS_MAX_VERSION (0.18.2 .. 0.19).
If that ever said True, `transformers.integrations.hub_kernels` would run
`from kernels import CUDAProperties, ...` against our package and raise ImportError. So our
`kernels` must not define `__version__`, and pdserve's version must stay outside that window.
"""
from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
import torch

import kernels

REPO = Path(__file__).resolve().parents[1]

iu = pytest.importorskip("transformers.utils.import_utils")


def _in_hub_window(ver: str) -> bool:
    from packaging import version
    lo = getattr(iu, "KERNELS_MIN_VERSION", "0.0.0")
    hi = getattr(iu, "KERNELS_MAX_VERSION", "999")
    try:
        return version.parse(lo) <= version.parse(ver) < version.parse(hi)
    except version.InvalidVersion:
        return False


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def test_ours_is_the_importable_kernels():
    assert Path(kernels.__file__).resolve().parent == REPO / "kernels"
    assert not hasattr(kernels, "__version__"), "a __version__ could make transformers take ours for HF kernels"
    assert not hasattr(kernels, "get_kernel")
    assert {"AttentionMetadata", "store_kv", "paged_attention"} <= set(kernels.__all__)


def test_transformers_probe_says_hf_kernels_unavailable():
    if not hasattr(iu, "is_kernels_available"):
        pytest.skip("this transformers has no is_kernels_available")
    exists, ver = iu._is_package_available("kernels", return_version=True)
    assert exists  # find_spec sees our package ...
    assert ver == "N/A" or not _in_hub_window(ver), (
        f"transformers reads our `kernels` as version {ver} (pdserve's version?), inside HF kernels' window")
    assert iu.is_kernels_available() is False  # ... but the version check rejects it
    assert iu.is_kernels_available.__wrapped__() is False  # recomputed, not the lru_cache


def test_probe_without_distribution_metadata(monkeypatch):
    """Bare source checkout (no dist-info): transformers imports our package to read __version__."""
    if not hasattr(iu, "is_kernels_available"):
        pytest.skip("this transformers has no is_kernels_available")

    def no_metadata(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", no_metadata)
    exists, ver = iu._is_package_available("kernels", return_version=True)
    assert (exists, ver) == (True, "N/A")
    assert iu.is_kernels_available.__wrapped__() is False


def test_hub_kernel_code_paths_degrade_cleanly():
    import transformers.integrations.hub_kernels  # noqa: F401  (guards its `from kernels import ...`)
    if hasattr(iu, "is_flash_attn_kernel_fallback_available"):
        assert iu.is_flash_attn_kernel_fallback_available(2) is False
    model = _tiny_llama()
    if hasattr(model, "set_use_kernels"):
        with pytest.raises(ValueError, match="(?i)kernels"):
            model.set_use_kernels(True)  # a clear "not available", not an ImportError from ours
        model.set_use_kernels(False)


def test_tiny_llama_forward_and_reload(tmp_path):
    from transformers import AutoModelForCausalLM
    model = _tiny_llama()
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (2, 7, 64) and torch.isfinite(logits).all()
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, logits)
