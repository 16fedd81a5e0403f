"""Which slice of the model one tensor-parallel rank holds (Megatron-style), as plain arithmetic.

    q heads      [rank * Hq/N, (rank + 1) * Hq/N)            column-parallel qkv
    KV heads     [rank * Hkv/N, ...) when N divides Hkv;     when Hkv < N (N a multiple of Hkv):
                 one KV head, replicated on N/Hkv ranks       kv head rank // (N/Hkv)
    MLP rows     [rank * I/N, (rank + 1) * I/N)              column-parallel gate_up, row-parallel down
    experts      [rank * E/N, (rank + 1) * E/N)              whole experts; every rank routes every token
    vocab rows   [rank * V/N, (rank + 1) * V/N)              vocab-parallel embedding and LM head

o_proj and down_proj are row-parallel: each rank multiplies its slice of the inputs, and one
all-reduce sums the partial outputs (their bias is held by rank 0 only, so it is added once).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.config import ModelConfig
from pdserve.kvtransfer.head_ranges import rank_kv_heads


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """Refuse, before any rank starts, a model that `size` ranks cannot split (ValueError)."""
    if size > 1 and cfg.impl != "native":
        raise ValueError("--tensor-parallel-size > 1 runs the native model path only; this model needs transformers")
    TensorParallelShard(0, size).check(cfg)


@dataclass(frozen=True)
class TensorParallelShard:
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside a tensor-parallel group of {self.size}")

    def check(self, cfg: ModelConfig) -> None:
        """Refuse a model whose heads, MLP or vocabulary this degree does not divide."""
        n = self.size
        if n == 1:
            return
        problems = []
        if cfg.num_heads % n:
            problems.append(f"{cfg.num_heads} attention heads")
        if cfg.num_kv_heads % n and n % cfg.num_kv_heads:
            problems.append(f"{cfg.num_kv_heads} KV heads (neither divides the other)")
        if cfg.intermediate_size % n:
            problems.append(f"intermediate size {cfg.intermediate_size}")
        if cfg.vocab_size % n:
            problems.append(f"vocabulary of {cfg.vocab_size}")
        if cfg.num_experts % n:
            problems.append(f"{cfg.num_experts} experts")
        if problems:
            raise ValueError(f"--tensor-parallel-size {n} does not divide the model's {', '.join(problems)}")

    def heads(self, cfg: ModelConfig) -> tuple[int, int]:
        """This rank's q heads [start, end)."""
        per = cfg.num_heads // self.size
        return self.rank * per, (self.rank + 1) * per

    def kv_heads(self, cfg: ModelConfig) -> tuple[int, int]:
        """This rank's KV heads [start, end): a share of them, or one replicated head."""
        return rank_kv_heads(cfg.num_kv_heads, self.rank, self.size)

    def intermediate(self, cfg: ModelConfig) -> tuple[int, int]:
        per = cfg.intermediate_size // self.size
        return self.rank * per, (self.rank + 1) * per

    def experts(self, cfg: ModelConfig) -> tuple[int, int]:
        """This rank's experts [start, end) (the shared expert of Qwen2-MoE runs on rank 0)."""
        per = cfg.num_experts // self.size
        return self.rank * per, (self.rank + 1) * per

    def vocab(self, cfg: ModelConfig) -> tuple[int, int]:
        per = cfg.vocab_size // self.size
        return self.rank * per, (self.rank + 1) * per
