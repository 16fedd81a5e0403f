"""Cross-process protocol: typed messages (msgspec/msgpack), frame authentication, ZMQ channels.

Light on purpose (no torch import): the gateway, both node kinds and tools share it.
"""
