"""KV over CUDA IPC between two processes on one GPU (kvtransfer/cuda_ipc.py, cuda_ipc_sender.py):
the decode pool's leased blocks, written by a prefill process through the mapped handle, equal
what a colocated engine computes bit for bit; and `pdserve serve --device cuda` 1P1D over CUDA
IPC equals HF greedy and serves sampled, penalised, logprob, n > 1 and structured requests.
Skipped without CUDA (and CuPy)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import msgspec
import pytest
import torch
import zmq

from pdserve.kvtransfer import cuda_ipc
from pdserve.kvtransfer.cuda_ipc import CudaIpcTensor
from pdserve.kvtransfer.lease import LeaseTable
from pdserve.kvtransfer.receiver import KvReceiver
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import KvDestination, KvLayout
from tests.conftest import random_prompts
from tests.e2e.test_kv_matches_colocated import prefill_keeping_kv

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_ipc.available(), reason="needs a CUDA device and CuPy")]

SECRET = b"k" * 32


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def gpu_engine(model, block_size, budget):
    from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine.llm_engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model=str(model),
            dtype="float32",
            device="cuda",
            cache=CacheConfig(block_size=block_size, num_blocks=64),
            scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=256),
        ),
        show_progress=False,
    )


@pytest.mark.parametrize("length", [41, 33])  # three chunks; the last token alone in its chunk
def test_kv_written_over_cuda_ipc_equals_colocated_kv(tiny_llama, tmp_path, length):
    block_size, budget = 4, 16
    colocated = gpu_engine(tiny_llama, block_size, budget)
    prompt = random_prompts(colocated.model_config.vocab_size, [length], seed=9)[0]
    ref_blocks = prefill_keeping_kv(colocated, prompt)
    reference = colocated.kv_cache[:, :, ref_blocks].clone()  # [L, 2, n, bs, H, D]
    spec = colocated.kv_spec
    n_dst = 32
    pool = CudaIpcTensor.create(spec.shape(n_dst), spec.dtype, torch.device("cuda"))
    ctx = zmq.Context()
    try:
        assert pool.tensor is not None and pool.tensor.is_cuda
        leases = LeaseTable(spec.num_layers)
        receiver = KvReceiver(ctx, FrameAuth(SECRET), f"ipc://{tmp_path}/kv.sock", pool.tensor, leases)
        dst_blocks = list(range(n_dst - len(ref_blocks), n_dst))[::-1]  # scattered, reversed
        lease = leases.grant("r", dst_blocks, ttl_s=60)
        layout = KvLayout(spec.num_layers, n_dst, block_size, spec.num_kv_heads, spec.head_dim, "float32")
        dest = KvDestination("d", receiver.addr, pool.name, "cuda-ipc", lease, layout)
        job = {
            "model": str(tiny_llama),
            "prompt": prompt,
            "secret": SECRET.hex(),
            "dest": msgspec.json.encode(dest).decode(),
            "block_size": block_size,
            "budget": budget,
        }
        job_file = tmp_path / "job.json"
        job_file.write_text(json.dumps(job))
        writer = subprocess.Popen(
            [sys.executable, "-m", "tests.gpu.cuda_ipc_writer", str(job_file)],
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ),
        )
        done, deadline = [], time.monotonic() + 120
        while not done and time.monotonic() < deadline and (writer.poll() is None or not done):
            done = receiver.poll(50)
            if writer.poll() not in (None, 0):
                break
        out, _ = writer.communicate(timeout=60)
        assert writer.returncode == 0, out
        assert [d.request_id for d in done] == ["r"]
        assert torch.equal(pool.tensor[:, :, dst_blocks], reference)
        untouched = [b for b in range(n_dst) if b not in dst_blocks]
        assert not pool.tensor[:, :, untouched].any()  # nothing written outside the lease
        assert receiver.bytes_received == json.loads(out)["bytes"] >= reference.numel() * reference.element_size()
        receiver.close()
    finally:
        ctx.destroy(linger=0)
        pool.close()


def hf_greedy_cuda(model, prompts, max_new):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).cuda().eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            out = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False, pad_token_id=0
            )
            outs.append(out[0, len(p) :].tolist())
    return outs


def test_serve_1p1d_over_cuda_ipc_equals_hf_and_serves_every_kind_of_request(tiny_llama):
    import concurrent.futures as cf
    import urllib.request

    from openai import OpenAI
    from transformers import AutoTokenizer

    from tests.e2e.cluster import running_server

    max_new = 16
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompts = random_prompts(tok.vocab_size, [7, 30, 65, 12], seed=11)
    want = [tok.decode(o, skip_special_tokens=True) for o in hf_greedy_cuda(tiny_llama, prompts, max_new)]
    extra = ("--device", "cuda", "--kv-transport", "cuda-ipc", "--prefill-workers", "1", "--decode-workers", "1")
    with running_server(tiny_llama, *extra, timeout_s=300) as base:
        with urllib.request.urlopen(f"{base}/v1/workers", timeout=5) as r:
            workers = json.loads(r.read())["data"]
        decode = [w for w in workers if w["role"] == "decode"]
        assert decode and decode[0]["kv"]["shared_as"] == "cuda-ipc"
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id

        def complete(p):
            return client.completions.create(model=model, prompt=p, max_tokens=max_new, temperature=0).choices[0].text

        def stream(p):
            chunks = client.completions.create(model=model, prompt=p, max_tokens=max_new, temperature=0, stream=True)
            return "".join(c.choices[0].text for c in chunks if c.choices)

        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(complete, prompts)) == want
            assert list(pool.map(stream, prompts)) == want
        params = dict(
            model=model,
            prompt=prompts[1],
            max_tokens=12,
            temperature=0.9,
            top_p=0.9,
            seed=7,
            n=3,
            logprobs=2,
            presence_penalty=0.5,
            frequency_penalty=0.3,
        )
        sampled = client.completions.create(**params)
        assert len(sampled.choices) == 3 and all(c.logprobs and len(c.logprobs.tokens) == 12 for c in sampled.choices)
        again = client.completions.create(**params)
        assert [c.text for c in again.choices] == [c.text for c in sampled.choices]  # a seed draws alike
        structured = client.completions.create(
            model=model,
            prompt=prompts[0],
            max_tokens=40,
            temperature=0,
            extra_body={"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}},
        )
        assert structured.choices[0].text in ("alpha", "beta", "gamma")
        with urllib.request.urlopen(f"{base}/metrics", timeout=5) as r:
            metrics = r.read().decode()
        moved = [line for line in metrics.splitlines() if line.startswith("pdserve_kv_transfer_bytes_total")]
        assert moved and float(moved[0].split()[-1]) > 0
