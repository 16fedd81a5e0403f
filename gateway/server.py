"""The gateway process: tokenizer + ClusterBackend + Starlette app under uvicorn."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import uvicorn

from pdserve import tracing
from pdserve.engine.config import ModelConfig
from pdserve.engine.gguf_file import load_tokenizer, unrendered_token_ids
from pdserve.gateway.app import create_app
from pdserve.gateway.cluster_backend import ClusterBackend
from pdserve.gateway.limits import GatewayLimits
from pdserve.gateway.options import GatewayOptions
from pdserve.gateway.slow_clients import http_protocol
from pdserve.gateway.tenants import KeysFileError, TenantDirectory, read_keys_file
from pdserve.gateway.tls import check_tls_files
from pdserve.protocol.auth import FrameAuth

log = logging.getLogger(__name__)


def _chat_template(path: str | None) -> str | None:
    """The text of a --chat-template file (read once, at start: a missing file fails now)."""
    if path is None:
        return None
    try:
        return Path(path).read_text()
    except OSError as e:
        raise SystemExit(f"--chat-template {path}: {e}") from None


def tenant_directory(api_key: str | None, api_keys_file: str | None) -> TenantDirectory:
    """The tenants of --api-key and --api-keys-file (read once, at start: a bad file fails now)."""
    try:
        return TenantDirectory.build(api_key, read_keys_file(api_keys_file) if api_keys_file else ())
    except KeysFileError as e:
        raise SystemExit(f"--api-keys-file: {e}") from None


def _run_loop(main: Coroutine[Any, Any, None]) -> None:
    """uvloop where installed (as `uvicorn.run` would pick; `server.serve()` alone does not):
    its C event loop takes a fraction of asyncio's per wake-up and write (docs/benchmarks/gateway_cpu.md)."""
    try:
        import uvloop
    except ImportError:  # (not a dependency on Windows)
        asyncio.run(main)
        return
    uvloop.run(main)


def serve_gateway(opts: GatewayOptions, auth: FrameAuth) -> None:
    check_tls_files(opts.ssl_certfile, opts.ssl_keyfile)
    try:
        tracing.setup_tracing("pdserve-gateway", opts.otlp_traces_endpoint)
    except tracing.TracingUnavailable as e:
        raise SystemExit(f"pdserve gateway: {e}") from None

    tokenizer = load_tokenizer(opts.model)  # an HF folder or a GGUF file
    model_cfg = ModelConfig.from_folder(opts.model)
    max_len = min(opts.max_model_len or model_cfg.max_context, model_cfg.max_context)
    backend = ClusterBackend(
        auth,
        opts.worker_bind,
        kv_transport=opts.kv_transport,
        on_decode_failure=opts.on_decode_failure,
        stuck_after_s=opts.stuck_after_s,
        queue_limits=opts.queue_limits,
        local_prefill_max_tokens=opts.local_prefill_max_tokens,
        router=opts.router,
        prefill_placement=opts.prefill_placement,
        worker_advertise=opts.worker_advertise,
        allow_wildcard_bind=opts.allow_wildcard_bind,
    )
    app = create_app(
        backend,
        tokenizer,
        model_name=opts.served_model_name or Path(opts.model).name,
        max_model_len=max_len,
        limits=GatewayLimits(
            request_timeout_s=opts.request_timeout_s, stream_write_timeout_s=opts.stream_write_timeout_s
        ),
        tenants=tenant_directory(opts.api_key, opts.api_keys_file),
        chat_template=_chat_template(opts.chat_template),
        tool_call_parser=opts.tool_call_parser,
        reasoning_parser=opts.reasoning_parser,
        model_root=str(Path(opts.model).resolve()),
        unrendered_token_ids=unrendered_token_ids(opts.model),
    )

    async def main() -> None:
        await backend.start()
        gw = app.state.gateway  # its limits: header, body and write deadlines on each connection
        server = uvicorn.Server(
            uvicorn.Config(
                app,
                host=opts.host,
                port=opts.port,
                log_level="warning",
                lifespan="off",
                timeout_graceful_shutdown=25,
                # typed as a Protocol class; uvicorn only calls it, a factory works
                http=http_protocol(gw.limits, gw.stream_cut, gw.header_deadline),  # type: ignore[arg-type]
                ssl_certfile=opts.ssl_certfile,
                ssl_keyfile=opts.ssl_keyfile,
            )
        )
        log.info("gateway on %s://%s:%d", "https" if opts.ssl_certfile else "http", opts.host, opts.port)
        try:
            await server.serve()
        finally:
            await backend.stop()

    try:
        _run_loop(main())
    finally:
        tracing.shutdown()
