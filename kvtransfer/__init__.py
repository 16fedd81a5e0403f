"""Moving a request's KV blocks from a prefill worker (P) to a decode worker (D).

wire.py      KvFrameHeader + KvDone: what travels on D's KV stream
lease.py     LeaseTable (D): epochs, deadlines, per-layer coverage, quarantine
shm.py       SharedTensor: D's KV pool in named shared memory, mapped by P on the same host
sender.py    ZmqKvSender / ShmKvSender (P), make_kv_sender
sender_cache.py  KvSenderCache: one open sender per decode-worker destination (P)
receiver.py  KvReceiver (D): verify, land in the pool, report completed requests
bench.py     `pdserve bench-kv`
"""
