"""`pdserve bench-kv` (or `python -m pdserve.bench.kv_transfer`): KV transfer bandwidth per
transport, against memcpy measured in the same run.

One request's KV (all layers, `--tokens` tokens) moves from a prefill-side pool to a decode-side
pool through the real classes: ZmqKvSender / ShmKvSender -> KvReceiver with a LeaseTable, the
receivers in a process of their own (bench/kv_decode_side.py) polling as a decode worker
does (they authenticate, check the lease, copy into the pool and verify completion). Time = first
send_layer until the receiver has accepted the KvDone (the same monotonic clock in both
processes). Every repeat's destination blocks are checked to equal the source blocks.

    memcpy_gbps  best torch copy of a buffer of kv_bytes (the one-copy ceiling on this machine)
    gbps         kv_bytes / seconds, best of --repeat (after one warm-up)
    ratios       gbps / memcpy_gbps  (targets: shm >= 0.8, zmq-ipc >= 0.3)
    unix socket  with zmq-ipc: the same bytes alone through a Unix socket into another process
                 (bench/socket_ceiling.py), the ceiling of any socket transport here; zmq-ipc
                 adds P's gather and D's scatter to its two copies
Rounds alternate memcpy and every transport, so a noisy machine affects all of them alike.
`--kv-payload-mac` as the workers take it (auto: on for zmq-tcp only); each transport's result
says whether its payloads were MACed (`payload_mac`). Compare zmq-tcp with `on` and `off`.
`zmq-tcp` runs as the cluster's PDSERVE_PLANE_ENCRYPTION says (auto: CURVE-encrypted,
protocol/plane_encryption.py); `zmq-tcp-clear` is the same link unencrypted: the cost of
encryption, measured in the same run (`curve` column).
Sender and receivers are two processes, as P and D are: on a machine with few cores they compete
for the cores, not for one interpreter's lock. Both are configured as the workers are
(pdserve/worker_process.py): their block copies are the workers' streaming copy, unless
`--contiguous-copy memmove` asks for plain memmove (to measure what the streaming copy buys).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from typing import get_args

import torch
import zmq

from pdserve.bench.kv_decode_side import DecodeSide, serve_decode_side
from pdserve.bench.socket_ceiling import UnixSocketSink
from pdserve.kvtransfer.sender import KvSender, ShmKvSender, ZmqKvSender
from pdserve.kvtransfer.shm import SharedTensor
from pdserve.kvtransfer.wire import PAYLOAD_MAC_MODES, payload_mac_enabled, torch_dtype
from pdserve.protocol import plane_encryption
from pdserve.protocol.auth import FrameAuth, generate_cluster_secret
from pdserve.protocol.messages import KvDone, KvLayout
from pdserve.worker_process import ContiguousCopy, configure_worker_process

TRANSPORTS = ("zmq-tcp", "zmq-tcp-clear", "zmq-ipc", "shm")  # zmq-tcp-clear: tcp with encryption off
TARGETS = {"shm": 0.8, "zmq-ipc": 0.3}  # the goals: fractions of memcpy


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve bench-kv", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--tokens", type=int, default=2048, help="prompt tokens of the request moved")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--repeat", type=int, default=5, help="timed transfers per transport (best reported)")
    p.add_argument("--transports", default=",".join(TRANSPORTS), help="comma list of " + ", ".join(TRANSPORTS))
    p.add_argument(
        "--scattered", action="store_true", help="random, non-consecutive block ids on both sides (fragmented pools)"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=max(1, (os.cpu_count() or 2) // 2),
        help="torch threads (default: half the cores, what `pdserve serve` gives each worker "
        "of a 1P1D pair; memcpy is measured with the same setting)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--contiguous-copy",
        choices=get_args(ContiguousCopy),
        default="streaming",
        help="the block copies' contiguous copy: the workers' (streaming stores) or plain memmove",
    )
    p.add_argument("--decode-side", action="store_true", help=argparse.SUPPRESS)  # the receivers' process
    p.add_argument(
        "--kv-payload-mac",
        default="auto",
        choices=PAYLOAD_MAC_MODES,
        help="HMAC over payload bytes (zmq transports), as the workers' flag: auto = tcp only",
    )
    return p


class _Memcpy:
    """torch copy of a buffer of kv_bytes: the one-copy ceiling of this machine."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)  # first touch

    def once(self) -> float:
        t0 = time.perf_counter()
        self.dst.copy_(self.src)
        return time.perf_counter() - t0


