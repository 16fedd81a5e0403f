"""The prefill side of tests/gpu/test_cuda_ipc.py, in a process of its own (a process cannot open
its own CUDA IPC handles): prefill one prompt on the GPU and stream its KV into the decode
pool the handle names, through the real KvStreamer and CUDA IPC sender, then KvDone.

    python -m tests.gpu.cuda_ipc_writer JOB.json   (job: model, prompt, secret, destination)
"""

from __future__ import annotations

import json
import sys
import time

import msgspec
import zmq

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import PREFILLED, LLMEngine
from pdserve.kvtransfer.sender import make_kv_sender
from pdserve.prefill_node.kv_streamer import KvStreamer
from pdserve.prefill_node.request_record import PrefillRecord
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import KvDestination, PrefillRequest
from pdserve.protocol.sampling import SamplingParams


def main() -> int:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    dest = msgspec.json.decode(job["dest"].encode(), type=KvDestination)
    engine = LLMEngine(
        EngineConfig(
            model=job["model"],
            dtype="float32",
            device="cuda",
            cache=CacheConfig(block_size=job["block_size"], num_blocks=64),
            scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=job["budget"], max_model_len=256),
        ),
        show_progress=False,
    )
    ctx = zmq.Context()
    sender = make_kv_sender(
        "cuda-ipc",
        ctx=ctx,
        auth=FrameAuth(bytes.fromhex(job["secret"])),
        kv_addr=dest.kv_addr,
        shm_name=dest.shm_name,
        layout=dest.layout,
    )
    sp = SamplingParams(max_tokens=2, temperature=0.0)
    prompt = job["prompt"]
    req = PrefillRequest(request_id="r", gateway_id="g", prompt_token_ids=prompt, sampling=sp, dest=dest)
    record = PrefillRecord(req, sender, received=time.monotonic())
    streamer = KvStreamer(engine.kv_cache, engine.block_size)
    engine.add_request("r", prompt, sp, prefill_only=True)
    outs = []
    while engine.has_work():
        sched = engine.schedule()
        outs = engine.execute(sched, streamer.prepare(sched, {"r": record}))
    assert outs[0].finish_reason == PREFILLED and record.transfer.error is None
    assert sender.send_done(record.kv_done(prompt[0], None, engine.model_config.num_layers, {}))
    print(json.dumps({"bytes": record.transfer.bytes}), flush=True)
    sender.close()
    ctx.destroy(linger=2000)
    return 0


if __name__ == "__main__":
    sys.exit(main())
