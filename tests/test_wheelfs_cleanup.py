"""A deleted message leaves nothing behind in the WheelFS store, whatever names a replica merge
gave its entries.

A union merge may list a message's body or marker under a second name (`<name>#conflict-2`, an
entry of its own that takes space) or rename it (`<sid>#conflict-1`). Deletion and tombstone
collection remove every entry of body/ and msg/ whose name starts with the message's id, not
only the names the store wrote. The faults come from the file-system layer (tests.test_wheelfs_store's
FaultyFS): a stale replica's directory merged in by union, an entry renamed by a merge."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

from cassmail.model import INBOX, sortable_id
from cassmail.store.base import NoSuchMessage, Target
from tests.test_wheelfs_store import BODY, USER, FaultyFS, Opener, faulty, ids_of, mail_dir, opened  # noqa: F401

import pytest


def entries_of(fs: FaultyFS, box: Path, sid: str) -> dict[str, list[str]]:
    """The names of body/ and msg/ that belong to one message, as the store's file system lists them."""
    return {part: [n for n in fs.listdir(str(box / part)) if n.startswith(sid)] for part in ("body", "msg")}


def on_disk(root: Path, sid: str) -> list[Path]:
    """Every file under `root` (the store and the replica copies) named after the message."""
    return [p for p in root.rglob(f"{sid}*") if p.is_file()]


async def test_deleting_a_message_removes_its_renamed_body_and_merged_duplicates(faulty, tmp_path: Path) -> None:
    store, fs = faulty
    [a] = await store.deliver(BODY, [Target(USER, INBOX, frozenset({"$Work"}))])
    [b] = await store.deliver(BODY + b"b", [Target(USER)])
    box = mail_dir(tmp_path)
    sid = sortable_id(a)
    [marker] = [n for n in os.listdir(box / "msg") if n.startswith(sid)]
    # a stale replica merged in by union holds second copies of a's marker and body under merge names
    replica = tmp_path / "replica"
    (replica / "msg").mkdir(parents=True)
    (replica / "body").mkdir()
    (replica / "msg" / f"{marker}#conflict-2").write_bytes(b"")
    shutil.copy(box / "body" / sid, replica / "body" / f"{sid}#conflict-2")
    fs.bring_back(box, replica)
    # and the merge renamed a's own body
    fs.show_renamed(box / "body" / sid, f"{sid}#conflict-1")
    assert entries_of(fs, box, sid) == {"body": [f"{sid}#conflict-1", f"{sid}#conflict-2"],
                                        "msg": [marker, f"{marker}#conflict-2"]}
    assert await ids_of(store) == [a, b] and await store.read_message(USER, INBOX, a) == BODY

    await store.delete_messages(USER, INBOX, [a])
    assert entries_of(fs, box, sid) == {"body": [], "msg": []}
    assert on_disk(tmp_path, sid) == [box / "dead" / sid]  # only the tombstone is left
    assert not [n for n in fs.listdir(str(box / "flags")) if n.startswith(sid)]
    assert await ids_of(store) == [b]
    with pytest.raises(NoSuchMessage):
        await store.read_message(USER, INBOX, a)
    assert await store.read_message(USER, INBOX, b) == BODY + b"b"


async def test_tombstone_collection_removes_every_entry_a_merge_brought_back(tmp_path: Path, opened: Opener) -> None:
    from cassmail.auth import hash_password
    from tests.conftest import FAST_HASH

    fs = FaultyFS()
    store = await opened(tmp_path, fs, tombstone_grace=1.0)
    await store.add_domain("wheel.example")
    await store.create_user(USER, hash_password("pw", FAST_HASH))
    a, b, c, d = [(await store.deliver(BODY + b"%d" % i, [Target(USER)]))[0] for i in range(4)]
    box = mail_dir(tmp_path)
    sid = sortable_id(a)
    [marker] = [n for n in os.listdir(box / "msg") if n.startswith(sid)]
    replica = tmp_path / "replica"
    (replica / "msg").mkdir(parents=True)
    (replica / "body").mkdir()
    shutil.copy(box / "msg" / marker, replica / "msg" / marker)
    (replica / "msg" / f"{marker}#conflict-3").write_bytes(b"")
    shutil.copy(box / "body" / sid, replica / "body" / f"{sid}#conflict-3")
    await asyncio.sleep(1.2)  # the messages are older than the grace
    await store.delete_messages(USER, INBOX, [a])
    # after the deletion, a replica that never heard of it is merged in: two markers, a second body
    fs.bring_back(box, replica)
    assert entries_of(fs, box, sid) == {"body": [f"{sid}#conflict-3"], "msg": [marker, f"{marker}#conflict-3"]}
    assert await ids_of(store) == [b, c, d]  # the tombstone hides them

    long_ago = time.time() - 10
    os.utime(box / "dead" / sid, (long_ago, long_ago))
    await (await opened(tmp_path, fs, tombstone_grace=1.0)).delete_messages(USER, INBOX, [b])
    # the collection found a's markers back: all of them and the body go, the tombstone stays
    assert entries_of(fs, box, sid) == {"body": [], "msg": []}
    assert on_disk(tmp_path, sid) == [box / "dead" / sid]

    os.utime(box / "dead" / sid, (long_ago, long_ago))
    await (await opened(tmp_path, fs, tombstone_grace=1.0)).delete_messages(USER, INBOX, [c])
    assert on_disk(tmp_path, sid) == []  # nothing came back this time: the tombstone went too
    for node in (store, await opened(tmp_path, fs)):
        assert await ids_of(node) == [d]
        assert await node.read_message(USER, INBOX, d) == BODY + b"3"
