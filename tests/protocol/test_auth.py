"""Frame authentication: what is signed verifies, anything altered does not."""

from __future__ import annotations

import pytest

from pdserve.env import reload as reload_env
from pdserve.protocol.auth import (
    MAC_SIZE,
    AuthError,
    ClusterSecretError,
    FrameAuth,
    generate_cluster_secret,
    load_cluster_secret,
)

SECRET = bytes(range(32))


def test_sign_verify_roundtrip_with_payloads():
    auth = FrameAuth(SECRET)
    payloads = [b"\x00" * 100, bytearray(b"abc"), memoryview(b"")]
    frames = auth.sign(b"header", payloads)
    assert len(frames) == 5 and len(frames[0]) == MAC_SIZE and frames[1] == b"header"
    assert frames[2] is payloads[0]  # passed through for zero-copy sends
    header, got = auth.verify(frames)
    assert header == b"header"
    assert [bytes(p) for p in got] == [bytes(p) for p in payloads]


def test_flip_any_header_byte_is_rejected():
    auth = FrameAuth(SECRET)
    frames = auth.sign(b"some msgpack header", [b"payload"])
    for i in range(len(frames[1])):
        bad = bytearray(frames[1])
        bad[i] ^= 0x01
        with pytest.raises(AuthError):
            auth.verify([frames[0], bytes(bad), frames[2]])


def test_wrong_secret_missing_mac_and_frame_count_changes_are_rejected():
    auth = FrameAuth(SECRET)
    mac, header, payload = auth.sign(b"hdr", [b"x" * 10])
    with pytest.raises(AuthError):
        FrameAuth(b"\xff" * 32).verify([mac, header, payload])
    with pytest.raises(AuthError):
        auth.verify([header, payload])  # mac missing: header taken as mac (wrong size)
    with pytest.raises(AuthError):
        auth.verify([header])
    with pytest.raises(AuthError):
        auth.verify([])
    with pytest.raises(AuthError):
        auth.verify([mac, header, payload, b"extra"])  # extra frame
    with pytest.raises(AuthError):
        auth.verify([mac, header])  # payload removed
    with pytest.raises(AuthError):
        auth.verify([mac, header, b"x" * 11])  # payload resized
    with pytest.raises(AuthError):
        auth.verify([b"\x00" * MAC_SIZE, header, payload])  # forged mac


def test_frames_cannot_be_merged_or_split():
    auth = FrameAuth(SECRET)
    mac, header, payload = auth.sign(b"hdr", [b"\x05" + b"\x00" * 7])
    with pytest.raises(AuthError):
        auth.verify([mac, header + payload])
    mac2, header2 = auth.sign(b"hdr\x05\x00\x00\x00\x00\x00\x00\x00")
    with pytest.raises(AuthError):
        auth.verify([mac2, b"hdr", b"\x05" + b"\x00" * 7])


def test_payload_bytes_are_covered_only_with_digest_payloads():
    fast, strict = FrameAuth(SECRET), FrameAuth(SECRET, digest_payloads=True)
    mac, header, payload = fast.sign(b"hdr", [b"a" * 64])
    fast.verify([mac, header, b"b" * 64])  # same length: not detected by design (documented)
    mac, header, payload = strict.sign(b"hdr", [b"a" * 64])
    strict.verify([mac, header, payload])
    with pytest.raises(AuthError):
        strict.verify([mac, header, b"b" * 64])
    with pytest.raises(AuthError):  # modes never accept each other's messages
        fast.verify([mac, header, payload])


def test_secret_rules(monkeypatch, tmp_path):
    assert len(generate_cluster_secret()) == 32 and generate_cluster_secret() != generate_cluster_secret()
    with pytest.raises(ValueError):
        FrameAuth(b"short")
    assert SECRET.hex() not in repr(FrameAuth(SECRET)) and str(SECRET) not in repr(FrameAuth(SECRET))

    monkeypatch.delenv("PDSERVE_CLUSTER_SECRET", raising=False)
    monkeypatch.delenv("PDSERVE_CLUSTER_SECRET_FILE", raising=False)
    reload_env()
    with pytest.raises(ClusterSecretError, match="PDSERVE_CLUSTER_SECRET"):
        load_cluster_secret()
    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET", SECRET.hex())
    reload_env()
    assert load_cluster_secret() == SECRET
    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET", "not hex!")
    reload_env()
    with pytest.raises(ClusterSecretError, match="hex"):
        load_cluster_secret()
    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET", "abcd")
    reload_env()
    with pytest.raises(ClusterSecretError, match="at least"):
        load_cluster_secret()
    monkeypatch.delenv("PDSERVE_CLUSTER_SECRET")
    reload_env()
    f = tmp_path / "secret"
    f.write_text(SECRET.hex() + "\n")
    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET_FILE", str(f))
    reload_env()
    assert load_cluster_secret() == SECRET
    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET_FILE", str(tmp_path / "missing"))
    reload_env()
    with pytest.raises(ClusterSecretError, match="cannot read"):
        load_cluster_secret()
