"""`pdserve` console script."""

from __future__ import annotations

import argparse
import sys

from pdserve.cli import roles
from pdserve.cli.engine_args import add_engine_args
from pdserve.gateway.prefill_placement import PREFILL_PLACEMENTS
from pdserve.gateway.router import DEFAULT_LOCAL_PREFILL_MAX_TOKENS, ROUTER_POLICIES


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (got {text})")
    return value


def _add_admission_args(p: argparse.ArgumentParser) -> None:
    """The gateway's queue and client limits: `pdserve serve` passes them on to its gateway."""
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="requests waiting per pool for a worker to take them; more get 429 + Retry-After",
    )
    p.add_argument(
        "--max-queued-tokens",
        type=int,
        default=2**21,
        help="prompt tokens waiting per pool; more get 429 + Retry-After",
    )
    p.add_argument(
        "--max-queue-wait",
        type=_positive_float,
        default=300.0,
        help="seconds a request may wait for a worker to take it before a 503 + Retry-After "
        "(before any token: a started request never fails on a queue timer)",
    )
    p.add_argument(
        "--stream-write-timeout",
        type=_positive_float,
        default=30.0,
        help="seconds a client may leave a streamed response unread before it is cut (and aborted)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template file for /v1/chat/completions (default: the tokenizer's own)",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=["hermes", "llama3_json", "mistral", "pythonic"],
        help="the model's tool-call format (vLLM's names; gateway/tools/): chat requests with tools are read "
        "for calls in it, and tool_choice required or a named function is forced by a grammar of it "
        "(default: none, and a request with tools gets a 400 unless tool_choice is none)",
    )
    p.add_argument(
        "--local-prefill-max-tokens",
        type=int,
        default=DEFAULT_LOCAL_PREFILL_MAX_TOKENS,
        help="the longest uncached rest of a prompt a decode worker prefills itself under --prefill-placement "
        "auto or remote (0: never; the rule: docs/ARCHITECTURE.md, prefill placement)",
    )
    p.add_argument(
        "--prefill-placement",
        default="remote",
        choices=PREFILL_PLACEMENTS,
        help="where a prompt is prefilled: remote (the prefill pool, but a prompt the decode worker holds all "
        "but --local-prefill-max-tokens of is prefilled there), auto (kv-aware router: on the decode worker "
        "when a cost model of queue, compute, KV transfer and the stall of its running decodes says it is "
        "cheaper, cached or not), local (always the decode worker, when it has a seat); docs/ARCHITECTURE.md",
    )
    p.add_argument(
        "--router",
        default="kv-aware",
        choices=ROUTER_POLICIES,
        help="which worker takes a request: kv-aware (the one holding most of the prompt, then the least "
        "loaded; short rests prefilled on the decode worker), least-loaded (load only), round-robin "
        "(gateway/router.py)",
    )


def _add_tls_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ssl-certfile", default=None, metavar="PEM", help="serve HTTPS with this certificate (chain)")
    p.add_argument("--ssl-keyfile", default=None, metavar="PEM", help="... and this private key (both or neither)")


