"""Sieve scripts and vacation records of the Cassandra backend (schema/007_sieve.cql).

Scripts are plain writes at the write consistency level; the one lightweight
transaction on the delivery path is a vacation record's `IF NOT EXISTS`,
taken only when a script decides to answer, so two nodes delivering to the
same user at once send one reply.
"""

from __future__ import annotations

from typing import Any

from cassmail.model import address_key
from cassmail.store.base import (
    NoSuchSieveScript,
    SieveScriptActive,
    SieveScriptExists,
    SieveScriptInfo,
    Store,
    check_sieve_content,
    check_sieve_name,
    check_vacation_key,
)

SIEVE_STATEMENTS: dict[str, tuple[str, str]] = {
    "sieve_put": ("INSERT INTO sieve_scripts (user, name, content) VALUES (?, ?, ?)", "w"),
    "sieve_get": ("SELECT content FROM sieve_scripts WHERE user = ? AND name = ?", "r"),
    "sieve_list": ("SELECT name, active FROM sieve_scripts WHERE user = ?", "r"),
    "sieve_active": ("SELECT active FROM sieve_scripts WHERE user = ? LIMIT 1", "r"),
    "sieve_set_active": ("UPDATE sieve_scripts SET active = ? WHERE user = ?", "w"),
    "sieve_del": ("DELETE FROM sieve_scripts WHERE user = ? AND name = ?", "w"),
    "sieve_insert_new": ("INSERT INTO sieve_scripts (user, name, content) VALUES (?, ?, ?) IF NOT EXISTS", "l"),
    "sieve_del_plain": ("DELETE FROM sieve_scripts WHERE user = ? AND name = ?", "l"),
    "sieve_set_active_plain": ("UPDATE sieve_scripts SET active = ? WHERE user = ?", "l"),
    "sieve_purge": ("DELETE FROM sieve_scripts WHERE user = ?", "w"),
    "vacation_note": ("INSERT INTO sieve_vacation (user, key) VALUES (?, ?) IF NOT EXISTS USING TTL ?", "l"),
    "vacation_purge": ("DELETE FROM sieve_vacation WHERE user = ?", "w"),
}


class CassandraSieve(Store):
    """Mixed into CassandraStore: its statement runner and account check are used here."""

    _run: Any
    _exec: Any
    _conditional: Any
    _batch: Any
    _ps: Any
    _account: Any

    async def _sieve_user(self, user: str) -> str:
        key = address_key(user)
        await self._account(key)
        return key

    async def put_sieve_script(self, user: str, name: str, content: str) -> None:
        name, content = check_sieve_name(name), check_sieve_content(content)
        await self._run("sieve_put", await self._sieve_user(user), name, content)

    async def get_sieve_script(self, user: str, name: str) -> str:
        name = check_sieve_name(name)
        key = await self._sieve_user(user)
        rows = await self._run("sieve_get", key, name)
        if not rows or rows[0].content is None:
            raise NoSuchSieveScript(key, name)
        return str(rows[0].content)

    async def list_sieve_scripts(self, user: str) -> list[SieveScriptInfo]:
        rows = await self._run("sieve_list", await self._sieve_user(user))
        return sorted((SieveScriptInfo(r.name, r.name == r.active) for r in rows if r.name is not None),
                      key=lambda s: s.name)

    async def set_active_sieve_script(self, user: str, name: str | None) -> None:
        key = await self._sieve_user(user)
        if name is not None:
            name = check_sieve_name(name)
            if not await self._run("sieve_get", key, name):
                raise NoSuchSieveScript(key, name)
        await self._run("sieve_set_active", name, key)

    async def delete_sieve_script(self, user: str, name: str) -> None:
        name = check_sieve_name(name)
        key = await self._sieve_user(user)
        rows = await self._run("sieve_get", key, name)
        if not rows or rows[0].content is None:
            raise NoSuchSieveScript(key, name)
        if await self._active_name(key) == name:
            raise SieveScriptActive(key, name)
        await self._run("sieve_del", key, name)

    async def rename_sieve_script(self, user: str, old: str, new: str) -> None:
        old, new = check_sieve_name(old), check_sieve_name(new)
        key = await self._sieve_user(user)
        content = await self.get_sieve_script(key, old)
        if old == new:
            raise SieveScriptExists(key, new)
        batch = self._batch(conditional=True)
        batch.add(self._ps["sieve_insert_new"], (key, new, content))
        batch.add(self._ps["sieve_del_plain"], (key, old))
        if await self._active_name(key) == old:
            batch.add(self._ps["sieve_set_active_plain"], (new, key))
        applied, _ = await self._conditional(batch)
        if not applied:
            raise SieveScriptExists(key, new)

    async def _active_name(self, key: str) -> str | None:
        rows = await self._run("sieve_active", key)
        return rows[0].active if rows else None

    async def active_sieve_script(self, user: str) -> tuple[str, str] | None:
        key = address_key(user)
        name = await self._active_name(key)
        if name is None:
            return None
        rows = await self._run("sieve_get", key, name)
        if not rows or rows[0].content is None:
            return None
        return name, str(rows[0].content)

    async def note_vacation(self, user: str, key: str, seconds: float) -> bool:
        key, seconds = check_vacation_key(key, seconds)
        applied, _ = await self._conditional(self._ps["vacation_note"].bind((address_key(user), key, max(1, int(seconds)))))
        return applied

    def _sieve_purge(self, batch: Any, key: str) -> None:
        """Add the removal of a user's scripts and vacation records to delete_user's batch."""
        batch.add(self._ps["sieve_purge"], (key,))
        batch.add(self._ps["vacation_purge"], (key,))
