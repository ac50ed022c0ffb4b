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
import logging
import os
import re
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from cassmail.config import AuthSettings

_log = logging.getLogger("cassmail.auth")

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


_dummy_hash: str | None = None


async def check_password(store: Any, user: str | None, password: str) -> bool:
    """True when `user` exists in the store and the password matches its hash.

    An unknown (or unparsable, None) user costs the same hash check as a wrong password, so
    timing does not tell which it was. A StoreError from the store propagates: it is a
    temporary failure, not a wrong password.
    """
    global _dummy_hash
    if _dummy_hash is None:
        _dummy_hash = hash_password(os.urandom(8).hex())
    stored = _dummy_hash
    if user is not None:
        from cassmail.store.base import NoSuchUser

        try:
            stored = await store.get_password_hash(user)
        except NoSuchUser:
            pass
    matches = await verify_async(password or "-", stored)
    return matches and stored is not _dummy_hash


def hash_many(passwords: Iterable[str], params: HashParams = HashParams(), workers: int | None = None) -> list[str]:
    """Hash many passwords on every core (bulk import)."""
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        return list(pool.map(lambda pw: hash_password(pw, params), passwords))


class FailureThrottle:
    """Slows down password guessing: failed logins are counted per peer and per user (in this
    process, over `window` seconds) and each answer after the first few failures waits
    `delay` seconds, doubling per further failure up to `max_delay`.

    Memory is bounded: entries older than the window go, and at most `max_entries` are kept.
    """

    def __init__(self, delay: float, window: float = 900.0, free: int = 2, max_delay: float = 30.0,
                 max_entries: int = 100_000) -> None:
        self.delay, self.window, self.free, self.max_delay = delay, window, free, max_delay
        self.max_entries = max_entries
        self._failures: dict[str, tuple[int, float]] = {}

    def _count(self, key: str, now: float) -> int:
        count, since = self._failures.get(key, (0, now))
        return count if now - since < self.window else 0

    def penalty(self, peer: str, user: str | None, now: float | None = None) -> float:
        """Seconds to wait before answering this login attempt."""
        now = time.monotonic() if now is None else now
        worst = max(self._count(f"peer:{peer}", now), self._count(f"user:{user}", now) if user else 0)
        if self.delay <= 0 or worst < self.free:
            return 0.0
        return min(self.delay * 2 ** (worst - self.free), self.max_delay)

    def failed(self, peer: str, user: str | None, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for key in (f"peer:{peer}", f"user:{user}" if user else None):
            if key is None:
                continue
            count = self._count(key, now)
            self._failures[key] = (count + 1, self._failures.get(key, (0, now))[1] if count else now)
        if len(self._failures) > self.max_entries:
            expired = [k for k, (_, since) in self._failures.items() if now - since >= self.window]
            for key in expired or list(self._failures)[: len(self._failures) // 2]:
                del self._failures[key]

    def succeeded(self, user: str) -> None:
        self._failures.pop(f"user:{user}", None)


# --------------------------------------------------------------------------- the session-auth path


def decode_plain(response: bytes) -> tuple[str, str] | None:
    """SASL PLAIN (RFC 4616): (authentication id, password) from the client's base64 response,
    or None when it is not valid base64 of `authzid NUL authcid NUL password`."""
    try:
        _authz, login, password = base64.b64decode(response.strip(), validate=True).split(b"\0")
    except (ValueError, TypeError):  # binascii.Error is a ValueError
        return None
    return login.decode("utf-8", "replace"), password.decode("utf-8", "replace")


class Logins:
    """Password logins of one listener in one worker: the address parsed to a user key, the
    failure throttle, the check against the store, and one `auth` log event per attempt."""

    def __init__(self, listener: str, delay: float) -> None:
        self.listener = listener
        self.throttle = FailureThrottle(delay)

    async def check(self, store: Any, peer: str, login: str, password: str) -> str | None:
        """The user key when the password is right, else None (after the throttle's delay).
        A StoreError propagates (logged as tempfail): the store failed, not the client."""
        from cassmail.logs import kv
        from cassmail.model import Address, InvalidInput

        started = time.monotonic()
        try:
            user: str | None = Address.parse(login).key
        except InvalidInput:
            user = None
        result = "tempfail"
        try:
            delay = self.throttle.penalty(peer, user)
            if delay:
                await asyncio.sleep(delay)
            ok = await check_password(store, user, password)
            result = "ok" if ok else "fail"
        finally:
            _log.info(kv("auth", listener=self.listener, peer=peer, user=user, result=result,
                         ms=int((time.monotonic() - started) * 1000)))
        if ok and user is not None:
            self.throttle.succeeded(user)
            return user
        self.throttle.failed(peer, user)
        return None
