"""`pdserve serve` hands its children the cluster secret the user gave (so a worker started by hand
with it may join), checks it first, and makes a fresh one only when none is given."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys

import pytest

from pdserve import env as pdserve_env
from pdserve.cli.serve import children_env

READ_SECRET = "from pdserve.protocol.auth import load_cluster_secret; print(load_cluster_secret().hex())"


@pytest.fixture
def environment(monkeypatch):
    """A clean slate: no secret, no key; pdserve's settings read again after each change."""
    for name in ("PDSERVE_CLUSTER_SECRET", "PDSERVE_CLUSTER_SECRET_FILE", "PDSERVE_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    pdserve_env.reload()

    def setenv(name: str, value: str) -> None:
        monkeypatch.setenv(name, value)
        pdserve_env.reload()

    yield setenv
    monkeypatch.undo()
    pdserve_env.reload()


def secret_a_child_reads(env: dict[str, str]) -> str:
    """The secret a child process started with `env` loads, as every role does at start."""
    return subprocess.run(
        [sys.executable, "-c", READ_SECRET], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_the_given_secret_reaches_the_children(environment):
    given = secrets.token_hex(32)
    environment("PDSERVE_CLUSTER_SECRET", given)
    env = children_env(api_key=None)
    assert env["PDSERVE_CLUSTER_SECRET"] == given
    assert secret_a_child_reads(env) == given


def test_a_secret_file_is_passed_on_as_a_file(environment, tmp_path):
    given = secrets.token_hex(32)
    path = tmp_path / "secret"
    path.write_text(given + "\n")
    environment("PDSERVE_CLUSTER_SECRET_FILE", str(path))
    env = children_env(api_key="sk-x")
    assert "PDSERVE_CLUSTER_SECRET" not in env  # the secret stays in its file
    assert env["PDSERVE_CLUSTER_SECRET_FILE"] == str(path) and env["PDSERVE_API_KEY"] == "sk-x"
    assert secret_a_child_reads(env) == given


def test_without_one_each_serve_makes_a_fresh_secret(environment):
    first, second = children_env(None), children_env(None)
    assert len(bytes.fromhex(first["PDSERVE_CLUSTER_SECRET"])) == 32
    assert first["PDSERVE_CLUSTER_SECRET"] != second["PDSERVE_CLUSTER_SECRET"]
    assert "PDSERVE_API_KEY" not in first
    assert secret_a_child_reads(first) == first["PDSERVE_CLUSTER_SECRET"]


@pytest.mark.parametrize(
    "name,value,error",
    [
        ("PDSERVE_CLUSTER_SECRET", "abcd", "at least 16 bytes"),
        ("PDSERVE_CLUSTER_SECRET", "not hex at all!", "must be hex"),
        ("PDSERVE_CLUSTER_SECRET_FILE", "/nonexistent/secret", "cannot read"),
    ],
)
def test_an_unusable_given_secret_stops_serve_before_any_child(environment, name, value, error):
    environment(name, value)
    with pytest.raises(SystemExit, match=error):
        children_env(None)


def test_serve_refuses_a_bad_keys_file_before_starting_anything(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [{"name": "a", "key": "k", "requests_per_minute": -1}]}))
    r = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "serve", "--model", str(tmp_path), "--api-keys-file", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "requests_per_minute must be >= 1" in r.stderr
