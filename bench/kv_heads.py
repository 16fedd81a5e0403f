"""KV transfer bandwidth between tensor-parallel degrees: prefill TP=P -> decode TP=D, same run.

    python -m pdserve.bench.kv_heads --pairs 1:1,2:1,1:2,2:2

One request's KV (all layers, `--tokens` tokens) moves from P rank pools (each its KV heads, as a
TP prefill worker's rank 0 maps them) to D rank pools through the real classes: ZmqKvSender
(one send per distinct prefill rank pool and layer, `kv_head_start`) -> KvReceiver with
`rank_pools` (each frame's heads written into every decode rank pool holding them), polled in its
own thread; and ShmKvSender writing each prefill rank's heads in place into every decode rank
pool (each its own shared-memory segment, as a TP decode worker advertises them) holding them. Time = first send
until the receiver accepted the KvDone; every repeat's decode pools are checked to hold exactly
their heads of the source blocks. Rounds alternate memcpy and every pair (noise hits all alike).
`-per-rank` pairs (P > 1): each prefill rank sends its own heads on a sender of its own, all at
once (threads here; processes in a prefill worker), ranks >= 1 ending with a KvRangeDone and
rank 0's KvDone naming them (kvtransfer/rank_sends.py); the others: rank 0 sends every range.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import zmq

from pdserve.bench.kv_transfer import _Memcpy
from pdserve.kvtransfer.head_ranges import HeadShard, distinct_shards, rank_kv_heads
from pdserve.kvtransfer.lease import LeaseTable
from pdserve.kvtransfer.receiver import KvReceiver
from pdserve.kvtransfer.sender import KvSender, ShmKvSender, ZmqKvSender
from pdserve.kvtransfer.shm import SharedTensor
from pdserve.protocol.auth import FrameAuth, generate_cluster_secret
from pdserve.protocol.messages import KvDone, KvLayout, ShmPool
from pdserve.worker_process import configure_worker_process


def split(full: torch.Tensor, degree: int) -> list[HeadShard]:
    """`degree` rank pools of `full` [L, 2, N, bs, Hkv, D], each a separate copy of its heads."""
    heads = [rank_kv_heads(full.shape[4], r, degree) for r in range(degree)]
    return [HeadShard(k0, k1, full[:, :, :, :, k0:k1].clone()) for k0, k1 in heads]


class _ReceiverThread(threading.Thread):
    """Polls the receiver like a decode worker's loop; records when each KvDone is accepted."""

    def __init__(self, receiver: KvReceiver) -> None:
        super().__init__(daemon=True, name="bench-kv-receiver")
        self.receiver = receiver
        self.done_at: dict[str, float] = {}
        self.cond = threading.Condition()
        self.stop = False
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop:
                for done in self.receiver.poll(20, max_frames=1 << 30):
                    now = time.perf_counter()
                    with self.cond:
                        self.done_at[done.request_id] = now
                        self.cond.notify_all()
        except BaseException as e:  # surfaced by wait()
            self.error = e
            with self.cond:
                self.cond.notify_all()

    def wait(self, request_id: str, timeout_s: float) -> float:
        with self.cond:
            if not self.cond.wait_for(lambda: request_id in self.done_at or self.error is not None, timeout_s):
                raise TimeoutError(
                    f"{request_id}: no verified KvDone within {timeout_s} s (dropped: {dict(self.receiver.dropped)})"
                )
            if self.error is not None:
                raise self.error
            return self.done_at.pop(request_id)


