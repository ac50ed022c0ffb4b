"""Sieve scripts and vacation records of the Cassandra backend (schema/007_sieve.cql).

Scripts are plain writes at the write consistency level; the one lightweight
transaction on the delivery path is a vacation record's `IF NOT EXISTS`,
taken only when a script decides to answer, so two nodes delivering to the
same user at once send one reply.

The account carries a mark of whether the user may have an active script
(schema/016_sieve_mark.cql): RCPT reads the account anyway, so the delivery
after it reads no Sieve row for a user whose mark is false. The mark follows
the active name, never leads it: an activation names the script, then sets
the mark; a deactivation clears the name, clears the mark, then reads the name
again and sets the mark back if another session activated one meanwhile. So
once every change has returned, a set name has a true mark, whatever their
order (the marks are conditional writes of one partition: one after another),
where reads see acknowledged writes (the levels overlap, or one replica).
"""

from __future__ import annotations

from typing import Any

from cassmail.model import address_key
from cassmail.store.base import (
    NoSuchSieveScript,
    NoSuchUser,
    SieveScriptActive,
    SieveScriptExists,
    SieveScriptInfo,
    Store,
    check_sieve_content,
    check_sieve_name,
    check_vacation_key,
)
from cassmail.store.cassandra_cql import Cql
from cassmail.store.cassandra_tables import Tables

class CassandraSieve(Store):
    """Mixed into CassandraStore: its executor, tables and account check are used here."""

    cql: Cql
    tables: Tables
    _account: Any
    _recent: Any
    _forget_user: Any

    async def _sieve_user(self, user: str) -> str:
        key = address_key(user)
        await self._account(key)
        return key

    async def put_sieve_script(self, user: str, name: str, content: str) -> None:
        name, content = check_sieve_name(name), check_sieve_content(content)
        await self.tables.sieve_scripts.put(await self._sieve_user(user), name, content)

    async def get_sieve_script(self, user: str, name: str) -> str:
        name = check_sieve_name(name)
        key = await self._sieve_user(user)
        row = await self.tables.sieve_scripts.get(key, name)
        if row is None or row.content is None:
            raise NoSuchSieveScript(key, name)
        return str(row.content)

    async def list_sieve_scripts(self, user: str) -> list[SieveScriptInfo]:
        rows = await self.tables.sieve_scripts.list(await self._sieve_user(user))
        return sorted((SieveScriptInfo(r.name, r.name == r.active) for r in rows if r.name is not None),
                      key=lambda s: s.name)

    async def set_active_sieve_script(self, user: str, name: str | None) -> None:
        key = await self._sieve_user(user)
        if name is not None:
            name = check_sieve_name(name)
            if await self.tables.sieve_scripts.get(key, name) is None:
                raise NoSuchSieveScript(key, name)
        await self.tables.sieve_scripts.set_active(key, name)
        await self._mark_sieve(key, name is not None)
        if name is None and await self._active_name(key) is not None:
            await self._mark_sieve(key, True)  # another session's activation came between

    async def _mark_sieve(self, key: str, mark: bool) -> None:
        self._forget_user(key)  # (this process's next delivery reads the account again)
        if not await self.tables.users.set_sieve_mark(key, mark):
            raise NoSuchUser(key)

    async def delete_sieve_script(self, user: str, name: str) -> None:
        name = check_sieve_name(name)
        key = await self._sieve_user(user)
        row = await self.tables.sieve_scripts.get(key, name)
        if row is None or row.content is None:
            raise NoSuchSieveScript(key, name)
        if await self._active_name(key) == name:
            raise SieveScriptActive(key, name)
        await self.tables.sieve_scripts.delete(key, name)

    async def rename_sieve_script(self, user: str, old: str, new: str) -> None:
        old, new = check_sieve_name(old), check_sieve_name(new)
        key = await self._sieve_user(user)
        content = await self.get_sieve_script(key, old)
        if old == new:
            raise SieveScriptExists(key, new)
        scripts = self.tables.sieve_scripts
        batch = self.cql.batch(conditional=True)
        batch.add(scripts.insert_new_statement(key, new, content))
        batch.add(scripts.delete_statement(key, old))
        if await self._active_name(key) == old:
            batch.add(scripts.set_active_statement(key, new))
        applied, _ = await self.cql.conditional(batch)
        if not applied:
            raise SieveScriptExists(key, new)

    async def _active_name(self, key: str) -> str | None:
        return await self.tables.sieve_scripts.active(key)

    async def active_sieve_script(self, user: str) -> tuple[str, str] | None:
        """With the account row this process read less than `mailbox_cache` seconds ago (RCPT's,
        as for the quota) marked false, no read at all."""
        key = address_key(user)
        account = self._recent(key, None)
        if account is not None and account.sieve is False:
            return None
        name = await self._active_name(key)
        if name is None:
            return None
        row = await self.tables.sieve_scripts.get(key, name)
        if row is None or row.content is None:
            return None
        return name, str(row.content)

    async def note_vacation(self, user: str, key: str, seconds: float) -> bool:
        key, seconds = check_vacation_key(key, seconds)
        return await self.tables.sieve_vacation.note(address_key(user), key, max(1, int(seconds)))

    def _sieve_purge(self, batch: Any, key: str) -> None:
        """Add the removal of a user's scripts and vacation records to delete_user's batch."""
        batch.add(self.tables.sieve_scripts.purge_statement(key))
        batch.add(self.tables.sieve_vacation.purge_statement(key))
