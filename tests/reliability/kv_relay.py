"""Fault-injection relay on the KV data path: prefill worker -> relay -> decode worker (zmq tcp).

    P (PUSH, connects to D's *advertised* KV address) --> [ PULL  relay thread  PUSH ] --> D's KV inbox

The decode worker binds its real KV inbox and advertises the relay's address (`pdserve decode
--kv-advertise`), so every KV message of the cluster passes through here. The relay reads each
multipart message `[mac, header, *payloads]`, decodes the msgpack header to see what it carries
(an on-path attacker can do that too: the MAC authenticates, it does not hide), and forwards it
byte for byte unless a fault is armed. It never holds the cluster secret, so whatever it alters
is something the decode worker has to catch on its own.

A fault targets one request: the first request whose layer frame arrives after `arm()`.
    drop      the target's layer frames number skip .. skip+frames-1 are not forwarded
    truncate  those frames' payload is cut to half its length (the header still says the full size)
    corrupt   those frames' payload has bits flipped (the high byte of every 4-byte word XOR 0x40),
              header untouched
    replay    those frames are forwarded twice, back to back
    delay     every message of the target (layer frames and its KvDone) is held `delay_s`
Order is kept (FIFO): a message queued behind a delayed one waits for it, like bytes on one TCP
connection. `applied` records what was done, so a test can check the fault really happened.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Literal

import zmq

from pdserve.kvtransfer.wire import KvFrameHeader, decode_kv

Action = Literal["drop", "truncate", "corrupt", "replay", "delay"]


@dataclass(frozen=True)
class Fault:
    action: Action
    frames: int = 1  # layer frames of the target request altered (not used by "delay")
    skip: int = 0  # layer frames of the target let through untouched first
    delay_s: float = 0.0  # "delay": how long each of the target's messages is held


@dataclass(frozen=True)
class Applied:
    action: Action
    request_id: str
    what: str  # "layer 1 seq 1", "KvDone"


def flip_payload(payload: bytes) -> bytes:
    """Flip one exponent bit in every 4-byte word (float32/16 KV values become huge or tiny)."""
    out = bytearray(payload)
    for i in range(3, len(out), 4):
        out[i] ^= 0x40
    return bytes(out)


class KvRelay(threading.Thread):
    """Binds `listen` (PULL), forwards to `upstream` (PUSH); `arm()` a Fault, `applied` shows it."""

    def __init__(self, listen: str, upstream: str) -> None:
        super().__init__(daemon=True, name="kv-relay")
        self.ctx = zmq.Context()
        self._pull = self.ctx.socket(zmq.PULL)
        self._push = self.ctx.socket(zmq.PUSH)
        for sock in (self._pull, self._push):
            sock.setsockopt(zmq.LINGER, 0)
        self._pull.bind(listen)
        self._push.connect(upstream)
        self.addr = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)
        self._lock = threading.Lock()
        self._fault: Fault | None = None
        self._target: str | None = None
        self._layer_frames = 0  # layer frames of the target seen so far
        self._queue: collections.deque[tuple[float, list]] = collections.deque()  # (release at, frames)
        self._stopping = threading.Event()
        self.applied: list[Applied] = []
        self.forwarded = 0
        self.error: BaseException | None = None

    # --- control (any thread) ---------------------------------------------------------------
    def arm(self, fault: Fault) -> None:
        """Apply `fault` to the next request whose KV passes through (earlier ones unaffected)."""
        with self._lock:
            self._fault, self._target, self._layer_frames = fault, None, 0
            self.applied = []

    def done_with(self) -> list[Applied]:
        """Disarm; what the fault did."""
        with self._lock:
            self._fault, self._target = None, None
            return list(self.applied)

    @property
    def idle(self) -> bool:
        """Nothing held back (every delayed message has gone on)."""
        return not self._queue

    @property
    def target(self) -> str | None:
        with self._lock:
            return self._target

    def stop(self) -> None:
        self._stopping.set()
        self.join(5)
        self.ctx.destroy(linger=0)

    # --- the relay loop (its own thread owns both sockets) -----------------------------------
    def run(self) -> None:
        try:
            while not self._stopping.is_set():
                wait_ms = 20
                if self._queue:
                    wait_ms = max(0, min(wait_ms, int((self._queue[0][0] - time.monotonic()) * 1000)))
                if self._pull.poll(wait_ms, zmq.POLLIN):
                    self._take(self._pull.recv_multipart())
                self._release_due()
        except BaseException as e:  # surfaced by the test through `error`
            if not self._stopping.is_set():
                self.error = e

    def _release_due(self) -> None:
        now = time.monotonic()
        while self._queue and self._queue[0][0] <= now:
            self._push.send_multipart(self._queue.popleft()[1])
            self.forwarded += 1

    def _enqueue(self, frames: list[bytes], delay_s: float = 0.0) -> None:
        release = time.monotonic() + delay_s
        if self._queue:
            release = max(release, self._queue[-1][0])  # FIFO, like one TCP stream
        self._queue.append((release, frames))

    def _take(self, frames: list[bytes]) -> None:
        """Route one message through the armed fault (if it concerns the target request)."""
        try:
            msg = decode_kv(frames[1]) if len(frames) >= 2 else None
        except Exception:  # not a KV message: the decode worker will drop it, pass it on
            msg = None
        with self._lock:
            fault = self._fault
            action = None if fault is None or msg is None else self._action_for(fault, msg)
            if action is not None:
                what = f"layer {msg.layer} seq {msg.seq}" if isinstance(msg, KvFrameHeader) else type(msg).__name__
                self.applied.append(Applied(action, msg.request_id, what))
        if action is None:
            self._enqueue(frames)
            return
        if action == "drop":
            return
        if action == "delay":
            self._enqueue(frames, fault.delay_s)
        elif action == "replay":
            self._enqueue(frames)
            self._enqueue(list(frames))
        elif action == "truncate":
            self._enqueue(frames[:2] + [frames[2][: len(frames[2]) // 2]] + frames[3:])
        elif action == "corrupt":
            self._enqueue(frames[:2] + [flip_payload(frames[2])] + frames[3:])

    def _action_for(self, fault: Fault, msg) -> Action | None:
        """Which action (if any) this message gets; called with the lock held."""
        is_layer = isinstance(msg, KvFrameHeader) and not msg.in_place
        if self._target is None and is_layer:
            self._target = msg.request_id
        if msg.request_id != self._target:
            return None
        if fault.action == "delay":
            return "delay"
        if not is_layer:
            return None
        k = self._layer_frames
        self._layer_frames += 1
        return fault.action if fault.skip <= k < fault.skip + fault.frames else None
