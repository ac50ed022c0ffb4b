"""Storage quotas of the WheelFS store (Store.set_quota), mixed into WheelFSStore.

The limit is a small file beside the account in the user's strong directory
(`users/.../<user>/quota`, {"limit": bytes}; no file, no limit), replaced atomically. Usage is
not kept anywhere: with no lock service, a shared counter file could not be updated by two
nodes at once without losing one of the updates. It is counted when it is needed, from what a
listing reads anyway: each mailbox's markers (whose names carry the sizes) less its tombstones,
two or three `readdir` per mailbox and no message file opened. So it never drifts, but a check
costs a walk of the user's mailboxes: only deliveries to users with a limit pay it, and
`quota_allows` (the SMTP RCPT check) answers None for them, leaving the decision to the delivery
after DATA. Deliveries on any nodes in flight at once each count the others' copies only if
their markers were already written: the limit can be passed by at most the sizes of the
deliveries in flight together (`quota_exact` is False).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any

from cassmail.model import address_key
from cassmail.store.base import (
    Quota,
    QuotaExceeded,
    Store,
    Target,
    check_quota_limit,
    quota_needs,
    stored_quota_limit,
)

QUOTA_FILE = "quota"


class WheelFSQuota(Store):
    """Mixed into WheelFSStore: its file system, layout, mailbox records and listings are used here."""

    fs: Any
    layout: Any
    settings: Any
    _call: Any
    _require_user: Callable[[str], str]
    _user_file: Callable[[str], str]
    _boxes: Callable[[str], dict[str, dict[str, Any]]]
    _messages: Callable[..., dict[str, Any]]
    _cache: Callable[[str], Any]

    async def set_quota(self, user: str, limit: int | None) -> None:
        key, limit = address_key(user), check_quota_limit(limit)

        def write() -> None:
            path = os.path.join(self._require_user(key), QUOTA_FILE)
            if limit is None:
                self.fs.unlink(path, missing_ok=True)
            else:
                self.fs.replace_file(path, json.dumps({"limit": limit}).encode() + b"\n", self.settings.fsync)

        await self._call(write)

    async def get_quota(self, user: str) -> Quota:
        key = address_key(user)

        def read() -> Quota:
            self._require_user(key)
            return Quota(self._quota_limit(key), *self._usage(key))

        return await self._call(read)

    async def quota_limit(self, user: str) -> int | None:
        key = address_key(user)

        def read() -> int | None:
            self._require_user(key)
            return self._quota_limit(key)

        return await self._call(read)

    async def quota_allows(self, user: str, size: int) -> bool | None:
        key = address_key(user)

        def check() -> bool | None:
            self._require_user(key)
            return True if self._quota_limit(key) is None else None  # a limit: a walk to tell

        return await self._call(check)

    # ----------------------------------------------------------------- in a thread

    def _quota_limit(self, key: str) -> int | None:
        """The user's limit: one open (that finds nothing, for most users). The caller knows the
        user exists (a delivery resolved its mailbox; the others ask _require_user)."""
        path = os.path.join(self.layout.user(self._user_file(key)), QUOTA_FILE)
        try:
            value = json.loads(self.fs.read_bytes(path))["limit"]
        except FileNotFoundError:
            return None
        return stored_quota_limit(value, path)

    def _usage(self, key: str) -> tuple[int, int]:
        """(bytes, messages) of the user's mailboxes as their listings show them."""
        user_file = self._user_file(key)
        used = count = 0
        for record in self._boxes(key).values():
            try:
                live = self._messages(self.layout.mailbox(user_file, record["id"]), self._cache(record["id"]))
            except FileNotFoundError:
                continue  # deleted meanwhile
            used += sum(m.marker.size for m in live.values())
            count += len(live)
        return used, count

    def _check_quota(self, targets: Sequence[Target], size: int) -> None:
        """Before a delivery writes: QuotaExceeded naming every target user with a limit that
        their copies would pass."""
        needs = quota_needs(((t.user, t.mailbox) for t in targets), size)
        over = []
        for key, need in needs.items():
            limit = self._quota_limit(key)
            if limit is not None and self._usage(key)[0] + need > limit:
                over.append(key)
        if over:
            raise QuotaExceeded(over)
