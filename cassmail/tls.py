"""TLS server contexts shared by every listener (STARTTLS, STLS and implicit TLS)."""

from __future__ import annotations

import ssl

from cassmail.config import ListenerSettings


class TLSConfigError(ValueError):
    """A certificate or key that cannot be loaded; the message names the files."""


def server_context(settings: ListenerSettings) -> ssl.SSLContext | None:
    """A TLS 1.2+ server context for a listener, or None when it has no certificate."""
    if not settings.tls_cert:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        context.load_cert_chain(settings.tls_cert, settings.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise TLSConfigError(f"cannot load TLS certificate {settings.tls_cert} / key {settings.tls_key}: {exc}") from exc
    return context


def describe(ssl_object: ssl.SSLObject | ssl.SSLSocket | None) -> str | None:
    """"TLSv1.3 with cipher X" for trace headers and logs, or None for a clear-text session."""
    if ssl_object is None:
        return None
    cipher = ssl_object.cipher()
    return f"{ssl_object.version()} with cipher {cipher[0] if cipher else 'unknown'}"
