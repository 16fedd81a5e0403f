"""Attention over the paged KV cache: pure-torch (CPU, reference) and Triton (CUDA) twins.

Installed as `pdserve.kernels` (the folder keeps the layout's name): no top-level `kernels`
package to clash with Hugging Face's hub package of that name (tests/test_packaging.py).
"""

from pdserve.kernels.attention import paged_attention, store_kv
from pdserve.kernels.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "paged_attention", "store_kv"]
