"""Password hashing and checking, shared by SMTP AUTH, POP3 and IMAP.

Passwords are stored only as salted scrypt hashes in a self-describing text
form, `$scrypt$ln=14,r=8,p=1$<salt>$<hash>` (base64 without padding), so the
cost can be raised later without breaking existing hashes. scrypt releases
the GIL, so checks run in threads (`verify_async`) and never stall the event
loop that serves every session.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import os
import re
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from cassmail.config import AuthSettings

_FORMAT = re.compile(r"\$scrypt\$ln=(\d{1,2}),r=(\d{1,3}),p=(\d{1,3})\$([A-Za-z0-9+/]+)\$([A-Za-z0-9+/]+)\Z")
SALT_BYTES = 16
KEY_BYTES = 32
MAX_PASSWORD_BYTES = 1024


class InvalidHash(ValueError):
    """A stored hash is not in a format cassmail knows."""


@dataclass(frozen=True, slots=True)
class HashParams:
    log2_n: int = 14
    r: int = 8
    p: int = 1

    @classmethod
    def from_settings(cls, settings: AuthSettings) -> HashParams:
        return cls(settings.scrypt_n.bit_length() - 1, settings.scrypt_r, settings.scrypt_p)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii").rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text + "=" * (-len(text) % 4))


def _derive(password: str, salt: bytes, params: HashParams) -> bytes:
    secret = password.encode("utf-8")
    if len(secret) > MAX_PASSWORD_BYTES:
        raise ValueError(f"password longer than {MAX_PASSWORD_BYTES} bytes")
    n = 1 << params.log2_n
    return hashlib.scrypt(
        secret, salt=salt, n=n, r=params.r, p=params.p, maxmem=256 * n * params.r * params.p, dklen=KEY_BYTES
    )


def hash_password(password: str, params: HashParams = HashParams()) -> str:
    if not isinstance(password, str) or not password:
        raise ValueError("password must be a non-empty string")
    salt = os.urandom(SALT_BYTES)
    key = _derive(password, salt, params)
    return f"$scrypt$ln={params.log2_n},r={params.r},p={params.p}${_b64(salt)}${_b64(key)}"


def is_hash(text: str) -> bool:
    return bool(_FORMAT.match(text))


def _parse(stored: str) -> tuple[HashParams, bytes, bytes]:
    match = _FORMAT.match(stored)
    if not match:
        raise InvalidHash("stored password is not a $scrypt$ hash")
    ln, r, p, salt, key = match.groups()
    params = HashParams(int(ln), int(r), int(p))
    if not 10 <= params.log2_n <= 24:
        raise InvalidHash("scrypt cost out of range")
    return params, _unb64(salt), _unb64(key)


def verify_password(password: str, stored: str) -> bool:
    """True when the password matches; comparison in constant time. False for any malformed input."""
    if not isinstance(password, str) or not password or len(password.encode("utf-8", "replace")) > MAX_PASSWORD_BYTES:
        return False
    try:
        params, salt, key = _parse(stored)
    except (InvalidHash, ValueError):
        return False
    return hmac.compare_digest(_derive(password, salt, params), key)


async def verify_async(password: str, stored: str) -> bool:
    """verify_password off the event loop."""
    return await asyncio.to_thread(verify_password, password, stored)


def needs_rehash(stored: str, params: HashParams) -> bool:
    """True when a hash was made with other parameters than the configured ones."""
    try:
        return _parse(stored)[0] != params
    except InvalidHash:
        return True


def hash_many(passwords: Iterable[str], params: HashParams = HashParams(), workers: int | None = None) -> list[str]:
    """Hash many passwords on every core (bulk import)."""
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        return list(pool.map(lambda pw: hash_password(pw, params), passwords))