class _Transport:
    """One transport's sender, and its receiver in the decode-side process."""

    def __init__(
        self,
        name: str,
        ctx: zmq.Context,
        auth: FrameAuth,
        decode: DecodeSide,
        pool: SharedTensor,
        layout: KvLayout,
        payload_mac: bool,
    ) -> None:
        self.name, self.decode, self.pool, self.layout = name, decode, pool, layout
        addr = decode.addrs[name]
        self.payload_mac = payload_mac
        self.encrypted = name != "shm" and plane_encryption.encrypts(auth.encryption, addr)
        self.sender: KvSender
        if name == "shm":
            self.sender = ShmKvSender(auth, addr, pool.name, layout, ctx=ctx)
        else:
            self.sender = ZmqKvSender(ctx, auth, addr, payload_mac=payload_mac)
        self.times: list[float] = []
        self.verified = True

    def transfer(self, rid: str, src: torch.Tensor, src_ids: list[int], dst_ids: list[int]) -> tuple[float, int]:
        """Move one request's KV; returns (seconds until D accepted KvDone, bytes)."""
        L = self.layout.num_layers
        dst = self.pool.tensor
        assert dst is not None
        dst.zero_()
        lease = self.decode.grant(self.name, rid, dst_ids)
        t0 = time.perf_counter()
        sent = 0
        for layer in range(L):
            sent += self.sender.send_layer(rid, lease, layer, src[layer], src_ids, dst_ids)
        self.sender.send_done(KvDone(request_id=rid, lease_epoch=lease.epoch, num_layers=L, kv_bytes=sent))
        t1 = self.decode.wait_done(self.name, rid)
        idx_d, idx_s = torch.tensor(dst_ids), torch.tensor(src_ids)
        self.verified &= bool(torch.equal(dst.index_select(2, idx_d), src.index_select(2, idx_s)))
        return t1 - t0, sent

    def close(self) -> None:
        self.sender.close()


def _bind(name: str, tmpdir: str) -> str:
    return f"ipc://{tmpdir}/kv-{name}.sock" if name == "zmq-ipc" else "tcp://127.0.0.1:0"


def _payload_mac(name: str, addr: str, auth: FrameAuth, mode: str) -> bool:
    return name != "shm" and payload_mac_enabled(mode, addr, encryption=auth.encryption)


