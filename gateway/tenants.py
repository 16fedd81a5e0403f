"""Tenants: the API keys one gateway serves, each named, with its own limits and default priority.

`--api-keys-file PATH` (JSON, or TOML when the name ends in .toml, Python 3.11+) lists them:

    {"keys": [{"name": "team-a", "key": "sk-a...", "requests_per_minute": 600,
               "tokens_per_minute": 200000, "max_concurrent_requests": 16,
               "max_tokens_per_request": 1024, "priority": 0},
              {"name": "batch", "key": "sk-b...", "priority": 10}]}

Every limit is optional (absent: none). `priority` orders the gateway's admission queue (lower
first; a request's own `priority` field overrides it). `--api-key KEY` is one more tenant named
`default`, without limits. With no key at all, every request is the unlimited tenant `anonymous`.
A presented key is found by its SHA-256 (no comparison that stops at the first differing byte);
names, never keys, appear in /metrics and logs. The limits themselves: gateway/rate_limits.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from pdserve.gateway.rate_limits import TenantGate

log = logging.getLogger(__name__)

ANONYMOUS = "anonymous"  # the tenant of every request when the server has no key
DEFAULT = "default"  # the tenant of --api-key
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")


class KeysFileError(ValueError):
    """An --api-keys-file that cannot be used (unreadable, malformed, a bad or repeated entry)."""


@dataclass(frozen=True)
class TenantLimits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None  # prompt + max_tokens (per sequence) charged at admission
    max_concurrent_requests: int | None = None
    max_tokens_per_request: int | None = None  # a larger max_tokens is a 400
    priority: int = 0  # lower = more urgent (vLLM's `priority`), when the request gives none

    def __post_init__(self) -> None:
        for f in ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests", "max_tokens_per_request"):
            value = getattr(self, f)
            if value is not None and value < 1:
                raise ValueError(f"{f} must be >= 1, got {value}")

    @property
    def unlimited(self) -> bool:
        return (
            self.requests_per_minute is None and self.tokens_per_minute is None and self.max_concurrent_requests is None
        )


@dataclass(frozen=True)
class ApiKey:
    """One entry of the keys file: a tenant's name, its secret key and its limits."""

    name: str
    key: str = dataclasses.field(repr=False)
    limits: TenantLimits = TenantLimits()

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"name {self.name!r}: 1-64 letters, digits, '_', '.', ':' or '-'")
        if not self.key or self.key != self.key.strip():
            raise ValueError(f"key of {self.name!r} must be non-empty, without surrounding spaces")


_LIMIT_FIELDS = {f.name for f in dataclasses.fields(TenantLimits)}
_ENTRY_FIELDS = {"name", "key"} | _LIMIT_FIELDS


def parse_keys(document: object) -> list[ApiKey]:
    """{"keys": [entry, ...]} -> ApiKeys; KeysFileError naming the entry and field at fault."""
    if not isinstance(document, dict) or set(document) != {"keys"} or not isinstance(document["keys"], list):
        raise KeysFileError('expected one top-level "keys": a list of {"name", "key", limits...}')
    keys: list[ApiKey] = []
    for i, entry in enumerate(document["keys"]):
        where = f"keys[{i}]"
        if not isinstance(entry, dict):
            raise KeysFileError(f"{where} must be an object")
        unknown = sorted(set(entry) - _ENTRY_FIELDS)
        if unknown:
            raise KeysFileError(f"{where}: unknown field {unknown[0]!r} (known: {', '.join(sorted(_ENTRY_FIELDS))})")
        try:
            limits = msgspec.convert({k: v for k, v in entry.items() if k in _LIMIT_FIELDS}, TenantLimits)
            key = ApiKey(
                name=msgspec.convert(entry.get("name"), str), key=msgspec.convert(entry.get("key"), str), limits=limits
            )
        except (msgspec.ValidationError, ValueError) as e:
            raise KeysFileError(f"{where}: {e}") from None
        keys.append(key)
    _check_unique(keys)
    return keys


def read_keys_file(path: str | Path) -> list[ApiKey]:
    """The keys of a JSON or TOML (.toml) file; KeysFileError when unusable."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        if path.stat().st_mode & 0o077:
            log.warning("%s is readable by other users: it holds API keys (chmod 600)", path)
        document = _toml(raw) if path.suffix == ".toml" else json.loads(raw)
    except (OSError, ValueError) as e:  # (JSON's, TOML's and UTF-8's decode errors are ValueErrors)
        raise KeysFileError(f"{path}: {e}") from None
    try:
        return parse_keys(document)
    except KeysFileError as e:
        raise KeysFileError(f"{path}: {e}") from None


def _toml(raw: bytes) -> object:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        raise ValueError("a TOML keys file needs Python 3.11+ (tomllib): write it as JSON") from None
    return tomllib.loads(raw.decode())


def _check_unique(keys: Sequence[ApiKey]) -> None:
    names, secrets = set(), set()
    for k in keys:
        if k.name in names:
            raise KeysFileError(f"the name {k.name!r} is used twice")
        if k.key in secrets:
            raise KeysFileError(f"{k.name!r} has the same key as another entry")
        names.add(k.name)
        secrets.add(k.key)


def _digest(authorization: bytes) -> bytes:
    return hashlib.sha256(authorization).digest()


class TenantDirectory:
    """Bearer header -> the tenant's gate (its limits and live counts), one per key."""

    def __init__(self, keys: Sequence[ApiKey] = (), clock: Callable[[], float] = time.monotonic) -> None:
        _check_unique(keys)
        self._by_header = {_digest(f"Bearer {k.key}".encode()): TenantGate(k.name, k.limits, clock) for k in keys}
        self.anonymous = TenantGate(ANONYMOUS, TenantLimits(), clock)  # when no key is configured

    @classmethod
    def build(
        cls, api_key: str | None, keys: Sequence[ApiKey] = (), clock: Callable[[], float] = time.monotonic
    ) -> TenantDirectory:
        """The keys file's tenants, plus --api-key's as `default` (unlimited) when given."""
        if api_key:
            if any(k.name == DEFAULT for k in keys):
                raise KeysFileError(f"the name {DEFAULT!r} is --api-key's: pick another in the keys file")
            keys = [*keys, ApiKey(DEFAULT, api_key)]
        return cls(keys, clock)

    @property
    def requires_key(self) -> bool:
        return bool(self._by_header)

    def gates(self) -> list[TenantGate]:
        return [*self._by_header.values(), self.anonymous]

    def lookup(self, authorization: bytes) -> TenantGate | None:
        """The tenant whose `Bearer KEY` this Authorization header is, else None."""
        return self._by_header.get(_digest(authorization))
