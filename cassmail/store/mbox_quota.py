"""Storage quotas of the mbox store (Store.set_quota), mixed into MboxStore.

Per user, beside account.json::

    quota.json    {"limit": bytes}: the limit (none without the file), written atomically
    quota.lock    OFD lock: a delivery to a user with a limit checks and writes under it
    usage.json    a cache of each mailbox's usage, never trusted beyond what it can prove

Usage is not a counter that a crash could leave wrong: each mailbox's index knows the bytes
and number of its live messages (MailboxFile.usage, kept as records are applied), and
usage.json keeps, per mailbox, those totals with the identity of the index file they were read
from (inode, size, mtime). Every change to a mailbox appends to its index or replaces it, so a
mailbox whose index still has that identity still has those totals; any other is read again
from its index (in memory when the mailbox is open in this process, one catch-up read of the
log otherwise). A check thus costs one directory listing, one stat per mailbox, the cache file
and the totals of the mailboxes that changed since (a delivery's own INBOX, mostly): never a
walk of every index. A missing, torn or damaged cache (it is written without fsync) fails its
checksum or does not parse, and is rebuilt from the indexes.

A delivery to users with a limit takes their quota locks (sorted) before any mailbox lock and
holds them until its copies are written, so two deliveries in any processes on one machine
never both pass the check: the limit is never overshot (quota_exact). Lock order: quota locks,
then mailbox locks, then the user lock (an index rebuild's UIDVALIDITY); nothing that holds a
mailbox or user lock takes a quota lock. Deletions take no quota lock: they only make room, and
a check that runs beside one counts the room as taken, which refuses at worst one message that
would have fitted a moment later.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from cassmail.model import address_key
from cassmail.store import mbox_fs
from cassmail.store.base import (
    NoSuchMailbox,
    Quota,
    QuotaExceeded,
    Store,
    Target,
    check_quota_limit,
    encode_name,
    quota_needs,
    stored_quota_limit,
)

QUOTA_FILE = "quota.json"
USAGE_FILE = "usage.json"
QUOTA_LOCK = "quota.lock"


class MboxQuota(Store):
    """Mixed into MboxStore: its users, mailboxes, locks and thread calls are used here."""

    quota_exact = True
    settings: Any
    _call: Any
    _existing_user: Callable[[str], Path]
    _user_lock: Callable[[str], Any]
    _file_lock: Callable[[Path], Any]
    _names: Callable[[Path], list[str]]
    _mailbox_dir: Callable[[Path, str], Path]
    _with_mailbox: Callable[..., Any]

    # ----------------------------------------------------------------- the contract

    async def set_quota(self, user: str, limit: int | None) -> None:
        key, limit = address_key(user), check_quota_limit(limit)

        def write() -> None:
            user_dir = self._existing_user(key)
            with self._user_lock(key):
                path = user_dir / QUOTA_FILE
                if limit is None:
                    path.unlink(missing_ok=True)
                    if self.settings.fsync:
                        mbox_fs.fsync_dir(user_dir)
                else:
                    mbox_fs.write_json(path, {"limit": limit}, self.settings.fsync)

        await self._call(write)

    async def get_quota(self, user: str) -> Quota:
        key = address_key(user)

        def read() -> Quota:
            limit = self._limit(key)
            used, messages = self._usage(key)
            return Quota(limit, used, messages)

        return await self._call(read)

    async def quota_limit(self, user: str) -> int | None:
        key = address_key(user)
        return await self._call(self._limit, key)

    async def quota_allows(self, user: str, size: int) -> bool | None:
        key = address_key(user)

        def check() -> bool:
            limit = self._limit(key)
            return limit is None or self._usage(key)[0] + size <= limit

        return await self._call(check)

    async def recount_quota(self, user: str) -> Quota:
        key = address_key(user)

        def recount() -> Quota:
            user_dir = self._existing_user(key)
            with self._file_lock(user_dir / QUOTA_LOCK):
                (user_dir / USAGE_FILE).unlink(missing_ok=True)
                used, messages = self._usage(key)
            return Quota(self._limit(key), used, messages)

        return await self._call(recount)

    # ----------------------------------------------------------------- delivery (in a thread)

    def _limits(self, keys: set[str]) -> dict[str, int]:
        """The users among `keys` that have a limit, with it."""
        found = {}
        for key in keys:
            limit = self._limit(key)
            if limit is not None:
                found[key] = limit
        return found

    def _deliver_within_quota(
        self, size: int, unique: Mapping[tuple[str, str], Target], limits: Mapping[str, int],
        write: Callable[[tuple[str, str]], None], undo: Callable[[tuple[str, str]], None],
    ) -> None:
        """Under the quota locks of the users in `limits`: check each one's usage plus what this
        delivery gives them, then `write` every target (all or none: `undo` what was written
        when one fails). QuotaExceeded before anything is written."""
        with ExitStack() as locks:
            for key in sorted(limits):
                locks.enter_context(self._file_lock(self._existing_user(key) / QUOTA_LOCK))
            needs = quota_needs(unique, size)
            over = [key for key, limit in limits.items() if self._usage(key)[0] + needs[key] > limit]
            if over:
                raise QuotaExceeded(over)
            done: list[tuple[str, str]] = []
            try:
                for k in unique:
                    write(k)
                    done.append(k)
            except BaseException:
                for k in done:  # best effort: a failed delivery shows no copy (the sender retries)
                    try:
                        undo(k)
                    except Exception:  # noqa: BLE001 - the first failure is the one to report
                        pass
                raise

    # ----------------------------------------------------------------- limit and usage

    def _limit(self, key: str) -> int | None:
        path = self._existing_user(key) / QUOTA_FILE
        try:
            value = mbox_fs.read_json(path)["limit"]
        except FileNotFoundError:
            return None
        return stored_quota_limit(value, str(path))

    def _usage(self, key: str) -> tuple[int, int]:
        """(bytes, messages) of the user's mailboxes: each from the cache while its index file is
        the one the cache saw, else from the index; the cache rewritten when it changed."""
        user_dir = self._existing_user(key)
        cached = _read_cache(user_dir / USAGE_FILE)
        fresh: dict[str, list[int]] = {}
        for name in self._names(user_dir):
            enc = encode_name(name)
            try:
                st = os.stat(self._mailbox_dir(user_dir, name) / "index")
                stamp = [st.st_ino, st.st_size, st.st_mtime_ns]
            except FileNotFoundError:
                stamp = []  # lost (the mailbox rebuilds it) or the mailbox is gone (skipped below)
            entry = cached.get(enc)
            if entry is None or entry[:3] != stamp:
                try:
                    used, count, stamp = self._with_mailbox(key, name, lambda mf: mf.usage())
                except NoSuchMailbox:
                    continue
                entry = [*stamp, used, count]
            fresh[enc] = entry
        if fresh != cached:
            _write_cache(user_dir / USAGE_FILE, fresh)
        return sum(e[3] for e in fresh.values()), sum(e[4] for e in fresh.values())


def _checksum(boxes: Mapping[str, list[int]]) -> int:
    return zlib.crc32(json.dumps(boxes, sort_keys=True).encode())


def _read_cache(path: Path) -> dict[str, list[int]]:
    """The cache's entries; {} when it is missing or anything about it is wrong (it is rebuilt)."""
    try:
        data = mbox_fs.read_json(path)
    except (OSError, ValueError):
        return {}
    boxes = data.get("boxes") if isinstance(data, dict) else None
    if not isinstance(boxes, dict) or data.get("check") != _checksum(boxes):
        return {}
    for entry in boxes.values():
        if not isinstance(entry, list) or len(entry) != 5 or not all(type(v) is int and v >= 0 for v in entry):
            return {}
    return boxes


def _write_cache(path: Path, boxes: dict[str, list[int]]) -> None:
    """Replace the cache (no fsync: a cache lost in a crash is rebuilt); a failure only costs
    the next check the indexes it would have saved."""
    try:
        mbox_fs.write_json(path, {"boxes": boxes, "check": _checksum(boxes)}, durable=False)
    except OSError:
        pass

