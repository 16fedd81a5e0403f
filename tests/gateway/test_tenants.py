"""The keys file (JSON and TOML) and finding a tenant by its bearer header."""

from __future__ import annotations

import json

import pytest

from pdserve.gateway.tenants import (
    ANONYMOUS,
    DEFAULT,
    ApiKey,
    KeysFileError,
    TenantDirectory,
    TenantLimits,
    read_keys_file,
)

KEYS = {
    "keys": [
        {
            "name": "team-a",
            "key": "sk-aaaa",
            "requests_per_minute": 60,
            "tokens_per_minute": 1000,
            "max_concurrent_requests": 4,
            "max_tokens_per_request": 256,
            "priority": 1,
        },
        {"name": "batch", "key": "sk-bbbb", "priority": 10},
    ]
}

TOML = """
[[keys]]
name = "team-a"
key = "sk-aaaa"
requests_per_minute = 60
tokens_per_minute = 1000
max_concurrent_requests = 4
max_tokens_per_request = 256
priority = 1

[[keys]]
name = "batch"
key = "sk-bbbb"
priority = 10
"""


@pytest.mark.parametrize("suffix,text", [(".json", json.dumps(KEYS)), (".toml", TOML)])
def test_json_and_toml_files_read_the_same(tmp_path, suffix, text):
    path = tmp_path / f"keys{suffix}"
    path.write_text(text)
    path.chmod(0o600)
    a, b = read_keys_file(path)
    assert (a.name, a.key, b.name, b.key) == ("team-a", "sk-aaaa", "batch", "sk-bbbb")
    assert a.limits == TenantLimits(60, 1000, 4, 256, priority=1)
    assert b.limits == TenantLimits(priority=10)
    assert "sk-aaaa" not in repr(a)  # a key never lands in a log line by accident


@pytest.mark.parametrize(
    "entry,error",
    [
        ({"name": "a", "key": "k", "requests_per_minte": 5}, "unknown field 'requests_per_minte'"),
        ({"name": "a", "key": "k", "requests_per_minute": 0}, "requests_per_minute must be >= 1"),
        ({"name": "a", "key": "k", "tokens_per_minute": "many"}, r"Expected `int \| null`, got `str`"),
        ({"name": "a", "key": "k", "priority": True}, "Expected `int`, got `bool`"),
        ({"name": "a b", "key": "k"}, "name 'a b'"),
        ({"name": "a"}, "Expected `str`, got `null`"),
        ({"name": "a", "key": " k"}, "without surrounding spaces"),
    ],
)
def test_bad_entries_are_refused_naming_the_entry(tmp_path, entry, error):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [{"name": "ok", "key": "fine"}, entry]}))
    with pytest.raises(KeysFileError, match=rf"keys\[1\]: .*{error}"):
        read_keys_file(path)


def test_repeated_names_or_keys_and_bad_documents_are_refused(tmp_path):
    path = tmp_path / "keys.json"
    for document, error in [
        ({"keys": [{"name": "a", "key": "k1"}, {"name": "a", "key": "k2"}]}, "'a' is used twice"),
        ({"keys": [{"name": "a", "key": "k1"}, {"name": "b", "key": "k1"}]}, "same key"),
        ([{"name": "a", "key": "k"}], 'top-level "keys"'),
    ]:
        path.write_text(json.dumps(document))
        with pytest.raises(KeysFileError, match=error):
            read_keys_file(path)
    path.write_text("{not json")
    with pytest.raises(KeysFileError, match="keys.json"):
        read_keys_file(path)
    with pytest.raises(KeysFileError, match="No such file"):
        read_keys_file(tmp_path / "missing.json")


def test_lookup_by_bearer_header_and_api_key_as_default(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(KEYS))
    tenants = TenantDirectory.build("sk-single", read_keys_file(path))
    assert tenants.requires_key
    assert tenants.lookup(b"Bearer sk-aaaa").name == "team-a"
    assert tenants.lookup(b"Bearer sk-single").name == DEFAULT
    assert tenants.lookup(b"Bearer sk-single").limits == TenantLimits()
    for wrong in (b"", b"sk-aaaa", b"Bearer sk-aaa", b"Bearer sk-aaaab", b"bearer sk-aaaa"):
        assert tenants.lookup(wrong) is None
    assert not TenantDirectory.build(None).requires_key
    assert TenantDirectory.build(None).anonymous.name == ANONYMOUS
    with pytest.raises(KeysFileError, match="--api-key's"):
        TenantDirectory.build("sk-x", [ApiKey(DEFAULT, "sk-other")])
