"""Wires settings, the store and the listeners into a running node."""

from __future__ import annotations

from cassmail.config import ConfigError, Settings
from cassmail.store.base import Store


def make_store(settings: Settings) -> Store:
    """The configured backend, not yet opened. Backends are imported here only, on demand."""
    backend = settings.store.backend
    if backend == "cassandra":
        from cassmail.store.cassandra import CassandraStore

        return CassandraStore(settings.store.cassandra, max_message_size=settings.store.max_message_size)
    raise ConfigError(f"store.backend: {backend!r} is not available yet in this version of cassmail (use \"cassandra\")")
