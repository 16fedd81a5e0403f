"""The Unix-socket sink bench-kv times as the ceiling of a socket transport: it reads whole
messages in another process, answers each, and goes away when closed."""

from __future__ import annotations

import pytest

from pdserve.bench.socket_ceiling import UnixSocketSink


def test_sink_reads_whole_messages_and_exits_on_close():
    sink = UnixSocketSink(1 << 20)
    try:
        payload = memoryview(bytes(range(256)) * 4096)
        times = [sink.once(payload) for _ in range(3)]  # each waits for the sink's answer
        assert all(t > 0 for t in times)
        with pytest.raises(ValueError, match="sink reads"):
            sink.once(memoryview(b"short"))
    finally:
        sink.close()
    assert sink.proc.returncode == 0  # EOF ended it, not a kill


def test_a_dead_sink_is_an_error_not_a_hang():
    sink = UnixSocketSink(16)
    sink.proc.kill()
    sink.proc.wait()
    try:
        with pytest.raises((ConnectionError, OSError)):
            sink.once(memoryview(b"x" * 16))
    finally:
        sink.close()
