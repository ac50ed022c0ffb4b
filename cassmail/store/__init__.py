"""Mail stores: the contract in `base`, one module per backend.

Protocols import `cassmail.store.base` only; which backend runs is decided by
`make_store` from settings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cassmail.config import Settings
    from cassmail.store.base import Store


def make_store(settings: Settings, serving: bool = False) -> Store:
    """The configured backend, not yet opened. Backends are imported here only, on demand.
    `serving`: the store of a worker, whose event loop runs as long as the store is open (on
    Cassandra that loop then does the I/O of the store's connections: store/cassandra_io.py)."""
    store = _backend(settings, serving)
    store.vanished_keep = settings.store.vanished_keep
    return store


def _backend(settings: Settings, serving: bool) -> Store:
    backend = settings.store.backend
    if backend == "cassandra":
        from cassmail.store.cassandra import CassandraStore

        return CassandraStore(settings.store.cassandra, max_message_size=settings.store.max_message_size,
                              loop_io=serving)
    if backend == "mbox":
        from cassmail.store.mbox import MboxStore

        return MboxStore(settings.store.mbox, max_message_size=settings.store.max_message_size)
    if backend == "wheelfs":
        from cassmail.store.wheelfs import WheelFSStore

        return WheelFSStore(settings.store.wheelfs, max_message_size=settings.store.max_message_size)
    from cassmail.config import ConfigError

    raise ConfigError(f"store.backend: {backend!r} is not available in this version of cassmail (use mbox, cassandra or wheelfs)")