def run_bench(args: argparse.Namespace) -> dict:
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    unknown = set(transports) - set(TRANSPORTS)
    if unknown:
        raise ValueError(f"unknown transports {sorted(unknown)}")
    torch.set_num_threads(args.threads)
    dtype = torch_dtype(args.dtype)
    L, bs, H, D = args.layers, args.block_size, args.kv_heads, args.head_dim
    n = -(-args.tokens // bs)
    num_blocks = 2 * n + 1  # room for blocks that must stay untouched
    rng = random.Random(args.seed)
    if args.scattered:
        src_ids = rng.sample(range(num_blocks), n)
        dst_ids = rng.sample(range(num_blocks), n)
    else:  # fresh pools: consecutive blocks on both sides
        src_ids, dst_ids = list(range(1, n + 1)), list(range(n, 2 * n))
    gen = torch.Generator().manual_seed(args.seed)
    src = torch.randn(L, 2, num_blocks, bs, H, D, generator=gen).to(dtype)  # the prefill worker's pool
    layout = KvLayout(L, num_blocks, bs, H, D, args.dtype)
    kv_bytes = L * 2 * n * bs * H * D * src.element_size()
    secret = generate_cluster_secret()
    auth, clear = FrameAuth(secret), FrameAuth(secret, encryption="off")  # the cluster's setting; none
    ctx = zmq.Context()
    pool = SharedTensor.create((L, 2, num_blocks, bs, H, D), dtype)  # the decode worker's pool
    tmpdir = tempfile.mkdtemp(prefix="pdkv-")
    memcpy = _Memcpy(kv_bytes)
    memcpy_times: list[float] = []
    socket_times: list[float] = []
    runs: dict[str, _Transport] = {}
    decode: DecodeSide | None = None
    sink: UnixSocketSink | None = None
    try:
        if "zmq-ipc" in transports:
            sink = UnixSocketSink(kv_bytes)
        hows = {name: clear if name == "zmq-tcp-clear" else auth for name in transports}
        macs = {name: _payload_mac(name, _bind(name, tmpdir), hows[name], args.kv_payload_mac) for name in transports}
        sides = {
            name: {"bind": _bind(name, tmpdir), "encryption": hows[name].encryption, "payload_mac": macs[name]}
            for name in transports
        }
        decode = DecodeSide(secret, pool, args.threads, sides, args.contiguous_copy)
        for name in transports:
            runs[name] = _Transport(name, ctx, hows[name], decode, pool, layout, macs[name])
        # Round robin (memcpy, then each transport) so that all share the machine's state of the
        # moment; round 0 is a warm-up (connections, first touches) and is not counted.
        for r in range(args.repeat + 1):
            memcpy_times += [memcpy.once(), memcpy.once()]
            if sink is not None:
                socket_times.append(sink.once(memcpy.src.numpy().data))
            for name, run in runs.items():
                seconds, sent = run.transfer(f"bench-{name}-{r}", src, src_ids, dst_ids)
                if r:
                    run.times.append(seconds)
        memcpy_times += [memcpy.once() for _ in range(2)]
        assert sent == kv_bytes
        result: dict = {"memcpy_gbps": kv_bytes / min(memcpy_times) / 1e9, "kv_bytes": kv_bytes, "transports": {}}
        if socket_times:  # round 0 warms the sink up
            result["unix_socket_gbps"] = kv_bytes / min(socket_times[1:]) / 1e9
        for name, run in runs.items():
            best = min(run.times)
            result["transports"][name] = {
                "gbps": kv_bytes / best / 1e9,
                "seconds": best,
                "median_seconds": statistics.median(run.times),
                "verified": run.verified,
                "dropped": decode.dropped[name],
                "payload_mac": run.payload_mac,
                "encrypted": run.encrypted,
            }
    finally:
        for run in runs.values():
            run.close()
        if decode is not None:
            decode.close()
        if sink is not None:
            sink.close()
        pool.close()
        ctx.destroy(linger=0)
        shutil.rmtree(tmpdir, ignore_errors=True)
    result["ratios"] = {k: v["gbps"] / result["memcpy_gbps"] for k, v in result["transports"].items()}
    if "unix_socket_gbps" in result:
        result["unix_socket_ratio"] = result["unix_socket_gbps"] / result["memcpy_gbps"]
    result["targets"] = {k: v for k, v in TARGETS.items() if k in result["transports"]}
    result["meets_targets"] = all(result["ratios"][k] >= v for k, v in result["targets"].items())
    result["config"] = {
        "tokens": args.tokens,
        "layers": L,
        "kv_heads": H,
        "head_dim": D,
        "block_size": bs,
        "dtype": args.dtype,
        "blocks": n,
        "repeat": args.repeat,
        "scattered": args.scattered,
        "contiguous_copy": args.contiguous_copy,
        "threads": torch.get_num_threads(),
        "kv_payload_mac": args.kv_payload_mac,
    }
    return result


def _table(res: dict) -> str:
    c = res["config"]
    lines = [
        f"KV of one request: {c['tokens']} tokens, {c['layers']} layers x {c['kv_heads']} kv heads x "
        f"{c['head_dim']} dim, {c['dtype']}, block {c['block_size']} ({c['blocks']} blocks"
        f"{', scattered' if c['scattered'] else ''}) = {res['kv_bytes'] / 2**20:.1f} MiB; "
        f"torch threads {c['threads']}; block copies: {c['contiguous_copy']}",
        f"memcpy of the same size (best, interleaved with the transfers): {res['memcpy_gbps']:.2f} GB/s",
        f"each transport: best of {c['repeat']} transfers, first send_layer -> KvDone accepted by D",
        "",
        f"{'transport':<13} {'GB/s':>8} {'ms':>9} {'x memcpy':>9} {'target':>7} {'verified':>9} {'mac':>4} {'curve':>6}",
    ]
    for name, t in res["transports"].items():
        target = TARGETS.get(name)
        lines.append(
            f"{name:<13} {t['gbps']:>8.2f} {t['seconds'] * 1e3:>9.2f} {res['ratios'][name]:>9.2f} "
            f"{'>= %.1f' % target if target else '-':>7} {str(t['verified']):>9} "
            f"{'on' if t['payload_mac'] else 'off':>4} {'on' if t['encrypted'] else 'off':>6}"
        )
    if "unix_socket_gbps" in res:
        lines.append(
            f"{'unix socket':<13} {res['unix_socket_gbps']:>8.2f} {res['kv_bytes'] / res['unix_socket_gbps'] / 1e6:>9.2f} "
            f"{res['unix_socket_ratio']:>9.2f}   (the bytes alone, process to process: any socket transport's ceiling)"
        )
    return "\n".join(lines)


def bench_kv_main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    configure_worker_process(args.contiguous_copy)
    if args.decode_side:
        return serve_decode_side()
    if min(args.tokens, args.layers, args.kv_heads, args.head_dim, args.block_size) <= 0 or args.repeat < 1:
        print("bench-kv: sizes and --repeat must be positive", file=sys.stderr)
        return 2
    try:
        res = run_bench(args)
    except ValueError as e:
        print(f"bench-kv: {e}", file=sys.stderr)
        return 2
    print(json.dumps(res) if args.json else _table(res), flush=True)
    return 0 if all(t["verified"] for t in res["transports"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(bench_kv_main())
