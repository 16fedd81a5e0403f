"""The ceiling of any socket transport on this host: bytes alone through a Unix stream socket into
another process, no gather, scatter, framing or authentication (`pdserve bench-kv` prints it
beside zmq-ipc).

A socket moves each byte twice (into the kernel, out again to the reader), so even this bare
path runs at a fraction of one memcpy; zmq-ipc adds a gather out of P's pool and a scatter into
D's. The sink is a separate interpreter that imports nothing but `socket` and `sys` and inherits
its end of a socketpair: each round it reads `nbytes` into a buffer it reuses, then answers one
byte, so a round is timed from the first byte sent to that answer.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

# Larger socket buffers than Linux's default (~200 KiB): fewer wake-ups per MB (measured 8.3-8.6
# against 6.8-7.5 GB/s on a 32 MiB message, 2-core AMD EPYC). Linux caps them at net.core.*_max.
SOCKET_BUFFER_BYTES = 4 << 20

_SINK = """
import socket, sys
nbytes = int(sys.argv[1])
s = socket.socket(fileno=int(sys.argv[2]))
buf = memoryview(bytearray(nbytes))
while True:
    got = 0
    while got < nbytes:
        n = s.recv_into(buf[got:], nbytes - got)
        if n == 0:
            sys.exit(0)
        got += n
    s.sendall(b"k")
"""


class UnixSocketSink:
    """A reader process at the far end of a Unix socketpair; `once(payload)` times one message."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.sock, far = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for s in (self.sock, far):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _SINK, str(nbytes), str(far.fileno())], pass_fds=(far.fileno(),)
            )
        except BaseException:
            self.sock.close()
            raise
        finally:
            far.close()

    def once(self, payload: memoryview) -> float:
        """Seconds to move `payload` (nbytes) into the sink and hear back."""
        if payload.nbytes != self.nbytes:
            raise ValueError(f"payload of {payload.nbytes} bytes, the sink reads {self.nbytes}")
        t0 = time.perf_counter()
        self.sock.sendall(payload)
        if self.sock.recv(1) != b"k":
            raise ConnectionError("the socket sink closed before answering")
        return time.perf_counter() - t0

    def close(self) -> None:
        self.sock.close()  # the sink reads EOF and exits
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
