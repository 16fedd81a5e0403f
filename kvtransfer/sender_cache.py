"""A prefill worker's open KV senders: one per decode-worker destination, reused by every request
going there, replaced once closed, all closed with the worker."""

from __future__ import annotations

import zmq

from pdserve.kvtransfer.sender import KvSender, make_kv_sender
from pdserve.kvtransfer.wire import payload_mac_enabled
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import KvDestination, KvLayout, ShmPool

# what makes two destinations the same sender: transport, address, shm pools and layout, MAC
_Key = tuple[str, str, str | None, KvLayout | None, tuple[ShmPool, ...], bool]


class KvSenderCache:
    def __init__(self, ctx: zmq.Context, auth: FrameAuth, payload_mac_mode: str) -> None:
        payload_mac_enabled(payload_mac_mode)  # validate the mode now, not at the first request
        self.ctx, self.auth, self.payload_mac_mode = ctx, auth, payload_mac_mode
        self._senders: dict[_Key, KvSender] = {}

    def __len__(self) -> int:
        return len(self._senders)

    def get(self, dest: KvDestination) -> KvSender:
        """The open sender to `dest` (made now if there is none, or the last one was closed)."""
        shm = dest.transport in ("shm", "cuda-ipc")  # D's pool written in place
        mac = not shm and payload_mac_enabled(self.payload_mac_mode, dest.kv_addr, encryption=self.auth.encryption)
        pools = tuple(dest.shm_pools) if shm else ()
        key = (dest.transport, dest.kv_addr, dest.shm_name if shm else None, dest.layout if shm else None, pools, mac)
        sender = self._senders.get(key)
        if sender is None or sender.closed:
            sender = self._senders[key] = make_kv_sender(
                dest.transport,
                ctx=self.ctx,
                auth=self.auth,
                kv_addr=dest.kv_addr,
                shm_name=dest.shm_name,
                layout=dest.layout,
                shm_pools=list(dest.shm_pools),
                payload_mac=mac,
            )
        return sender

    def close(self) -> None:
        for sender in self._senders.values():
            sender.close()
        self._senders.clear()
