"""HTTPS on the gateway: uvicorn serves TLS with the user's certificate and key (PEM)."""

from __future__ import annotations

import ssl


def check_tls_files(certfile: str | None, keyfile: str | None) -> None:
    """Both files or neither, readable and a valid pair: fails at start, not at the first client."""
    if (certfile is None) != (keyfile is None):
        raise SystemExit("pdserve: --ssl-certfile and --ssl-keyfile go together")
    if certfile is None:
        return
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as e:
        raise SystemExit(f"pdserve: --ssl-certfile/--ssl-keyfile: {e}") from None
