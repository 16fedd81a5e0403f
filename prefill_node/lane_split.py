"""How much of the queue one prefill step takes when lanes stand free.

A step's token budget (`--max-num-batched-tokens`, 512 on CPU) lets one lane hold a whole
prompt of up to 512 tokens while the worker's other lanes have nothing to do: at low load a lone
prompt's TTFT is that of one core. When the queue would not fill every free lane with full
steps, the next step takes only an even share of it, so the rest goes out as further steps at
once and the prompt's chunks go through the layers on every free lane together (pipelined one
layer apart: prefill_node/lanes.py). Chunks are whole blocks and at least MIN_SPLIT_TOKENS, below
which a matmul's rows stop paying for a second lane. Under load every lane is busy and the
budget is untouched.
"""

from __future__ import annotations

MIN_SPLIT_TOKENS = 128


def step_budget_for_lanes(queued_tokens: int, free_lanes: int, budget: int, block_size: int) -> int:
    """The next step's token budget: `budget` while `queued_tokens` (prompt tokens not computed
    or launched yet) fill `free_lanes` steps of it, else an even share of them over the free
    lanes, rounded up to whole blocks, at least MIN_SPLIT_TOKENS."""
    if free_lanes <= 1 or queued_tokens >= budget * free_lanes:
        return budget
    share = -(-queued_tokens // free_lanes)
    share = -(-share // block_size) * block_size
    return min(budget, max(MIN_SPLIT_TOKENS, share))
