"""`pdserve` console script."""

from __future__ import annotations

import argparse
import sys

from pdserve.cli import roles
from pdserve.cli.engine_args import add_engine_args
from pdserve.cli.serve_settings import DECODE_FLAGS, GATEWAY_FIELDS_SET, ServeSettings
from pdserve.cli.settings_flags import add_flags
from pdserve.decode_node.settings import DecodeSettings
from pdserve.gateway.options import GatewayOptions
from pdserve.runtime.thread_waits import choose_thread_waits


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="gateway + prefill and decode pools on this machine")
    add_engine_args(s)
    add_flags(s, ServeSettings, "pools")
    add_flags(s, GatewayOptions, "gateway", skip=GATEWAY_FIELDS_SET)
    add_flags(s, DecodeSettings, "decode workers", only=DECODE_FLAGS)

    g = sub.add_parser("gateway", help="the HTTP gateway alone")
    g.add_argument("--settings", default=None, metavar="FILE", help=roles.SETTINGS_HELP)
    add_flags(g, GatewayOptions)

    for role, fn in (("prefill", roles.run_prefill), ("decode", roles.run_decode), ("colocated", roles.run_colocated)):
        w = sub.add_parser(role, help=f"one {role} worker")
        roles.add_worker_args(w, role)
        w.set_defaults(func=fn)

    for name, help_text in (
        ("make-model", "write a random-initialised HF model folder"),
        ("bench", "SLO load generator for any OpenAI-compatible server"),
        ("bench-kv", "KV transfer bandwidth per transport vs memcpy"),
        ("bench-engine", "engine prefill/decode tokens/s vs machine FLOP/s and GB/s"),
        ("bench-gpu", "Triton paged attention on CUDA vs the device's copy GB/s and SDPA"),
        ("bench-compare", "pdserve vs vLLM CPU, llama.cpp, transformers serve: report"),
        ("plan", "how many prefill and decode workers a rate needs under TTFT/TPOT SLOs (simulated)"),
    ):
        sub.add_parser(name, help=help_text, add_help=False)
    s.set_defaults(func=_serve)
    g.set_defaults(func=roles.run_gateway)
    return parser


def _serve(args: argparse.Namespace) -> int:
    from pdserve.cli.serve import serve

    return serve(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    choose_thread_waits(argv[0] if argv else None)  # before anything imports torch (runtime/thread_waits.py)
    # Tools with their own parsers get the rest of the command line untouched.
    if argv and argv[0] == "make-model":
        from pdserve.modelgen.make_model import make_model_main

        return make_model_main(argv[1:])
    if argv and argv[0] == "bench":
        from pdserve.bench.cli import bench_main

        return bench_main(argv[1:])
    if argv and argv[0] == "bench-compare":
        from pdserve.bench.compare import main as bench_compare_main

        return bench_compare_main(argv[1:])
    if argv and argv[0] == "bench-engine":
        from pdserve.bench.engine_throughput import main as bench_engine_main

        return bench_engine_main(argv[1:])
    if argv and argv[0] == "bench-gpu":
        from pdserve.bench.gpu_kernels import main as bench_gpu_main

        return bench_gpu_main(argv[1:])
    if argv and argv[0] == "plan":
        from pdserve.planner.cli import main as plan_main

        return plan_main(argv[1:])
    if argv and argv[0] == "bench-kv":
        from pdserve.bench.kv_transfer import bench_kv_main  # (configures the process as a worker's)

        return bench_kv_main(argv[1:])
    if argv and argv[0] in ("prefill", "decode", "colocated", "gateway") and "--settings" in argv:
        if len(argv) != 3 or argv[1] != "--settings":
            raise SystemExit(f"pdserve {argv[0]}: --settings FILE takes no other flags (the file holds them all)")
        return roles.run_from_file(argv[0], argv[2])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
