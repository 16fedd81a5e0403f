"""Separate "hosts" on one machine: a network namespace per host, each joined by a veth link to
a bridge in a namespace of its own (the LAN), with its own address. The test's own namespace
gets a link too, as a client would. Needs root (CAP_NET_ADMIN); `available()` says whether it
can be done here. Everything is removed on exit, whatever happened."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    name = f"pdprobe{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", name)
    except subprocess.CalledProcessError as e:
        return f"cannot create a network namespace: {e.stderr.strip()}"
    try:  # what lan() needs inside one: a bridge and a veth pair
        _ip("-n", name, "link", "add", "br0", "type", "bridge")
        _ip("-n", name, "link", "add", "va", "type", "veth", "peer", "name", "vb")
    except subprocess.CalledProcessError as e:
        return f"cannot create a bridge or veth link: {e.stderr.strip()}"
    finally:
        _ip("netns", "del", name)
    return None


def netem_available(ns: str, dev: str) -> bool:
    """Whether `tc ... netem` works on that link (the kernel may lack sch_netem)."""
    r = subprocess.run(
        ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "netem", "delay", "1ms"],
        capture_output=True,
    )
    if r.returncode != 0:
        return False
    subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)
    return True


@dataclass
class Lan:
    tag: str
    subnet: str  # "198.18.X" (a /24 of 198.18.0.0/15, the range set aside for network tests)
    hosts: dict[str, str] = field(default_factory=dict)  # host name -> address
    links: dict[str, str] = field(default_factory=dict)  # host name -> its link's device name

    def ns(self, host: str) -> str:
        return f"pd{self.tag}-{host}"

    @property
    def lan_ns(self) -> str:
        """The namespace holding the bridge (`br0`) every host's link is attached to."""
        return f"pd{self.tag}-lan"

    def exec_argv(self, host: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host), *argv]

    def set_link(self, host: str, up: bool) -> None:
        _ip("-n", self.ns(host), "link", "set", self.links[host], "up" if up else "down")

    def tc(self, host: str, *args: str) -> str:
        argv = ["ip", "netns", "exec", self.ns(host), "tc", *args]
        return subprocess.run(argv, check=True, capture_output=True, text=True).stdout

    def impair(self, host: str) -> str:
        """Make `host`'s outgoing link slow and lossy; say how. With netem: 20 ms delay and 2%
        loss. Kernels without sch_netem (this project's machines) get what HTB and u32 can do: a
        20 Mbit/s cap (bulk KV queues behind it) and every IPv4 packet whose IP id ends in 4
        zero bits (1 in 16 of a flow's packets, retransmissions included by chance) sent to a
        class whose queue holds nothing, i.e. dropped. SYN and SYN-ACK segments are spared:
        a SYN-ACK's id is 0 on Linux, so every connection to the host would fail otherwise."""
        dev = self.links[host]
        if netem_available(self.ns(host), dev):
            self.tc(host, "qdisc", "add", "dev", dev, "root", "netem", "delay", "20ms", "loss", "2%")
            return "netem delay 20ms loss 2%"
        self.tc(host, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10")
        self.tc(host, "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate", "20mbit")
        self.tc(host, "class", "add", "dev", dev, "parent", "1:", "classid", "1:20", "htb", "rate", "8kbit")
        self.tc(host, "qdisc", "add", "dev", dev, "parent", "1:20", "handle", "20:", "pfifo", "limit", "0")
        u32 = ["filter", "add", "dev", dev, "parent", "1:", "protocol", "ip"]
        # IPv4 without options (IHL 5): TCP flags at byte 33; SYN is bit 0x02
        self.tc(host, *u32, "prio", "1", "u32", "match", "u8", "0x02", "0x02", "at", "33", "flowid", "1:10")
        self.tc(host, *u32, "prio", "2", "u32", "match", "u16", "0x0000", "0x000f", "at", "4", "flowid", "1:20")
        return "htb 20mbit, 1/16 of packets dropped (u32 on the IP id)"

    def dropped(self, host: str) -> int:
        """Packets the impaired link has dropped so far (its root qdisc's count, which includes
        its classes')."""
        out = self.tc(host, "-s", "qdisc", "show", "dev", self.links[host])
        return int(out.split("(dropped", 1)[1].split(",", 1)[0])


@contextlib.contextmanager
def lan(hosts: list[str]) -> Iterator[Lan]:
    """Hosts on one /24, addresses .1, .2, ... in the order given; this process reaches them
    from .254."""
    tag = uuid.uuid4().hex[:5]
    net = Lan(tag, f"198.18.{int(tag, 16) % 250 + 1}")
    lan_ns = net.lan_ns
    made: list[str] = []
    client_link = f"pd{tag}c"
    try:
        _ip("netns", "add", lan_ns)
        made.append(lan_ns)
        _ip("-n", lan_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", lan_ns, "link", "set", "br0", "up")
        for i, host in enumerate(hosts, start=1):
            ns = net.ns(host)
            _ip("netns", "add", ns)
            made.append(ns)
            dev, peer = f"pd{tag}h{i}", f"pd{tag}b{i}"
            _ip("link", "add", dev, "type", "veth", "peer", "name", peer)
            _ip("link", "set", dev, "netns", ns)
            _ip("link", "set", peer, "netns", lan_ns)
            _ip("-n", lan_ns, "link", "set", peer, "master", "br0")
            _ip("-n", lan_ns, "link", "set", peer, "up")
            _ip("-n", ns, "addr", "add", f"{net.subnet}.{i}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            net.hosts[host], net.links[host] = f"{net.subnet}.{i}", dev
        _ip("link", "add", client_link, "type", "veth", "peer", "name", f"pd{tag}bc")
        _ip("link", "set", f"pd{tag}bc", "netns", lan_ns)
        _ip("-n", lan_ns, "link", "set", f"pd{tag}bc", "master", "br0")
        _ip("-n", lan_ns, "link", "set", f"pd{tag}bc", "up")
        _ip("addr", "add", f"{net.subnet}.254/24", "dev", client_link)
        _ip("link", "set", client_link, "up")
        yield net
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", client_link)  # (its peer goes with it)
        for ns in made:
            with contextlib.suppress(subprocess.CalledProcessError):
                _ip("netns", "del", ns)
