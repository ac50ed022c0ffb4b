"""The shared Store contract suite once more on the WheelFS store without cues (the layout for
NFS, CephFS or a local directory); the main run (conftest.BACKENDS) has cues on."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from cassmail.config import WheelFSSettings
from cassmail.store.base import Store
from cassmail.store.wheelfs import WheelFSStore
from tests.contract.test_store_contract import *  # noqa: F403 - the same tests, on the store below


@pytest.fixture(scope="module")
async def store(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Store]:
    opened = WheelFSStore(WheelFSSettings(root=str(tmp_path_factory.mktemp("wheelfs-plain")), cues=False),
                          max_message_size=128 * 1024 * 1024)
    await opened.open()
    yield opened
    await opened.close()

#: These need no Cassandra (the contract module marks its tests for the backends that do).
pytestmark: list[pytest.MarkDecorator] = []
