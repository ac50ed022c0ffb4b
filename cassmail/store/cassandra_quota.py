"""Storage quotas of the Cassandra backend (schema/010_quota.cql), mixed into CassandraStore.

The limit is a static column of the user's partition (`quota_limit`), so the mailbox row every
delivery reads to resolve its targets brings it along: a user without a limit costs a delivery
nothing more. For a user with a limit, usage is a pair of counters in `quota_usage` (bytes,
messages): a delivery reads them before it writes (QuotaExceeded when the copies would not fit)
and adds its copies after its rows are stored; a deletion subtracts what it removed. The
counters are kept only while the user has a limit: without one, `get_quota` counts the
mailboxes (a walk of their listings), and setting a limit counts them once and sets the counters
from that.

How far off it can be, and why:

- *Overshoot.* The check and the write are not one transaction (a Paxos round per delivery is
  what the design keeps off the delivery path), so deliveries to one user in flight at the same
  time each see the usage from before the others and may all pass: the limit can be passed by
  at most the sizes of the deliveries (and IMAP APPENDs or COPYs) that were in flight at once,
  plus those a read at `read_consistency` does not see yet (a replica behind at ONE).
- *Drift.* A counter update is not idempotent, so it is never retried: one that fails is logged
  (`quota-drift`) and lost, and one that times out may have been applied or not. A delivery
  whose update was lost is not counted (usage too low by its size), a deletion's (too high).
  Two sessions deleting the same message of a mailbox that was never numbered (POP3 only) both
  subtract it; a mailbox deleted while a delivery into it is in flight may or may not have that
  delivery subtracted; a deletion takes the limit from a mailbox row up to `mailbox_cache` old,
  so one made on another node within that time of the first limit being set is not subtracted.
  Drift stays until `cassmail user quota USER --recount` (recount_quota)
  counts the mailboxes again and adds the difference; a recount is itself off by whatever
  changed while it walked (it walks again when the counters moved meanwhile, up to three times).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from cassmail.logs import kv
from cassmail.model import address_key
from cassmail.store.base import (
    NoSuchUser,
    Quota,
    QuotaExceeded,
    Store,
    StoreUnavailable,
    check_quota_limit,
)
from cassmail.store.cassandra_cql import Cql
from cassmail.store.cassandra_tables import Tables

log = logging.getLogger(__name__)

#: Walks a recount makes at most while deliveries or deletions keep moving the counters.
RECOUNT_ATTEMPTS = 3


class CassandraQuota(Store):
    """Mixed into CassandraStore: its executor, tables and account checks are used here."""

    cql: Cql
    tables: Tables
    #: The account's row, with its `quota_limit`; NoSuchUser without one.
    _account: Any
    _recent: Any
    _resolve: Any
    _forget_user: Any

    # ----------------------------------------------------------------- the contract

    async def set_quota(self, user: str, limit: int | None) -> None:
        key, limit = address_key(user), check_quota_limit(limit)
        before = (await self._account(key)).quota_limit
        try:
            applied = await self.tables.users.set_quota_limit(key, limit)
        finally:  # (also when the outcome is unknown: the row read above may be old now)
            self._forget_user(key)
        if not applied:
            raise NoSuchUser(key)
        if limit is not None and before is None:
            # No counter was kept without a limit: the mailboxes are counted now, once the limit
            # is in place, so every delivery from here on is counted as well.
            await self._recount(key)

    async def get_quota(self, user: str) -> Quota:
        key = address_key(user)
        limit = (await self._account(key)).quota_limit
        if limit is None:
            used, messages = await self.count_usage(key)
        else:
            used, messages = await self.tables.quota_usage.get(key)
        return Quota(limit, max(used, 0), max(messages, 0))

    async def quota_limit(self, user: str) -> int | None:
        return (await self._account(address_key(user))).quota_limit  # type: ignore[no-any-return]

    async def quota_allows(self, user: str, size: int) -> bool | None:
        key = address_key(user)
        return await self._within(key, (self._recent(key, None) or await self._account(key)).quota_limit, size)

    async def _copies_allowed(self, user: str, dest: str, size: int) -> bool | None:
        """As `quota_allows`, with the limit of the target's row (a static column of the user's
        partition: the account's limit as of that row's read), which COPY has just resolved."""
        key = address_key(user)
        return await self._within(key, (await self._resolve(key, dest, cached=True)).quota_limit, size)

    async def _within(self, key: str, limit: int | None, size: int) -> bool:
        """Whether `size` more bytes stay within the user's `limit` (None: no limit, no read)."""
        if limit is None:
            return True
        used, _ = await self.tables.quota_usage.get(key)
        return used + size <= limit

    async def recount_quota(self, user: str) -> Quota:
        key = address_key(user)
        limit = (await self._account(key)).quota_limit
        if limit is None:  # nothing kept to repair: the usage is counted whenever asked
            return Quota(None, *await self.count_usage(key))
        return Quota(limit, *await self._recount(key))

    async def _recount(self, key: str) -> tuple[int, int]:
        """Walk the mailboxes and add to the counters what they lack (or take what they have too
        much); walked again when the counters moved during the walk."""
        counters = self.tables.quota_usage
        for _ in range(RECOUNT_ATTEMPTS):
            before = await counters.get(key)
            walked = await self.count_usage(key)
            after = await counters.get(key)
            if after == before:
                break
        delta = (walked[0] - after[0], walked[1] - after[1])
        if delta != (0, 0):
            await counters.add(key, *delta)
            log.info(kv("quota-recount", user=key, bytes=delta[0], messages=delta[1]))
        return walked

    # ----------------------------------------------------------------- hooks of cassandra.py

    async def _quota_check(self, unique: Sequence[tuple[str, str]], rows: Sequence[Any], size: int
                           ) -> dict[str, tuple[int, int]]:
        """Before a delivery writes: `rows` are the targets' mailbox rows, in the order of
        `unique`, each with its user's limit. QuotaExceeded naming every user with a limit whose
        counted usage plus their copies would pass it; else what to count for each of them
        (bytes, messages), for `_quota_count` once the delivery is stored."""
        copies = Counter(user for user, _ in unique)
        limits = {k[0]: r.quota_limit for k, r in zip(unique, rows) if r.quota_limit is not None}
        if not limits:
            return {}
        counted = await asyncio.gather(*(self.tables.quota_usage.get(u) for u in limits))
        over = [u for (u, limit), (used, _) in zip(limits.items(), counted) if used + size * copies[u] > limit]
        if over:
            raise QuotaExceeded(over)
        return {u: (size * copies[u], copies[u]) for u in limits}

    async def _quota_count(self, changes: Mapping[str, tuple[int, int]], sign: int = 1) -> None:
        """Add (or, with sign -1, subtract) bytes and messages to users' counters, once each:
        a failure is logged as drift, never retried and never raised (the mail is stored, or
        gone, either way)."""

        async def one(user: str, size: int, messages: int) -> None:
            try:
                await self.tables.quota_usage.add(user, sign * size, sign * messages)
            except StoreUnavailable as exc:
                log.warning(kv("quota-drift", user=user, bytes=sign * size, messages=sign * messages, error=exc))

        await asyncio.gather(*(one(u, b, n) for u, (b, n) in changes.items() if b or n))

    async def _quota_freed(self, key: str, limit_row: Any, rows: Iterable[Any]) -> None:
        """After a deletion of `rows` (message rows with their sizes) from a mailbox of `key`,
        whose row (with the user's limit) is `limit_row`."""
        if limit_row.quota_limit is None:
            return
        gone = [r.size for r in rows if r.size is not None]
        if gone:
            await self._quota_count({key: (sum(gone), len(gone))}, sign=-1)

    async def _quota_freed_totals(self, key: str, size: int, messages: int) -> None:
        """After a whole mailbox of `key` went (`size` bytes in `messages` messages)."""
        if not messages:
            return
        try:
            limit = (await self._account(key)).quota_limit
        except (NoSuchUser, StoreUnavailable) as exc:
            log.warning(kv("quota-drift", user=key, bytes=-size, messages=-messages, error=exc))
            return
        if limit is not None:
            await self._quota_count({key: (size, messages)}, sign=-1)
