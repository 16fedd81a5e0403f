"""CPU linear layouts: prepacked oneDNN (fp32, with panels for few rows) and [in, out] (fallback)
equal nn.Linear."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pdserve.engine.models.cpu_linear import (
    MIN_ROWS,
    PackedLinear,
    TransposedLinear,
    cpu_linear_kind,
    onednn_linear_available,
    relayout_linears,
)
from pdserve.kernels import panel_gemm
from pdserve.kernels.panel_gemm import few_rows


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, MIN_ROWS - 1, MIN_ROWS, 7, few_rows(), few_rows() + 1, 300])
@pytest.mark.parametrize("kind", ["packed", "packed-no-gemv-copy", "transposed"])
def test_layouts_equal_dense_linear(kind, rows, bias):
    if kind.startswith("packed") and not onednn_linear_available():
        pytest.skip("this torch has no oneDNN linear")
    torch.manual_seed(rows)
    dense = nn.Linear(96, 40, bias=bias)
    layer = TransposedLinear(dense) if kind == "transposed" else PackedLinear(dense, gemv_copy=kind == "packed")
    if kind == "packed" and panel_gemm.available():
        assert layer.panels is not None  # few-row inputs take the C panel GEMM
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


def test_new_row_counts_do_not_grow_memory_without_bound():
    """Every prefill step has a new token count; oneDNN's shape caches must stay bounded
    (unbounded, 200 lengths x 2 weights grew a process by ~240 MB)."""
    import os
    import subprocess
    import sys

    if not onednn_linear_available():
        pytest.skip("this torch has no oneDNN linear")
    code = (
        "import ctypes, torch\n"
        "from torch import nn\n"
        "from engine.models.cpu_linear import PackedLinear, onednn_linear_available\n"
        "assert onednn_linear_available()\n"
        "torch.set_num_threads(1)\n"
        "rss = lambda: int(open('/proc/self/statm').read().split()[1]) * 4096 / 2**20\n"
        "layers = [PackedLinear(nn.Linear(512, 1536)), PackedLinear(nn.Linear(1536, 512))]\n"
        "with torch.inference_mode():\n"
        "    for rows in range(300, 320):\n"  # warm up: allocator and caches at steady state
        "        x = torch.randn(rows, 512)\n"
        "        layers[1](layers[0](x))\n"
        "    ctypes.CDLL('libc.so.6').malloc_trim(0)\n"
        "    before = rss()\n"
        "    for rows in range(320, 520):\n"
        "        layers[1](layers[0](torch.randn(rows, 512)))\n"
        "    ctypes.CDLL('libc.so.6').malloc_trim(0)\n"
        "print(rss() - before)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert float(proc.stdout.strip()) < 120, f"grew {proc.stdout.strip()} MiB over 200 new row counts"


@pytest.mark.skipif(not panel_gemm.available(), reason="no C compiler: torch only")
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, few_rows(), few_rows() + 1])
def test_bf16_transposed_layout_takes_panels_for_few_rows(rows, bias, monkeypatch):
    """bf16 weights: decode-sized inputs go to the C panel GEMM on a panel copy (fp32 sums, one
    rounding), larger ones to torch's [in, out] matmul; both within bf16 rounding of nn.Linear."""
    torch.manual_seed(rows)
    dense = nn.Linear(96, 40, bias=bias).bfloat16()
    layer = TransposedLinear(dense, panels=True)
    assert layer.panels is not None and layer.panels.dtype == torch.bfloat16
    assert TransposedLinear(dense).panels is None  # no copy unless asked (it costs the weights again)
    calls = []
    real = panel_gemm.linear
    monkeypatch.setattr(panel_gemm, "linear", lambda *a: calls.append(a) or real(*a))
    x = torch.randn(rows, 96).bfloat16()
    with torch.inference_mode():
        y = layer(x)
    assert len(calls) == int(rows <= few_rows())
    want = x.double() @ dense.weight.double().t() + (dense.bias.double() if bias else 0)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 40)
    torch.testing.assert_close(y.double(), want, rtol=2**-7, atol=2**-7)
