"""CPU linear layouts: prepacked oneDNN (fp32) and [in, out] (fallback) equal nn.Linear."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.models.cpu_linear import (MIN_ROWS, PackedLinear, TransposedLinear, cpu_linear_kind,
                                      onednn_linear_available, relayout_linears)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, MIN_ROWS - 1, MIN_ROWS, 17, 300])
@pytest.mark.parametrize("kind", ["packed", "packed-no-gemv-copy", "transposed"])
def test_layouts_equal_dense_linear(kind, rows, bias):
    if kind.startswith("packed") and not onednn_linear_available():
        pytest.skip("this torch has no oneDNN linear")
    torch.manual_seed(rows)
    dense = nn.Linear(96, 40, bias=bias)
    layer = (TransposedLinear(dense) if kind == "transposed"
             else PackedLinear(dense, gemv_copy=kind == "packed"))
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        y = layer(x)
        want = dense(x)
    assert y.shape == (rows, 40)
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)


def test_relayout_swaps_every_linear_and_picks_by_dtype():
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.ReLU(), nn.Linear(8, 4, bias=False)))
    x = torch.randn(5, 8)
    with torch.inference_mode():
        want = model(x)
    kind = cpu_linear_kind(torch.float32)
    assert kind == ("packed" if onednn_linear_available() else "transposed")
    relayout_linears(model, kind)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    with torch.inference_mode():
        torch.testing.assert_close(model(x), want, atol=1e-5, rtol=1e-5)
    assert cpu_linear_kind(torch.bfloat16) == "transposed"  # oneDNN packing here is fp32 only
