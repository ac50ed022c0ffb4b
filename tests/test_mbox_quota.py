"""The mbox store's storage quotas beyond the shared contract (cassmail/store/mbox_quota.py):
usage from the indexes through a cache that is never trusted beyond what it can prove, a check
that reads only the mailboxes that changed, and a limit no two processes can pass together."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cassmail.model import INBOX
from cassmail.store import mbox_index
from cassmail.store.base import Quota, QuotaExceeded, Target
from cassmail.store.mbox import MboxStore
from tests.test_mbox_store import REPO, USER, open_store, store_with_user

BODY = b"Subject: q\r\n\r\n" + b"x" * 986  # 1000 bytes


def usage_file(store: MboxStore) -> Path:
    return store._user_dir(USER) / "usage.json"


async def test_a_check_reads_again_only_the_mailboxes_whose_index_changed(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    store = await store_with_user(tmp_path / "data")
    for box in ("INBOX", "Sent", "Archive", "Junk"):
        await store.deliver(BODY, [Target(USER, box)])
    await store.set_quota(USER, 100_000)
    assert await store.get_quota(USER) == Quota(100_000, 4000, 4)
    read: list[str] = []
    real = mbox_index.MailboxFile.usage

    def counted(mf: mbox_index.MailboxFile) -> tuple[int, int, list[int]]:
        read.append(mf.mbox_path.parent.name)
        return real(mf)

    monkeypatch.setattr(mbox_index.MailboxFile, "usage", counted)
    assert await store.get_quota(USER) == Quota(100_000, 4000, 4)
    assert read == []  # nothing changed: all six mailboxes from the cache
    await store.deliver(BODY, [Target(USER)])
    assert read == []  # the delivery's check: nothing changed since the last one
    await store.deliver(BODY, [Target(USER)])
    assert read == ["INBOX"]  # the next one's: INBOX, which the first changed, and only it
    read.clear()
    await store.store_flags(USER, "Junk", [s.id async for s in store.list_messages(USER, "Junk")], ["\\Seen"], "add")
    assert await store.get_quota(USER) == Quota(100_000, 6000, 6)
    assert sorted(read) == ["INBOX", "Junk"]
    await store.close()


@pytest.mark.parametrize("damage", ["missing", "garbage", "torn", "wrong-checksum", "lying-with-checksum"])
async def test_a_missing_or_damaged_cache_is_counted_again_from_the_indexes(tmp_path: Path, damage: str) -> None:
    store = await store_with_user(tmp_path / "data")
    await store.deliver(BODY, [Target(USER), Target(USER, "Sent")])
    await store.set_quota(USER, 2500)
    assert await store.get_quota(USER) == Quota(2500, 2000, 2)
    path = usage_file(store)
    cache = json.loads(path.read_text())
    if damage == "missing":
        path.unlink()
    elif damage == "garbage":
        path.write_bytes(b"\x00\xff not json")
    elif damage == "torn":
        path.write_text(path.read_text()[:40])
    elif damage == "wrong-checksum":  # says INBOX is empty; its checksum no longer matches
        cache["boxes"]["INBOX"][3:] = [0, 0]
        path.write_text(json.dumps(cache))
    else:  # consistent with its checksum, but for an index file that is not there any more
        from cassmail.store.mbox_quota import _checksum

        cache["boxes"]["INBOX"][0] += 1
        cache["boxes"]["INBOX"][3:] = [0, 0]
        cache["check"] = _checksum(cache["boxes"])
        path.write_text(json.dumps(cache))
    assert await store.get_quota(USER) == Quota(2500, 2000, 2)
    with pytest.raises(QuotaExceeded):  # a cache saying there is room is not believed
        await store.deliver(BODY, [Target(USER)])
    assert json.loads(path.read_text())["boxes"]["INBOX"][3:] == [1000, 1]  # rewritten from the index
    assert (await store.recount_quota(USER)).used == 2000
    await store.close()


async def test_usage_follows_an_index_rebuilt_from_the_mbox(tmp_path: Path) -> None:
    store = await store_with_user(tmp_path / "data")
    await store.deliver(BODY, [Target(USER)])
    await store.deliver(BODY, [Target(USER)])
    await store.set_quota(USER, 10_000)
    assert (await store.get_quota(USER)).used == 2000
    await store.close()
    store = await open_store(tmp_path / "data")
    _, index = store.mailbox_paths(USER, INBOX)
    index.unlink()  # lost: rebuilt from the mbox by the next reader
    assert await store.get_quota(USER) == Quota(10_000, 2000, 2)
    await store.close()


LIMITED = r"""
import asyncio, json, sys
sys.path.insert(0, sys.argv[1])
from cassmail.config import MboxSettings
from cassmail.store.mbox import MboxStore
from cassmail.store.base import QuotaExceeded, Target
from tests.test_mbox_quota import BODY, USER

async def main(root, count):
    store = MboxStore(MboxSettings(path=root))
    await store.open()
    done = refused = 0
    for _ in range(count):
        try:
            await store.deliver(BODY, [Target(USER)])
            done += 1
        except QuotaExceeded:
            refused += 1
    await store.close()
    print(json.dumps([done, refused]))

asyncio.run(main(sys.argv[2], int(sys.argv[3])))
"""


async def test_processes_delivering_at_once_never_pass_the_limit(tmp_path: Path) -> None:
    """The check and the copies are under the user's quota lock, in every process: three
    processes racing for room for seven messages store exactly seven."""
    root = tmp_path / "data"
    store = await store_with_user(root)
    await store.set_quota(USER, 7 * len(BODY) + 500)
    await store.close()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", LIMITED, str(REPO), str(root), "5"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=env) for _ in range(3)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err.decode()[-2000:]
        results.append(json.loads(out))
    assert sum(done for done, _ in results) == 7 and sum(refused for _, refused in results) == 8
    store = await open_store(root)
    assert await store.get_quota(USER) == Quota(7 * len(BODY) + 500, 7 * len(BODY), 7)
    assert len([s async for s in store.list_messages(USER, INBOX)]) == 7
    await store.close()
