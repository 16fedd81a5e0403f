"""Caps on what one HTTP request may ask for."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GatewayLimits:
    max_body_bytes: int = 4 * 2**20  # 413 above
    max_n: int = 16
    max_logprobs: int = 20
    max_stop: int = 16
    max_stop_len: int = 256
    request_timeout_s: float | None = None  # end (and abort) a request running longer than this
    header_timeout_s: float = 10.0  # request headers not complete this long after they began: 408
    max_header_bytes: int = 64 * 2**10  # request line + headers above this: 431
    body_read_timeout_s: float = 30.0  # a request body not received whole within this: 408
    max_stream_buffer: int = 1024  # outputs held for a client reading slower than tokens come
    stream_write_timeout_s: float = 30.0  # a client that leaves our writes unread this long is cut

    def __post_init__(self) -> None:
        if min(self.max_body_bytes, self.max_n, self.max_stop, self.max_stop_len) < 1:
            raise ValueError("gateway limits must be positive")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError("request_timeout_s must be > 0")
        if min(self.header_timeout_s, self.body_read_timeout_s, self.stream_write_timeout_s) <= 0:
            raise ValueError("header/body/stream timeouts must be > 0")
        if min(self.max_stream_buffer, self.max_header_bytes) < 1:
            raise ValueError("max_stream_buffer and max_header_bytes must be >= 1")
