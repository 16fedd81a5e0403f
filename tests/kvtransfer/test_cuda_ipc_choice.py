"""CUDA IPC pools as far as a machine without a GPU can check them: their names, when a decode
worker shares its pool, and which transport the gateway picks for a (P, D) pair. The transfer
itself runs on a GPU (tests/gpu/test_cuda_ipc.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pdserve.gateway.request_flow import DisaggregatedFlow
from pdserve.kvtransfer.cuda_ipc import NAME_PREFIX, is_cuda_ipc_name, parse_name
from pdserve.kvtransfer.shared_pool import can_share_pool
from pdserve.protocol.messages import KvLayout, WorkerInfo

UUID = "5a1f0c2e-0000-4000-8000-000000000001"
HANDLE = bytes(range(64))


def test_a_pool_name_carries_its_gpu_and_handle():
    name = NAME_PREFIX + UUID + "-" + HANDLE.hex()
    assert is_cuda_ipc_name(name) and not is_cuda_ipc_name("pdserve-abc") and not is_cuda_ipc_name(None)
    assert parse_name(name) == (UUID, HANDLE)


@pytest.mark.parametrize(
    "name",
    [
        "pdserve-0123",
        NAME_PREFIX + UUID,
        NAME_PREFIX + UUID + "-" + HANDLE.hex()[:-2],
        NAME_PREFIX + "-" + HANDLE.hex(),
        NAME_PREFIX + UUID + "-" + "zz" * 64,
    ],
)
def test_malformed_names_are_refused(name):
    with pytest.raises(ValueError):
        parse_name(name)


def test_a_cpu_pool_is_always_shareable():
    assert can_share_pool("cpu")


def _worker(role: str, host: str = "h", kv_device: str = "", shm_name: str | None = None):
    layout = KvLayout(2, 8, 4, 2, 8, "float32")
    info = WorkerInfo(role + "-1", role, "ipc://x", host, 1, "fp", layout, shm_name=shm_name, kv_device=kv_device)
    return SimpleNamespace(worker_id=info.worker_id, info=info)


GPU_POOL = NAME_PREFIX + UUID + "-" + HANDLE.hex()


@pytest.mark.parametrize(
    "asked, p, d, want",
    [
        ("auto", _worker("prefill"), _worker("decode", shm_name="pdserve-1"), "shm"),
        ("auto", _worker("prefill", host="other"), _worker("decode", shm_name="pdserve-1"), "zmq"),
        ("auto", _worker("prefill", kv_device=UUID), _worker("decode", kv_device=UUID, shm_name=GPU_POOL), "cuda-ipc"),
        (
            "cuda-ipc",
            _worker("prefill", kv_device=UUID),
            _worker("decode", kv_device=UUID, shm_name=GPU_POOL),
            "cuda-ipc",
        ),
        (
            "auto",
            _worker("prefill", kv_device="another-gpu"),
            _worker("decode", kv_device=UUID, shm_name=GPU_POOL),
            "zmq",
        ),
        ("auto", _worker("prefill"), _worker("decode", kv_device=UUID, shm_name=GPU_POOL), "zmq"),  # a CPU writer
        ("auto", _worker("prefill", kv_device=UUID), _worker("decode", shm_name="pdserve-1"), "zmq"),  # a GPU writer
        ("auto", _worker("prefill", kv_device=UUID), _worker("decode", kv_device=UUID), "zmq"),  # pool not shared
        ("zmq", _worker("prefill", kv_device=UUID), _worker("decode", kv_device=UUID, shm_name=GPU_POOL), "zmq"),
        ("shm", _worker("prefill", kv_device=UUID), _worker("decode", kv_device=UUID, shm_name=GPU_POOL), "zmq"),
    ],
)
def test_the_gateway_picks_cuda_ipc_only_for_a_writer_on_the_same_gpu(asked, p, d, want):
    assert DisaggregatedFlow._transport_for(SimpleNamespace(kv_transport=asked), p, d) == want  # type: ignore[arg-type]
