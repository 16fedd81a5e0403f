"""What the gateway process is started with: one struct, from `pdserve gateway`'s flags (each
field's `Flag` is its flag; cli/settings_flags.py) or from the settings file `pdserve serve` writes."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Annotated

from pdserve.flag import Flag, positive_float
from pdserve.gateway.admission import QueueLimits
from pdserve.gateway.limits import GatewayLimits
from pdserve.gateway.membership import STUCK_AFTER_S
from pdserve.gateway.prefill_placement import DEFAULT_PREFILL_PLACEMENT, PrefillPlacement
from pdserve.gateway.reasoning import REASONING_PARSERS
from pdserve.gateway.request_flow import DEFAULT_KV_TRANSPORT, DEFAULT_ON_DECODE_FAILURE, KV_TRANSPORTS
from pdserve.gateway.router import DEFAULT_LOCAL_PREFILL_MAX_TOKENS, DEFAULT_ROUTER, RouterPolicy
from pdserve.gateway.tools.registry import PARSERS
from pdserve.tracing import OtlpEndpoint


@dataclass(frozen=True)
class GatewayOptions:
    model: Annotated[str, Flag("model folder or GGUF file (tokenizer, chat template, config)")]
    host: Annotated[str, Flag("HTTP bind address (loopback by default)")] = "127.0.0.1"
    port: Annotated[int, Flag("HTTP port")] = 8000
    worker_bind: Annotated[str, Flag("inbox workers connect to")] = "tcp://127.0.0.1:7100"
    worker_advertise: Annotated[
        str | None,
        Flag(
            "the worker-plane address handed to workers that join by this gateway's URL (default: the bound "
            "--worker-bind, a wildcard host replaced by the URL's host)"
        ),
    ] = None
    allow_wildcard_bind: Annotated[
        bool, Flag("let --worker-bind listen on all interfaces (tcp://0.0.0.0:PORT); refused otherwise")
    ] = False
    otlp_traces_endpoint: OtlpEndpoint = None
    kv_transport: Annotated[
        str,
        Flag(
            "how KV moves to decode workers (auto: shared memory on one host, CUDA IPC on one GPU, else zmq)",
            choices=KV_TRANSPORTS,
        ),
    ] = DEFAULT_KV_TRANSPORT
    api_key: Annotated[
        str | None, Flag("the key clients must send (Authorization: Bearer KEY; default: PDSERVE_API_KEY)")
    ] = None
    api_keys_file: Annotated[  # gateway/tenants.py
        str | None,
        Flag(
            "API keys as named tenants, each with optional limits (requests_per_minute, tokens_per_minute, "
            "max_concurrent_requests, max_tokens_per_request) and a default priority: JSON, or TOML (.toml); "
            "see gateway/tenants.py. With --api-key too, that key is the tenant 'default'",
            metavar="PATH",
            parse=os.path.abspath,
        ),
    ] = None
    ssl_certfile: Annotated[
        str | None, Flag("serve HTTPS with this certificate (chain)", metavar="PEM", parse=os.path.abspath)
    ] = None
    ssl_keyfile: Annotated[
        str | None, Flag("... and this private key (both or neither)", metavar="PEM", parse=os.path.abspath)
    ] = None
    max_model_len: Annotated[int | None, Flag("longest prompt + output (default: the model's max context)")] = None
    served_model_name: Annotated[str | None, Flag("the model's name in the API (default: the model folder's name)")] = (
        None
    )
    on_decode_failure: Annotated[
        str,
        Flag(
            "a dead decode worker's requests: re-prefill elsewhere and continue, or end with an error",
            choices=("migrate", "fail"),
        ),
    ] = DEFAULT_ON_DECODE_FAILURE
    request_timeout_s: Annotated[
        float | None, Flag("seconds; longer requests end with an error", name="--request-timeout")
    ] = GatewayLimits.request_timeout_s
    stream_write_timeout_s: Annotated[
        float,
        Flag(
            "seconds a client may leave a streamed response unread before it is cut (and aborted)",
            name="--stream-write-timeout",
            parse=positive_float,
        ),
    ] = GatewayLimits.stream_write_timeout_s
    chat_template: Annotated[  # a Jinja file in place of the tokenizer's own template
        str | None, Flag("a Jinja chat template file for /v1/chat/completions (default: the tokenizer's own)")
    ] = None
    tool_call_parser: Annotated[  # gateway/tools/registry.py
        str | None,
        Flag(
            "the model's tool-call format (vLLM's names; gateway/tools/): chat requests with tools are read for "
            "calls in it, and tool_choice required or a named function is forced by a grammar of it (default: "
            "none, and a request with tools gets a 400 unless tool_choice is none)",
            choices=tuple(PARSERS),
        ),
    ] = None
    reasoning_parser: Annotated[  # gateway/reasoning.py
        str | None,
        Flag(
            "the model's reasoning markers (vLLM's names): chat answers carry the reasoning apart, as "
            "reasoning_content and its streamed deltas (default: none, the reasoning stays in the content)",
            choices=tuple(REASONING_PARSERS),
        ),
    ] = None
    queue_limits: QueueLimits = QueueLimits()  # per pool: waiting requests, tokens, seconds
    # a worker with work pending whose engine step has not completed for this long counts as dead
    stuck_after_s: Annotated[
        float,
        Flag(
            "seconds a worker with work pending may go without finishing an engine step before it counts as "
            "dead (heartbeats alone do not keep it alive)",
            name="--stuck-after",
        ),
    ] = STUCK_AFTER_S
    # a decode worker holding all but this many prompt tokens prefills them itself (0: never)
    local_prefill_max_tokens: Annotated[
        int,
        Flag(
            "the longest uncached rest of a prompt a decode worker prefills itself under --prefill-placement "
            "auto or remote (0: never; the rule: docs/ARCHITECTURE.md, prefill placement)"
        ),
    ] = DEFAULT_LOCAL_PREFILL_MAX_TOKENS
    router: Annotated[  # gateway/router.py
        RouterPolicy,
        Flag(
            "which worker takes a request: kv-aware (the one holding most of the prompt, then the least loaded; "
            "short rests prefilled on the decode worker), least-loaded (load only), round-robin (gateway/router.py)"
        ),
    ] = DEFAULT_ROUTER
    prefill_placement: Annotated[  # gateway/prefill_placement.py
        PrefillPlacement,
        Flag(
            "where a prompt is prefilled: auto (kv-aware router: on the decode worker when a cost model of queue, "
            "compute, KV transfer and the stall of its running decodes says it is cheaper, cached or not), "
            "remote (the prefill pool, but a prompt the decode worker holds all but --local-prefill-max-tokens "
            "of is prefilled there), local (always the decode worker, when it has a seat); docs/ARCHITECTURE.md"
        ),
    ] = DEFAULT_PREFILL_PLACEMENT
