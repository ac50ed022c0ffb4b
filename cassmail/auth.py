"""Password hashing and checking, and the one session-auth path of SMTP AUTH, POP3, IMAP and
ManageSieve.

Passwords are stored only as salted scrypt hashes in a self-describing text
form, `$scrypt$ln=14,r=8,p=1$<salt>$<hash>` (base64 without padding), so the
cost can be raised later without breaking existing hashes. scrypt releases
the GIL, so checks run in threads (`verify_async`) and never stall the event
loop that serves every session.
"""

from __future__ import annotations

import asyncio
import base64
import fcntl
import hashlib
import hmac
import logging
import mmap
import os
import re
import struct
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from cassmail.config import AuthSettings, ListenerSettings

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


class FailureTable:
    """Login attempts counted per key (`peer:<address>`, `user:<key>`) over a window, in a
    fixed-size table that every worker process of a node shares: it lives in a shared mapping
    made before the workers fork, and each update holds an fcntl lock on it, which the kernel
    releases if a worker dies holding it. Memory is fixed: `capacity` slots of 24 bytes; a key
    that finds no free slot among its `PROBE` candidates takes the one counted longest ago.

    A 64-bit hash names each key; two keys sharing one would share a count (a harmless error
    towards more throttling, for one pair in ~10^19).
    """

    SLOT = struct.Struct("<QId")  # key hash (0: never used), count, start of its window (monotonic)
    PROBE = 16

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = max(capacity, self.PROBE)
        self._file = tempfile.TemporaryFile(prefix="cassmail-logins-")
        self._file.truncate(self.capacity * self.SLOT.size)
        self._map = mmap.mmap(self._file.fileno(), self.capacity * self.SLOT.size)  # MAP_SHARED: kept over fork

    @staticmethod
    def _hash(key: str) -> int:
        return int.from_bytes(hashlib.blake2b(key.encode("utf-8", "surrogateescape"), digest_size=8).digest(),
                              "little") or 1

    @contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.lockf(self._file.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.lockf(self._file.fileno(), fcntl.LOCK_UN)

    def _slot(self, key: str, now: float, window: float, insert: bool) -> tuple[int, int, float] | None:
        """(offset, live count, window start) of `key`'s slot; with `insert`, a slot for it is
        taken when it has none."""
        wanted = self._hash(key)
        first = wanted % self.capacity
        reusable: int | None = None  # a slot never used, or whose count has run out
        oldest: tuple[float, int] | None = None  # else the slot counted longest ago
        for i in range(self.PROBE):
            offset = ((first + i) % self.capacity) * self.SLOT.size
            hashed, count, since = self.SLOT.unpack_from(self._map, offset)
            live = count if now - since < window else 0
            if hashed == wanted:
                return offset, live, since if live else now
            if live == 0:
                reusable = offset if reusable is None else reusable
            elif oldest is None or since < oldest[0]:
                oldest = (since, offset)
        if not insert:
            return None
        if reusable is None:
            assert oldest is not None
            reusable = oldest[1]
        return reusable, 0, now

    def add(self, keys: Iterable[str], delta: int, window: float, now: float | None = None) -> list[int]:
        """Add `delta` to each key's count (a count never goes below 0); the counts after it."""
        now = time.monotonic() if now is None else now
        counts = []
        with self._locked():
            for key in keys:
                found = self._slot(key, now, window, insert=delta > 0)
                if found is None:
                    counts.append(0)
                    continue
                offset, count, since = found
                count = max(count + delta, 0)
                self.SLOT.pack_into(self._map, offset, self._hash(key), count, since)
                counts.append(count)
        return counts

    def count(self, key: str, window: float, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        with self._locked():
            found = self._slot(key, now, window, insert=False)
        return found[1] if found else 0

    def clear(self, key: str) -> None:
        with self._locked():
            found = self._slot(key, time.monotonic(), float("inf"), insert=False)
            if found is not None:
                self.SLOT.pack_into(self._map, found[0], self._hash(key), 0, 0.0)


#: The table every listener and worker of this node counts in, and its free attempts, once
#: `share_failures` made it (before the workers fork); without it each throttle counts alone.
_node_failures: tuple[FailureTable, int] | None = None


def share_failures(settings: AuthSettings) -> None:
    """Make the node's login-attempt table; call before forking the workers that share it."""
    global _node_failures
    _node_failures = (FailureTable(settings.throttle_entries), settings.free_attempts)


class FailureThrottle:
    """Slows down password guessing. Every attempt is counted per peer and per user when it
    starts, before its password is checked, so parallel guesses see each other: the attempts
    past the first `free` in `window` seconds wait `delay` seconds, doubling per further attempt
    up to `max_delay`. An attempt the store could not check, or whose client left while it
    waited, is taken back; a success clears the counts of its peer and user."""

    def __init__(self, delay: float, window: float = 900.0, free: int | None = None, max_delay: float = 30.0,
                 table: FailureTable | None = None) -> None:
        node_table, node_free = _node_failures or (None, 2)
        self.delay, self.window, self.max_delay = delay, window, max_delay
        self.free = node_free if free is None else free
        self.table = table or node_table or FailureTable(4096)

    @staticmethod
    def _keys(peer: str, user: str | None) -> list[str]:
        return [f"peer:{peer}"] + ([f"user:{user}"] if user else [])

    def _wait(self, before: int) -> float:
        if self.delay <= 0 or before < self.free:
            return 0.0
        return min(self.delay * 2 ** min(before - self.free, 32), self.max_delay)

    def attempt(self, peer: str, user: str | None, now: float | None = None) -> float:
        """Count an attempt starting now; the seconds to wait before checking it."""
        counts = self.table.add(self._keys(peer, user), 1, self.window, now)
        return self._wait(max(counts) - 1)

    def penalty(self, peer: str, user: str | None, now: float | None = None) -> float:
        """The wait the next attempt would get (nothing counted)."""
        return self._wait(max(self.table.count(key, self.window, now) for key in self._keys(peer, user)))

    def taken_back(self, peer: str, user: str | None) -> None:
        """An attempt that was not a wrong password (the store failed, the client left)."""
        self.table.add(self._keys(peer, user), -1, self.window)

    def succeeded(self, peer: str, user: str) -> None:
        """A right password clears both counts, as Dovecot's penalty does: the users behind one
        address (a NAT, a webmail) are not held back by one of them mistyping. Guessing at one
        account stays bounded by that account's count, which only its own success clears."""
        self.table.clear(f"peer:{peer}")
        self.table.clear(f"user:{user}")


# --------------------------------------------------------------------------- the session-auth path


def decode_base64(response: bytes) -> bytes | None:
    """A SASL response's bytes from its strict base64 (RFC 4422 3.3), or None when it is not
    base64 (only the alphabet and padding, nothing around them)."""
    try:
        return base64.b64decode(response, validate=True)
    except ValueError:  # binascii.Error is a ValueError
        return None


def split_plain(message: bytes) -> tuple[bytes, bytes] | None:
    """(authentication id, password) of a decoded SASL PLAIN message (RFC 4616:
    `authzid NUL authcid NUL password`; the authorization id is not used), or None when it has
    not exactly those three parts."""
    try:
        _authz, login, password = message.split(b"\0")
    except ValueError:
        return None
    return login, password


def decode_plain(response: bytes) -> tuple[str, str] | None:
    """SASL PLAIN: (authentication id, password) from the client's base64 response, or None when
    it is not valid base64 of `authzid NUL authcid NUL password`."""
    message = decode_base64(response.strip())
    credentials = split_plain(message) if message is not None else None
    if credentials is None:
        return None
    login, password = credentials
    return login.decode("utf-8", "replace"), password.decode("utf-8", "replace")


def cancelled(response: bytes) -> bool:
    """Whether a SASL response is the client's `*`, which cancels the exchange (RFC 4422 3.5)."""
    return response.strip() == b"*"


def drop_clear_text(pending: bytearray, listener: str, peer: str) -> int:
    """After STARTTLS (STLS): what the client sent behind the command before the handshake came
    in clear text, where anyone on the path could have put it (a login, say); it must not run as
    if it came over TLS (RFC 3207 4.2, RFC 2595 3.1, the command injection of CVE-2011-0411), so
    it is thrown away and logged (`event=<listener>-starttls`). The bytes dropped."""
    from cassmail.logs import kv

    dropped = len(pending)
    pending.clear()
    if dropped:
        _log.warning(kv(f"{listener}-starttls", peer=peer, dropped_bytes=dropped))
    return dropped


@dataclass(slots=True)
class Failures:
    """One session's wrong passwords: at its listener's `max_auth_failures`th the session is
    closed, in the protocol's own words."""

    limit: int
    count: int = 0

    def add(self) -> bool:
        """Count a wrong password; True when the session must now be closed."""
        self.count += 1
        return self.count >= self.limit


#: How often a delayed login looks whether its client is still there.
GONE_POLL = 0.25


class Logins:
    """Password logins of one listener in one worker: the clear-text policy, the address parsed
    to a user key, the failure throttle, the check against the store, one `auth` log event per
    attempt, and each session's count of failures (`failures`)."""

    def __init__(self, listener: str, settings: ListenerSettings) -> None:
        self.listener = listener
        self.throttle = FailureThrottle(settings.auth_failure_delay)
        self.max_failures = settings.max_auth_failures
        self.allow_plaintext = settings.allow_plaintext_auth

    def plaintext_ok(self, secure: bool) -> bool:
        """Whether a password may be sent on this session: over TLS always, in clear text only
        where the listener's `allow_plaintext_auth` says so."""
        return secure or self.allow_plaintext

    def failures(self) -> Failures:
        """A new session's count of wrong passwords."""
        return Failures(self.max_failures)

    async def check(self, store: Any, peer: str, login: str, password: str,
                    gone: Callable[[], bool] = lambda: False) -> str | None:
        """The user key when the password is right, else None (after the throttle's delay).
        A StoreError propagates (logged as tempfail): the store failed, not the client, and the
        attempt is not held against it; nor is one whose client is `gone` during the delay (it
        is not checked: nobody would hear the answer)."""
        from cassmail.logs import kv
        from cassmail.model import Address, InvalidInput
        from cassmail.store.base import StoreError

        started = time.monotonic()
        try:
            user: str | None = Address.parse(login).key
        except InvalidInput:
            user = None
        result, error = "tempfail", None
        delay = self.throttle.attempt(peer, user)
        try:
            deadline = time.monotonic() + delay
            while time.monotonic() < deadline and not gone():
                await asyncio.sleep(min(GONE_POLL, deadline - time.monotonic()))
            if gone():
                result = "gone"
                return None
            ok = await check_password(store, user, password)
            result = "ok" if ok and user is not None else "fail"
        except StoreError as exc:
            error = exc
            raise
        finally:
            if result == "ok" and user is not None:
                self.throttle.succeeded(peer, user)
            elif result != "fail":  # the store failed, or the session ended while it waited
                self.throttle.taken_back(peer, user)
            fields = {"listener": self.listener, "peer": peer, "user": user, "result": result,
                      "ms": int((time.monotonic() - started) * 1000)}
            if error is not None:
                _log.warning(kv("auth", **fields, error=error))
            else:
                _log.info(kv("auth", **fields))
        return user if result == "ok" else None
