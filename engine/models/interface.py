"""What the model runner needs of a model: the native Llama family (models/llama.py) and
transformers' own modelling code (models/transformers_backend.py) both provide it."""

from __future__ import annotations

from typing import Any, Iterator, Protocol

import torch
from torch import nn

from pdserve.engine.models.llama import ForwardContext
from pdserve.kernels import decode_layers

# What every layer takes besides the hidden states, made once per step by `embed` (native: the
# rotary tables; transformers: the keyword arguments its decoder layers get from their model).
LayerInputs = Any


class CausalLM(Protocol):
    """A decoder over the paged KV pool, run in stages by engine/model_runner.py: `embed`, then
    each of `layers` as layer(x [T, H], layer_inputs, ctx) -> [T, H], then `head`."""

    layers: nn.ModuleList

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, LayerInputs]:
        """input_ids/positions [T] -> hidden states [T, H] and the step's LayerInputs."""
        ...

    def head(self, x: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, H] -> fp32 logits [S, V] for the S rows in `logits_indices`."""
        ...

    def describe_decode_layers(self, kv_cache: torch.Tensor) -> decode_layers.DecodeLayers | None:
        """The layers for the one-call C decode driver; None where it cannot run them."""
        ...

    def fused_decode(
        self, stack: decode_layers.DecodeLayers, x: torch.Tensor, rope: LayerInputs, ctx: ForwardContext
    ) -> torch.Tensor | None:
        """Every layer in one call for a small decode step; None: run the layers one by one."""
        ...

    def use_cpu_weight_layout(self) -> str:
        """Lay the weights out for the CPU (after loading); returns what it did."""
        ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def eval(self) -> Any: ...
