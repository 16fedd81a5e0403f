"""A packet capture on a link, as tcpdump would take it (no tcpdump needed): run inside the
namespace that holds the device, it appends the TCP payload of every IPv4 frame crossing `DEV`
to `OUT`, except those to or from the ports given with --skip-port (the gateway's HTTP).

    ip netns exec NS python tests/reliability/link_capture.py DEV OUT [--skip-port 8000 ...]

DEV "any" takes every device of the namespace: in the LAN's namespace, the bridge's ports,
which carry every host's frames (a frame shows up once per port it crosses). It stops on
SIGTERM. Frames are read with an AF_PACKET socket (root)."""

from __future__ import annotations

import argparse
import signal
import socket
import struct
import sys

ETH_P_ALL = 0x0003


def tcp_payload(frame: bytes) -> tuple[int, int, bytes] | None:
    """(source port, destination port, payload) of an Ethernet/IPv4/TCP frame, else None."""
    if len(frame) < 14 + 20 or frame[12:14] != b"\x08\x00":
        return None
    ip = frame[14:]
    ihl = (ip[0] & 0x0F) * 4
    if ip[9] != 6:  # not TCP
        return None
    total = struct.unpack("!H", ip[2:4])[0]
    tcp = ip[ihl:total]
    if len(tcp) < 20:
        return None
    sport, dport = struct.unpack("!HH", tcp[:4])
    return sport, dport, tcp[(tcp[12] >> 4) * 4 :]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("dev")
    p.add_argument("out")
    p.add_argument("--skip-port", type=int, action="append", default=[])
    args = p.parse_args()
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    if args.dev != "any":
        sock.bind((args.dev, 0))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with open(args.out, "ab", buffering=0) as out:
        print("capturing", flush=True)
        while True:
            parsed = tcp_payload(sock.recv(1 << 16))
            if parsed is not None and parsed[2] and not {parsed[0], parsed[1]} & set(args.skip_port):
                out.write(parsed[2])


if __name__ == "__main__":
    sys.exit(main())