def _add_api_key_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", default=None)
    p.add_argument(
        "--api-keys-file",
        default=None,
        metavar="PATH",
        help="API keys as named tenants, each with optional limits (requests_per_minute, tokens_per_minute, "
        "max_concurrent_requests, max_tokens_per_request) and a default priority: JSON, or TOML (.toml); "
        "see gateway/tenants.py. With --api-key too, that key is the tenant 'default'",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="gateway + prefill and decode pools on this machine")
    add_engine_args(s)
    s.add_argument("--prefill-workers", type=int, default=1)
    s.add_argument("--decode-workers", type=int, default=1)
    s.add_argument("--colocated", action="store_true", help="one worker doing both phases (baseline)")
    s.add_argument(
        "--prefill-threads",
        type=int,
        default=None,
        help="torch threads per prefill worker (default: --threads, else cores / workers)",
    )
    s.add_argument(
        "--decode-threads",
        type=int,
        default=None,
        help="torch threads per decode worker (default: --threads, else cores / workers)",
    )
    for pool in ("prefill", "decode"):
        s.add_argument(
            f"--{pool}-tensor-parallel-size",
            type=int,
            default=None,
            help=f"tensor-parallel degree of each {pool} worker (default: --tensor-parallel-size); "
            "the pools' degrees may differ: KV heads are re-sliced on the way (kvtransfer/head_ranges.py)",
        )
    s.add_argument(
        "--decode-idle-threads",
        type=int,
        default=None,
        help="torch threads per decode worker while no prefill for it is in flight: it borrows "
        "the prefill cores then (default: cores / decode workers; = --decode-threads: off)",
    )
    s.add_argument("--host", default="127.0.0.1", help="HTTP bind address (loopback by default)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--kv-transport", default="auto", choices=["auto", "shm", "zmq-ipc", "zmq-tcp"])
    _add_api_key_args(s)
    _add_tls_args(s)
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--request-timeout", type=float, default=None, help="seconds; longer requests end with an error")
    _add_admission_args(s)
    s.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="export OpenTelemetry traces (OTLP/HTTP, e.g. http://collector:4318/v1/traces); needs pdserve[tracing]",
    )
    s.add_argument(
        "--lease-ttl",
        type=float,
        default=30.0,
        help="seconds a decode worker's KV reservation stays valid (and quarantined after an abort)",
    )
    s.add_argument(
        "--on-decode-failure",
        default="migrate",
        choices=["migrate", "fail"],
        help="a dead decode worker's requests: re-prefill elsewhere and continue, or end with an error",
    )
    s.add_argument(
        "--kv-payload-mac",
        default="auto",
        choices=["auto", "on", "off"],
        help="HMAC over KV payload bytes: auto = on for zmq-tcp, off for zmq-ipc and shm",
    )
    s.add_argument(
        "--stuck-after",
        type=float,
        default=30.0,
        help="seconds a worker with work pending may go without finishing an engine step "
        "before the gateway counts it as dead",
    )
    s.add_argument(
        "--prefill-nice",
        type=int,
        default=0,
        help="lower the prefill workers' CPU priority by this much, so that on shared cores a "
        "decode step never waits behind a prefill (use with --prefill-threads = all cores)",
    )
    s.add_argument(
        "--prefill-idle-lanes",
        type=int,
        default=None,
        help="extra lanes per prefill worker at the kernel's idle priority (SCHED_IDLE): they run "
        "prefill steps on the cycles the decode pool leaves idle, and a decode step preempts "
        "them at once (default: the cores outside the prefill pool, in --prefill-threads lanes)",
    )
    s.add_argument(
        "--tpot-slo-ms",
        type=_positive_float,
        default=60.0,
        help="the time-per-output-token target decode is paced within (see --decode-step-interval-ms)",
    )
    s.add_argument(
        "--min-num-seqs",
        type=int,
        default=None,
        help="adapt each decode worker's limit on running sequences between this and --max-num-seqs: "
        "additive increase while steps meet --tpot-slo-ms without preemption, halved on a preemption "
        "or a breach; the gateway admits by the current limit (default: fixed at --max-num-seqs)",
    )
    s.add_argument(
        "--decode-step-interval-ms",
        type=float,
        default=None,
        help="while prompts for a decode worker queue behind a prefill, it spaces its steps, up to this "
        "far apart at a queue of 2 prompts: the gaps go to prefill and its batch grows, spending TPOT "
        "slack on TTFT and capacity (0: back to back; default: 0.6 x --tpot-slo-ms when prefill can "
        "use the decode cores, else 0)",
    )
    s.add_argument(
        "--prefill-max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget of a prefill (or --colocated) worker's step (default: 512 on CPU, where a smaller step "
        "gives a queue's first prompts their first token sooner; else --max-num-batched-tokens)",
    )

    g = sub.add_parser("gateway", help="the HTTP gateway alone")
    g.add_argument(
        "--settings",
        default=None,
        metavar="FILE",
        help="start from this settings file (JSON, as `pdserve serve` writes), with no other flags",
    )
    g.add_argument("--model", default=None, help="model folder or GGUF file (tokenizer, chat template, config)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--worker-bind", default="tcp://127.0.0.1:7100", help="inbox workers connect to")
    g.add_argument(
        "--worker-advertise",
        default=None,
        help="the worker-plane address handed to workers that join by this gateway's URL "
        "(default: the bound --worker-bind, a wildcard host replaced by the URL's host)",
    )
    g.add_argument(
        "--allow-wildcard-bind",
        action="store_true",
        help="let --worker-bind listen on all interfaces (tcp://0.0.0.0:PORT); refused otherwise",
    )
    g.add_argument("--kv-transport", default="auto", choices=["auto", "shm", "zmq"])
    _add_api_key_args(g)
    _add_tls_args(g)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--on-decode-failure", default="migrate", choices=["migrate", "fail"])
    g.add_argument("--request-timeout", type=float, default=None, help="seconds; longer requests end with an error")
    _add_admission_args(g)
    g.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="export OpenTelemetry traces (OTLP/HTTP, e.g. http://collector:4318/v1/traces); needs pdserve[tracing]",
    )
    g.add_argument(
        "--stuck-after",
        type=float,
        default=30.0,
        help="seconds a worker with work pending may go without finishing an engine step "
        "before it counts as dead (heartbeats alone do not keep it alive)",
    )

    for role, fn in (("prefill", roles.run_prefill), ("decode", roles.run_decode), ("colocated", roles.run_colocated)):
        w = sub.add_parser(role, help=f"one {role} worker")
        roles.add_worker_args(w)
        if role == "decode":
            w.add_argument("--kv-bind", default="tcp://127.0.0.1:0", help="inbox for KV frames")
            w.add_argument("--no-shm", action="store_true", help="plain (not shared) KV memory")
            w.add_argument("--lease-ttl", type=float, default=30.0, help="seconds a KV lease stays valid")
            w.add_argument(
                "--idle-threads",
                type=int,
                default=None,
                help="torch threads while no prefill for this worker is in flight, borrowing "
                "the prefill pool's cores on a shared machine (default, alone on a machine: --threads)",
            )
            w.add_argument(
                "--min-num-seqs",
                type=int,
                default=None,
                help="adapt each decode worker's limit on running sequences between this and --max-num-seqs: "
                "additive increase while steps meet --tpot-slo-ms (default 60) without preemption, halved on a preemption "
                "or a breach; the gateway admits by the current limit (default: fixed at --max-num-seqs)",
            )
            w.add_argument("--tpot-slo-ms", type=_positive_float, default=60.0, help="decode step time target")
            w.add_argument(
                "--step-interval-ms",
                type=float,
                default=None,
                help="while prompts for this worker queue behind a prefill, space decode steps up to this "
                "far apart (at a queue of 2 prompts), leaving the gaps to prefill (0, the default "
                "for a worker alone on its machine: back to back)",
            )
        if role == "prefill":
            w.add_argument(
                "--lanes",
                type=int,
                default=1,
                help="threads that each run a prefill step (of --threads torch threads), in parallel",
            )
            w.add_argument(
                "--idle-lanes",
                type=int,
                default=None,
                help="more such lanes at SCHED_IDLE priority: they use only cycles no other "
                "process wants (default: the machine's cores outside --threads, in lanes of --threads)",
            )
        if role in ("prefill", "decode"):
            roles.add_kv_args(w, role)
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
    # Tools with their own parsers get the rest of the command line untouched.
    if argv and argv[0] == "make-model":
        from pdserve.engine.make_model import make_model_main

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
        from pdserve.kvtransfer.bench import bench_kv_main

        return bench_kv_main(argv[1:])
    if argv and argv[0] in ("prefill", "decode", "colocated", "gateway") and "--settings" in argv:
        if len(argv) != 3 or argv[1] != "--settings":
            raise SystemExit(f"pdserve {argv[0]}: --settings FILE takes no other flags (the file holds them all)")
        return roles.run_from_file(argv[0], argv[2])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
