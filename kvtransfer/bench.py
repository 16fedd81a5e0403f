"""`pdserve bench-kv`: move one request's KV over each transport, beside memcpy in the same run.

For each transport the real classes run: a KvSender (prefill side) and a KvReceiver (decode
side, in its own thread, landing frames in its pool). Time = first layer sent -> KvDone
verified by the receiver. Received blocks are compared bit for bit with the sent ones.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time

import torch
import zmq

from bench.machine import measure_memcpy_gbps
from kvtransfer.lease import LeaseTable
from kvtransfer.malloc_tuning import keep_large_allocations_in_heap
from kvtransfer.receiver import KvReceiver
from kvtransfer.sender import make_kv_sender, torch_dtype
from kvtransfer.shm import SharedTensor
from protocol.auth import FrameAuth, generate_cluster_secret
from protocol.messages import KvDone, KvLayout


class _Destination:
    """A decode worker's side: a zeroed shared pool (allocated once, as at start-up) + receiver."""

    def __init__(self, ctx, auth, bind: str, layout: KvLayout) -> None:
        shape = (layout.num_layers, 2, layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        self.layout = layout
        self.pool = SharedTensor.create(shape, torch_dtype(layout.dtype))
        self.pool.tensor.zero_()
        self.leases = LeaseTable(layout.num_layers)
        self.receiver = KvReceiver(ctx, auth, bind, self.pool.tensor, self.leases)

    def close(self) -> None:
        self.receiver.close()
        self.pool.close()


def _move_once(dest: _Destination, sender, src: torch.Tensor, n_blocks: int, run: int) -> tuple[float, bool]:
    layout = dest.layout
    # Destination blocks: a different, consecutive range (as a fresh allocation would give).
    first = layout.num_blocks - n_blocks
    dst_blocks, src_blocks = list(range(first, first + n_blocks)), list(range(n_blocks))
    rid = f"bench-{run}"
    lease = dest.leases.grant(rid, dst_blocks, ttl_s=60)
    done_at: list[float] = []

    def receive():
        while not done_at:
            if dest.receiver.poll(5):
                done_at.append(time.perf_counter())

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    for layer in range(layout.num_layers):
        sender.send_layer(rid, lease, layer, src[layer], src_blocks, dst_blocks)
    sender.send_done(KvDone(request_id=rid, lease_epoch=lease.epoch, num_layers=layout.num_layers))
    thread.join(timeout=60)
    if not done_at:
        raise RuntimeError("transfer did not complete")
    dest.leases.release(rid)
    ok = torch.equal(dest.pool.tensor[:, :, dst_blocks], src[:, :, src_blocks])
    dest.pool.tensor[:, :, dst_blocks] = 0
    return done_at[0] - t0, ok


def bench_kv_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench-kv", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--repeat", type=int, default=5, help="best of N per transport")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads, as in one worker of `pdserve serve` 1P1D on 2 cores (default 1)")
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    keep_large_allocations_in_heap()  # as the workers do

    n_blocks = -(-args.tokens // args.block_size)
    layout = KvLayout(args.layers, 2 * n_blocks, args.block_size, args.kv_heads, args.head_dim, args.dtype)
    src = torch.randn(args.layers, 2, n_blocks, args.block_size, args.kv_heads, args.head_dim).to(torch_dtype(args.dtype))
    kv_bytes = src.numel() * src.element_size()
    memcpy = measure_memcpy_gbps(nbytes=kv_bytes, repeat=max(5, args.repeat))
    ctx = zmq.Context()
    auth = FrameAuth(generate_cluster_secret())
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-kv-") as tmp:
        binds = {"zmq-tcp": "tcp://127.0.0.1:0", "zmq-ipc": f"ipc://{tmp}/kv.sock", "shm": f"ipc://{tmp}/kv-shm.sock"}
        for name, bind in binds.items():
            dest = _Destination(ctx, auth, bind, layout)
            sender = make_kv_sender("shm" if name == "shm" else "zmq", ctx=ctx, auth=auth,
                                    kv_addr=dest.receiver.addr, shm_name=dest.pool.name, layout=layout)
            try:
                _move_once(dest, sender, src, n_blocks, -1)  # warm-up: connect, first touches
                runs = [_move_once(dest, sender, src, n_blocks, i) for i in range(args.repeat)]
                received = dest.receiver.bytes_received
            finally:
                sender.close()
                dest.close()
            best = min(r[0] for r in runs)
            results[name] = {"gbps": kv_bytes / best / 1e9, "seconds": best,
                             "bytes_equal": all(r[1] for r in runs),
                             "bytes_received_per_run": received // (args.repeat + 1)}
    ctx.destroy(linger=0)
    out = {"memcpy_gbps": memcpy, "kv_bytes": kv_bytes, "tokens": args.tokens, "threads": args.threads,
           "shape": {"layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                     "block_size": args.block_size, "dtype": args.dtype},
           "transports": results,
           "ratios": {name: r["gbps"] / memcpy for name, r in results.items()},
           "goals": {"shm_over_half_memcpy": results["shm"]["gbps"] >= 0.5 * memcpy,
                     "zmq_ipc_over_fifth_memcpy": results["zmq-ipc"]["gbps"] >= 0.2 * memcpy}}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"KV of {args.tokens} tokens: {kv_bytes / 2**20:.1f} MiB; memcpy {memcpy:.2f} GB/s (same run)")
        for name, r in results.items():
            print(f"  {name:8s} {r['gbps']:7.2f} GB/s  {r['gbps'] / memcpy:6.1%} of memcpy  "
                  f"{r['seconds'] * 1e3:7.2f} ms  bytes equal: {r['bytes_equal']}")
    return 0 if all(r["bytes_equal"] for r in results.values()) else 1
