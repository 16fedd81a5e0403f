"""The width of a KV pool's rows by its dtype name, for every layer that maps or checks a pool
(torch-free: the layout travels in messages). A quantized pool (--kv-cache-dtype int8|fp8,
kernels/kv_quant.py) stores each head's row as its `head_dim` one-byte values followed by their
fp32 scale: int8 values in a pool of dtype int8, fp8 e4m3 values in a pool of dtype uint8. Any
other dtype stores `head_dim` values."""

from __future__ import annotations

SCALE_BYTES = 4  # one fp32 after the values of a quantized row

# a quantized pool's dtype name -> the --kv-cache-dtype that makes it
QUANTIZED_POOL_DTYPES = {"int8": "int8", "uint8": "fp8"}


def row_width(head_dim: int, dtype: str) -> int:
    """Elements of a pool row (its last axis) for `head_dim` values stored as `dtype` ("int8", "uint8", "float32", ...)."""
    flag = QUANTIZED_POOL_DTYPES.get(dtype)
    if flag is None:
        return head_dim
    if head_dim % 4:
        raise ValueError(f"--kv-cache-dtype {flag} needs head_dim a multiple of 4, got {head_dim}")
    return head_dim + SCALE_BYTES


def describe(dtype: str) -> str:
    """A pool's dtype name, with the --kv-cache-dtype that makes it where that is not "auto"
    ("uint8 (--kv-cache-dtype fp8)"): for messages that tell people which flag differs."""
    flag = QUANTIZED_POOL_DTYPES.get(dtype)
    return dtype if flag is None else f"{dtype} (--kv-cache-dtype {flag})"


# What a model fingerprint (engine/config.py ModelConfig.fingerprint) gains for a --kv-cache-dtype
# other than "auto": pools exchange KV only when their fingerprints match.
FINGERPRINT_TAG = "/kv-"


def fingerprint_tag(kv_cache_dtype: str) -> str:
    """The fingerprint's suffix for `kv_cache_dtype` ("" for auto)."""
    return "" if kv_cache_dtype == "auto" else f"{FINGERPRINT_TAG}{kv_cache_dtype}"


def split_fingerprint(fingerprint: str) -> tuple[str, str]:
    """A fingerprint -> (the model, its dtype and weights; the --kv-cache-dtype it names)."""
    model, tag, kv = fingerprint.partition(FINGERPRINT_TAG)
    return model, kv if tag else "auto"
