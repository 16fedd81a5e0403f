"""The gateway's tests take production's path: the backend interface is the one call production
makes (`open` onto an OutputStream), and each option has one default, whoever is built from it."""

from __future__ import annotations

import dataclasses
import inspect

from pdserve.gateway.backend import Backend
from pdserve.gateway.cluster_backend import ClusterBackend
from pdserve.gateway.limits import GatewayLimits
from pdserve.gateway.options import GatewayOptions
from pdserve.gateway.router import Router
from tests.gateway.stub_backend import StubBackend


def test_the_backend_interface_is_open_and_the_stub_implements_it():
    assert not hasattr(Backend, "generate")
    assert "open" in Backend.__abstractmethods__
    assert StubBackend.open is not Backend.open


def test_cluster_backend_defaults_are_the_gateway_options_defaults():
    options = {f.name: f.default for f in dataclasses.fields(GatewayOptions)}
    params = inspect.signature(ClusterBackend.__init__).parameters
    shared = [name for name in params if name in options]
    assert {"kv_transport", "on_decode_failure", "stuck_after_s", "router", "prefill_placement"} <= set(shared)
    for name in shared:
        assert params[name].default == options[name], name
    limits = GatewayLimits()
    assert (options["request_timeout_s"], options["stream_write_timeout_s"]) == (
        limits.request_timeout_s,
        limits.stream_write_timeout_s,
    )
    router = inspect.signature(Router.__init__).parameters
    assert router["policy"].default == options["router"]
    assert router["placement"].default == options["prefill_placement"]
