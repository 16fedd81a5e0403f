"""Attention over the paged KV cache: pure-torch (CPU, reference) and Triton (CUDA) twins.

Named `kernels` by the project layout; HF's hub package of the same name is unrelated
(tests/test_kernels_name_clash.py checks transformers is not confused by ours).
"""
from kernels.attention import paged_attention, store_kv
from kernels.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "paged_attention", "store_kv"]
