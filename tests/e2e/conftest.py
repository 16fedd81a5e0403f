"""Servers the end-to-end tests share: a `pdserve serve` takes several seconds to start (each of
its processes imports torch), and several tests only send one of the two plain configurations
requests and check the answers. Each is started by the first test that asks for it and stopped
after the package's last test.

A test may use one only if it leaves the server as it found it: no worker killed, drained or
stalled, no setting changed, and every counter it checks read as a difference from before its
own requests (tests.e2e.metrics_delta); its prompts are its own (random, seeded), so another
test's prefix-cache entries cannot answer them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from tests.e2e.cluster import running_server

# serve's flags (beyond running_server's own) -> the fixture sharing that server
SHARED = {(): "shared_1p1d", ("--colocated",): "shared_colocated"}


@pytest.fixture(scope="package")
def shared_1p1d(tiny_llama) -> Iterator[str]:
    """`serve` as running_server starts it on tiny_llama: 1 prefill + 1 decode worker."""
    with running_server(tiny_llama) as base:
        yield base


@pytest.fixture(scope="package")
def shared_colocated(tiny_llama) -> Iterator[str]:
    """`serve --colocated` on tiny_llama."""
    with running_server(tiny_llama, "--colocated") as base:
        yield base


@contextlib.contextmanager
def tiny_llama_server(request: pytest.FixtureRequest, *flags: str) -> Iterator[str]:
    """A tiny_llama server with these flags: the shared one when there is one, else the test's own."""
    name = SHARED.get(tuple(flags))
    if name is not None:
        yield request.getfixturevalue(name)
        return
    with running_server(request.getfixturevalue("tiny_llama"), *flags) as base:
        yield base