class _Pair:
    """Prefill pools at degree p, decode pools at degree d, into one receiver: from one sender
    (rank 0 sends every head range), or `per_rank`: one sender per prefill rank (each its own
    socket or shared-memory mapping), all sending at once from threads, as the ranks do."""

    def __init__(
        self, name: str, transport: str, src: list[HeadShard], dst: list[HeadShard], tmp: str, per_rank: bool = False
    ) -> None:
        self.name, self.src, self.dst = name, distinct_shards(src), dst
        self.per_rank = per_rank
        self.ctx = zmq.Context()
        auth = FrameAuth(generate_cluster_secret(), encryption="off")
        self.leases = LeaseTable(dst[0].pool.shape[0])
        self.shm: list[SharedTensor] = []
        if transport == "shm":  # every decode rank pool in shared memory, advertised one by one
            self.shm = [SharedTensor.create(tuple(s.pool.shape), s.pool.dtype) for s in dst]
            self.dst = dst = [
                HeadShard(s.start, s.end, t.tensor, t.name) for s, t in zip(dst, self.shm) if t.tensor is not None
            ]
        self.receiver = KvReceiver(self.ctx, auth, f"ipc://{tmp}/{name}.sock", dst[0].pool, self.leases, rank_pools=dst)

        def new_sender() -> KvSender:
            if self.shm:
                L, _, n, bs, _, d = dst[0].pool.shape
                h = dst[-1].end  # every KV head
                layout = KvLayout(L, n, bs, h, d, str(dst[0].pool.dtype).removeprefix("torch."))
                pools = [ShmPool(t.name, s.start, s.end) for s, t in zip(dst, self.shm)]
                return ShmKvSender(auth, self.receiver.addr, pools[0].name, layout, pools=pools, ctx=self.ctx)
            return ZmqKvSender(self.ctx, auth, self.receiver.addr)

        self.senders = [new_sender() for _ in (self.src if per_rank else [None])]
        self.sender = self.senders[0]
        self.ranks = ThreadPoolExecutor(len(self.src)) if per_rank else None
        self.thread = _ReceiverThread(self.receiver)
        self.thread.start()
        self.times: list[float] = []
        self.verified = True

    def transfer(self, rid: str, src_ids: list[int], dst_ids: list[int]) -> int:
        for s in self.dst:
            s.pool.zero_()
        L = self.leases.num_layers
        lease = self.leases.grant(rid, dst_ids, ttl_s=120)

        def send(sender: KvSender, shards: list[HeadShard]) -> int:
            return sum(
                sender.send_layer(rid, lease, layer, s.pool[layer], src_ids, dst_ids, kv_head_start=s.start)
                for layer in range(L)
                for s in shards
            )

        t0 = time.perf_counter()
        if self.ranks is None:  # rank 0 sends every head range
            sent = own = send(self.sender, self.src)
        else:  # each rank its own heads on its own sender; ranks >= 1 end with a KvRangeDone

            def rank(r: int) -> int:
                n = send(self.senders[r], [self.src[r]])
                if r:
                    self.senders[r].send_range_done(rid, lease.epoch, (self.src[r].start, self.src[r].end), n)
                return n

            counts = list(self.ranks.map(rank, range(len(self.src))))
            sent, own = sum(counts), counts[0]
        streams = len(self.src) - 1 if self.ranks is not None else 0
        done = KvDone(request_id=rid, lease_epoch=lease.epoch, num_layers=L, kv_bytes=own, range_dones=streams)
        self.sender.send_done(done)
        self.times.append(self.thread.wait(rid, timeout_s=120) - t0)
        self.leases.release(rid)
        full = torch.cat([s.pool for s in self.src], dim=4)[:, :, src_ids]  # [L, 2, n, bs, Hkv, D]
        self.verified &= all(torch.equal(s.pool[:, :, dst_ids], full[:, :, :, :, s.start : s.end]) for s in self.dst)
        return sent

    def close(self) -> None:
        self.thread.stop = True
        self.thread.join(5)
        if self.ranks is not None:
            self.ranks.shutdown()
        for sender in self.senders:
            sender.close()
        self.receiver.close()
        for t in self.shm:
            t.close()
        self.ctx.destroy(linger=0)


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    configure_worker_process()  # the workers' block copy and heap tuning
    L, bs, H, D = args.layers, args.block_size, args.kv_heads, args.head_dim
    n = -(-args.tokens // bs)
    full = torch.randn(L, 2, 2 * n + 1, bs, H, D)  # the prefill worker's KV, every head
    src_ids, dst_ids = list(range(1, n + 1)), list(range(n, 2 * n))
    kv_bytes = L * 2 * n * bs * H * D * full.element_size()
    tmp = tempfile.mkdtemp(prefix="pdkv-tp-")
    pairs: list[_Pair] = []
    memcpy, memcpy_times = _Memcpy(kv_bytes), []
    try:
        for spec in args.pairs.split(","):
            p, d = (int(x) for x in spec.split(":"))
            for transport in ("zmq-ipc", "shm"):
                for per_rank in (False, True) if p > 1 and args.per_rank else (False,):
                    dst = split(torch.zeros_like(full), d)
                    name = f"tp{p}-to-tp{d}-{transport}" + ("-per-rank" if per_rank else "")
                    pairs.append(_Pair(name, transport, split(full, p), dst, tmp, per_rank))
        for r in range(args.repeat + 1):  # round 0: warm-up, not counted
            memcpy_times.append(memcpy.once())
            for pair in pairs:
                assert pair.transfer(f"{pair.name}-{r}", src_ids, dst_ids) == kv_bytes
                if r == 0:
                    pair.times.clear()
    finally:
        for pair in pairs:
            pair.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "kv_bytes": kv_bytes,
        "memcpy_gbps": kv_bytes / min(memcpy_times) / 1e9,
        "pairs": {x.name: {"gbps": kv_bytes / min(x.times) / 1e9, "verified": x.verified} for x in pairs},
        "config": {"tokens": args.tokens, "layers": L, "kv_heads": H, "head_dim": D, "threads": args.threads},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.kv_heads", description=__doc__)
    p.add_argument("--pairs", default="1:1,2:1,1:2,2:2", help="prefill:decode degrees, comma-separated")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--per-rank",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time P > 1 with each prefill rank sending its own heads (threads, own senders)",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    res = run(args)
    ok = all(x["verified"] for x in res["pairs"].values())
    if args.json:
        print(json.dumps(res))
        return 0 if ok else 1
    print(f"KV of one request: {res['kv_bytes'] / 2**20:.1f} MiB {res['config']}; memcpy {res['memcpy_gbps']:.2f} GB/s")
    for name, x in res["pairs"].items():
        print(
            f"{name:<31} {x['gbps']:>7.2f} GB/s  {x['gbps'] / res['memcpy_gbps']:>5.2f} x memcpy  verified={x['verified']}"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
