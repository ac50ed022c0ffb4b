"""A least-recently-used map with a bound on the summed cost of its entries: what a worker keeps
between commands that a store could give again (parsed headers, STATUS counts)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class Lru(Generic[V]):
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.cost = 0
        self._entries: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()

    def get(self, key: Hashable) -> V | None:
        found = self._entries.get(key)
        if found is None:
            return None
        self._entries.move_to_end(key)
        return found[0]

    def put(self, key: Hashable, value: V, cost: int = 1) -> None:
        """Keep `value` (replacing what `key` had); the oldest entries go past the limit. A value
        costlier than the whole limit is not kept."""
        old = self._entries.pop(key, None)
        if old is not None:
            self.cost -= old[1]
        if cost > self.limit:
            return
        self._entries[key] = (value, cost)
        self.cost += cost
        while self.cost > self.limit:
            _, (_, dropped) = self._entries.popitem(last=False)
            self.cost -= dropped
