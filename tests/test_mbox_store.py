"""The mbox store's own promises, beyond the shared Store contract.

The format (mboxrd, byte-exact, readable by Python's `mailbox.mbox`), the index
(rebuilt from the mbox alone), compaction at deletion time (space reclaimed, contents
and flags kept, cost independent of where the mail sits), crash safety (a writer
killed with SIGKILL at every step of delivery, flag update, deletion and compaction
loses nothing acknowledged and shows nothing deleted), and locking across processes.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import mailbox
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cassmail.config import MboxSettings
from cassmail.model import INBOX
from cassmail.store import mbox_fs, mbox_index
from cassmail.store.base import NoSuchMessage, StoreUnavailable, Target
from cassmail.store.mbox import MboxStore, decode_name, encode_name
from cassmail.store.mbox_format import PAD_MIN, Unquoter, pad, quote, unquote
from tests.contract.test_store_contract import recent_owners
from tests.mbox_messages import USER, body_for

REPO = Path(__file__).resolve().parent.parent

def require_collapse(directory: Path) -> None:
    """Skip a test that counts range collapses where the file system cannot collapse, probed
    as the store probes it at open (the store falls back to rewriting the tail there)."""
    directory.mkdir(parents=True, exist_ok=True)
    if not mbox_fs.supports_collapse(directory):
        pytest.skip(f"the file system of {directory} cannot collapse ranges (fallocate FALLOC_FL_COLLAPSE_RANGE: "
                    "ext4 and XFS can, tmpfs cannot)")


async def open_store(path: Path, **kw: Any) -> MboxStore:
    """An open store; settings starting with "_" are the crash worker's own and are left out."""
    store = MboxStore(MboxSettings(path=str(path), **{k: v for k, v in kw.items() if not k.startswith("_")}))
    await store.open()
    return store


async def store_with_user(path: Path, **kw: Any) -> MboxStore:
    """An open store with the test user and its default mailboxes."""
    store = await open_store(path, **kw)
    await store.add_domain("example.org")
    await store.create_user(USER, "$scrypt$x")
    return store


@pytest.fixture
async def mstore(tmp_path: Path) -> AsyncIterator[MboxStore]:
    store = await store_with_user(tmp_path / "data")
    yield store
    await store.close()


async def listing(store: MboxStore, mailbox_name: str = INBOX) -> list:
    return [s async for s in store.list_messages(USER, mailbox_name)]


def python_mbox_view(path: Path) -> list[tuple[bytes, str]]:
    """What Python's mailbox module reads: (message as delivered, its mbox flags) per message,
    our X-Cassmail headers stripped and the mboxrd quoting undone."""
    out = []
    box = mailbox.mbox(str(path), create=False)
    try:
        for key in box.keys():
            data = box.get_bytes(key)
            msg = box[key]
            lines = data.split(b"\n")
            while lines and lines[0].startswith((b"X-Cassmail-Pad:", b" ")):
                lines.pop(0)
            assert lines[0].startswith(b"X-Cassmail: ")
            assert lines[1].startswith(b"Status: ") and lines[2].startswith(b"X-Status: ")
            assert lines[3].startswith(b"X-Keywords: ")
            out.append((unquote(b"\n".join(lines[4:])), msg.get_flags()))
    finally:
        box.close()
    return out


def same_message(seen: bytes, body: bytes) -> bool:
    """mailbox.mbox keeps the newline we add after a message that lacks one."""
    return seen == body or (not body.endswith(b"\n") and seen == body + b"\n")


# ----------------------------------------------------------------------------- format


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"From x\n",
        b"From ",
        b">From \n>>From a\nFrom b\n From c\nFromd\n",
        b"a\nFrom b\r\nFrom \r\n\n>From",
        b"no newline at all",
        b"\n\n\nFrom \n",
    ],
)
def test_mboxrd_quoting_round_trips_byte_exact(raw: bytes) -> None:
    stored = bytes(quote(raw))
    assert b"\nFrom " not in b"\n" + stored  # no line of the stored message can start a record
    assert unquote(stored) == raw


def test_streamed_unquoting_gives_the_same_bytes_however_the_stream_is_cut() -> None:
    rnd = random.Random(7)
    for trial in range(300):
        raw = b"".join(rnd.choice([b"From ", b">", b">>From x", b"\n", b"a", b"F", b"Fro", b"\r\n"]) for _ in range(60))
        stored = bytes(quote(raw))
        unquoter = Unquoter()
        out = []
        pos = 0
        while pos < len(stored):
            step = rnd.randint(1, 9)
            out.append(unquoter.feed(stored[pos : pos + step]))
            pos += step
        out.append(unquoter.finish())
        assert b"".join(out) == raw, trial


def test_pads_have_exactly_the_asked_length_and_read_as_one_header() -> None:
    for length in list(range(PAD_MIN, 400)) + [4096, 8191, 12_345]:
        text = pad(length)
        assert len(text) == length
        lines = text.split(b"\n")[:-1]
        assert lines[0].startswith(b"X-Cassmail-Pad:") and all(l.startswith(b" ") and l.strip() for l in lines[1:])
        assert all(len(l) <= 80 for l in lines)
    with pytest.raises(ValueError):
        pad(PAD_MIN - 1)


def test_mailbox_names_map_to_file_names_reversibly() -> None:
    for name in ["INBOX", "Work/2026", "Entwürfe/日本", ".hidden", "100%/a", "a%2Fb", "..", "x/.y"]:
        encoded = encode_name(name)
        assert "/" not in encoded and not encoded.startswith(".")
        assert decode_name(encoded) == name


async def test_unicode_and_hierarchical_names_are_directories_on_disk(mstore: MboxStore) -> None:
    await mstore.create_mailbox(USER, "Entwürfe/日本")
    mbox, index = mstore.mailbox_paths(USER, "Entwürfe/日本")
    assert mbox.parent.name == "Entwürfe%2F日本" and mbox.exists() and index.exists()


# ----------------------------------------------------------------------------- bodies and mbox tools


async def test_messages_come_back_byte_exact_and_python_mailbox_reads_the_file(mstore: MboxStore) -> None:
    bodies = [body_for(n) for n in range(40)] + [b"", b"From the very start\n", b"x", b">From\n"]
    ids = [(await mstore.deliver(b, [Target(USER)]))[0] for b in bodies]
    await mstore.store_flags(USER, INBOX, ids[:5], ["\\Seen", "\\Flagged", "$Work"], "add")
    for message_id, body in zip(ids, bodies):
        assert await mstore.read_message(USER, INBOX, message_id) == body
    view = python_mbox_view(mstore.mailbox_paths(USER, INBOX)[0])
    assert len(view) == len(bodies)
    for (seen, flags), body in zip(view, bodies):
        assert same_message(seen, body)
    assert all("R" in flags and "F" in flags for _, flags in view[:5])
    assert all("R" not in flags for _, flags in view[5:])


async def test_byte_ranges_of_a_quoted_message_are_exact(mstore: MboxStore) -> None:
    body = b"".join(b"From line %d\n>From %d\nplain %d\n" % (i, i, i) for i in range(40_000))
    [message_id] = await mstore.deliver(body, [Target(USER)])
    for start, end in [(0, 1), (5, 6), (1000, 300_000), (len(body) - 3, len(body)), (77_777, 77_777)]:
        got = b"".join([c async for c in mstore.read_chunks(USER, INBOX, message_id, start, end)])
        assert got == body[start:end]


async def test_more_watched_mailboxes_than_open_files_are_reported_only_when_they_change(
        mstore: MboxStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """An IDLE worker watches more mailboxes than the store keeps open: reading them all makes
    the store close files it had open for writing, which is no change of a mailbox."""
    from cassmail.store import mbox

    monkeypatch.setattr(mbox, "OPEN_MAILBOXES", 8)
    names = [f"box{i}" for i in range(12)]
    for name in names:
        await mstore.create_mailbox(USER, name)
        await mstore.deliver(body_for(1), [Target(USER, name)])
    watched = [(USER, name) for name in names]
    assert (await mstore.changed_mailboxes(watched, None))[0] == set()
    for _ in range(2):  # every mailbox opened, and all but 8 closed again
        for name in names:
            [summary] = [s async for s in mstore.list_messages(USER, name)]
            assert await mstore.read_message(USER, name, summary.id) == body_for(1)
    assert len(mstore._open_files) == 8
    changed, cursor = await mstore.changed_mailboxes(watched, True)
    assert changed == set()
    await mstore.deliver(body_for(2), [Target(USER, "box3")])
    changed, cursor = await mstore.changed_mailboxes(watched, cursor)
    assert changed == {(USER, "box3")}


async def test_a_message_another_tool_appends_is_adopted(mstore: MboxStore) -> None:
    [ours] = await mstore.deliver(body_for(1), [Target(USER)])
    path = mstore.mailbox_paths(USER, INBOX)[0]
    box = mailbox.mbox(str(path))
    box.lock()
    box.add(b"From: other@tool.example\nSubject: appended by mailbox.mbox\n\nhello\n")
    box.flush()
    box.unlock()
    box.close()
    items = await listing(mstore)
    assert len(items) == 2 and ours in {s.id for s in items}
    [foreign] = [s for s in items if s.id != ours]  # dated by its From_ line (whole seconds)
    assert await mstore.read_message(USER, INBOX, foreign.id) == (
        b"From: other@tool.example\nSubject: appended by mailbox.mbox\n\nhello\n"
    )
    # Its flags can change (it is moved into a record of ours), and it can be deleted.
    await mstore.store_flags(USER, INBOX, [foreign.id], ["\\Seen", "$tool"], "add")
    assert (await mstore.get_summaries(USER, INBOX, [foreign.id]))[foreign.id].flags == {"\\Seen", "$tool"}
    await mstore.delete_messages(USER, INBOX, [foreign.id])
    assert [s.id for s in await listing(mstore)] == [ours]


# ----------------------------------------------------------------------------- the index


async def deliver_some(store: MboxStore, count: int) -> dict[uuid.UUID, bytes]:
    bodies = {}
    for n in range(count):
        body = body_for(n)
        [message_id] = await store.deliver(body, [Target(USER)])
        bodies[message_id] = body
    return bodies


@pytest.mark.parametrize("damage", ["missing", "corrupt-header", "corrupt-middle", "garbage-instead"])
async def test_the_index_is_rebuilt_from_the_mbox_alone(tmp_path: Path, damage: str) -> None:
    store = await store_with_user(tmp_path / "data", compact_on_delete=False)
    bodies = await deliver_some(store, 30)
    ids = list(bodies)
    await store.store_flags(USER, INBOX, ids[:10], ["\\Seen", "$A"], "add")
    await store.store_flags(USER, INBOX, ids[5:8], ["\\Answered", "\\Draft", "\\Deleted"], "add")
    await store.assign_uids(USER, INBOX, ids)
    await store.delete_messages(USER, INBOX, ids[20:25])  # marked, not compacted
    before = await listing(store)
    validity = (await store.mailbox_info(USER, INBOX)).uidvalidity
    await store.close()

    index = store.mailbox_paths(USER, INBOX)[1]
    data = bytearray(index.read_bytes())
    if damage == "missing":
        index.unlink()
    elif damage == "corrupt-header":
        data[3] ^= 0xFF
        index.write_bytes(bytes(data))
    elif damage == "corrupt-middle":
        data[len(data) // 2] ^= 0xFF
        index.write_bytes(bytes(data))
    else:
        index.write_bytes(os.urandom(len(data)))

    store = await open_store(tmp_path / "data")
    after = await listing(store)
    assert [(s.id, s.size, s.flags, s.internal_date) for s in after] == [
        (s.id, s.size, s.flags, s.internal_date) for s in before
    ]
    for summary in after:
        assert await store.read_message(USER, INBOX, summary.id) == bodies[summary.id]
    # UIDs could not be kept: a new UIDVALIDITY says so, and UIDs start again.
    assert (await store.mailbox_info(USER, INBOX)).uidvalidity != validity
    assert all(s.uid is None and s.modseq is None for s in after) and await store.uid_next(USER, INBOX) == 1
    assert await store.highest_modseq(USER, INBOX) == 1 and await store.vanished_since(USER, INBOX, 0) == []
    await store.close()


async def test_the_recent_mark_is_kept_by_checkpoints_and_reset_by_a_rebuild(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(mbox_index, "CHECKPOINT_MIN", 0)
    store = await store_with_user(tmp_path / "data")
    mf = store.mailbox_file(USER, INBOX)
    ids = list(await deliver_some(store, 3))
    await store.assign_uids(USER, INBOX, ids)
    assert await store.claim_recent(USER, INBOX, 4) == 1
    generation = mf.generation
    while mf.generation == generation:  # the log outgrows the snapshot: a checkpoint rewrites the index
        await store.deliver(body_for(9, 200), [Target(USER)])
    assert await store.recent_mark(USER, INBOX) == 4
    await store.close()
    store = await open_store(tmp_path / "data")
    assert await store.recent_mark(USER, INBOX) == 4 and await store.uid_next(USER, INBOX) == 4
    validity = (await store.mailbox_info(USER, INBOX)).uidvalidity
    await store.close()
    # an index rebuilt from the mbox alone numbers the messages afresh, so they are recent afresh
    store.mailbox_paths(USER, INBOX)[1].unlink()
    store = await open_store(tmp_path / "data")
    assert (await store.mailbox_info(USER, INBOX)).uidvalidity != validity
    assert await store.recent_mark(USER, INBOX) == 1 and await store.uid_next(USER, INBOX) == 1
    await store.close()


async def test_a_torn_last_index_record_is_cut_off_without_a_rebuild(tmp_path: Path) -> None:
    store = await store_with_user(tmp_path / "data")
    bodies = await deliver_some(store, 5)
    validity = (await store.mailbox_info(USER, INBOX)).uidvalidity
    await store.close()
    index = store.mailbox_paths(USER, INBOX)[1]
    with open(index, "ab") as fh:
        fh.write(b"\x00\x00\x01\x00garbage")  # a record header promising more than is there
    store = await open_store(tmp_path / "data")
    assert [s.id for s in await listing(store)] == list(bodies)
    assert (await store.mailbox_info(USER, INBOX)).uidvalidity == validity
    await store.close()


# ----------------------------------------------------------------------------- MODSEQs in the index

#: A store written by cassmail before MODSEQs (index magic CMIDX01), kept as it was: anne@example.org
#: got four messages in INBOX, numbered 1-4; 1 and 3 were given \Seen and $Label1; 2 was deleted.
V1_STORE = REPO / "tests" / "fixtures" / "mbox-store-v1"
V1_UIDVALIDITY = 1795685387


def v1_body(n: int) -> bytes:
    return b"From: sender%d@example.net\r\nSubject: message %d\r\n\r\nFrom the body of message %d\r\n" % (n, n, n)


def index_magic(root: Path, mailbox_name: str = INBOX) -> bytes:
    return (root / "users" / USER / "mail" / encode_name(mailbox_name) / "index").read_bytes()[:8]


async def test_a_store_written_before_modseqs_works_and_is_upgraded_in_place(tmp_path: Path) -> None:
    root = tmp_path / "data"
    shutil.copytree(V1_STORE, root)
    assert index_magic(root) == mbox_index.MAGIC_V1
    store = await open_store(root)
    items = await listing(store)
    labelled = {"\\Seen", "$Label1"}
    assert [(s.uid, s.flags, s.internal_date.day, s.size, s.modseq) for s in items] == [
        (1, labelled, 1, 77, 1), (3, labelled, 3, 77, 1), (4, set(), 4, 77, 1),
    ]
    for summary, n in zip(items, (1, 3, 4)):
        assert await store.read_message(USER, INBOX, summary.id) == v1_body(n)
    assert await store.highest_modseq(USER, INBOX) == 1 and await store.uid_next(USER, INBOX) == 5
    assert await store.changed_since(USER, INBOX, 1) == [] and len(await store.changed_since(USER, INBOX, 0)) == 3
    assert await store.vanished_since(USER, INBOX, 1) == []  # UID 2 went before expunges had MODSEQs
    assert index_magic(root) == mbox_index.MAGIC_V1  # reading leaves the index as it was

    # the first change upgrades the index in place: same UIDVALIDITY, UIDs, flags, MODSEQ counter from 1
    assert await store.store_flags(USER, INBOX, [items[2].id], ["\\Flagged"], "add", unchanged_since=1) == set()
    assert index_magic(root) == mbox_index.MAGIC
    assert {s.uid: s.modseq for s in await listing(store)} == {1: 1, 3: 1, 4: 2}
    await store.delete_messages(USER, INBOX, [items[0].id])
    [late] = await store.deliver(b"Subject: after the upgrade\r\n\r\nhi\r\n", [Target(USER)])
    assert await store.assign_uids(USER, INBOX, [late]) == {late: 5}
    expected = {3: (labelled, 1), 4: ({"\\Flagged"}, 2), 5: (set(), 4)}
    assert {s.uid: (s.flags, s.modseq) for s in await listing(store)} == expected
    assert await store.highest_modseq(USER, INBOX) == 4 and await store.vanished_since(USER, INBOX, 1) == [1]
    # another mailbox of the old store: read as it is, numbered from MODSEQ 2 when first changed
    assert await store.highest_modseq(USER, "Drafts") == 1 and index_magic(root, "Drafts") == mbox_index.MAGIC_V1
    await store.close()

    store = await open_store(root)
    assert {s.uid: (s.flags, s.modseq) for s in await listing(store)} == expected
    assert await store.highest_modseq(USER, INBOX) == 4
    assert await store.vanished_since(USER, INBOX, 1) == [1] and await store.vanished_since(USER, INBOX, 3) == []
    assert (await store.mailbox_info(USER, INBOX)).uidvalidity == V1_UIDVALIDITY  # not rebuilt
    assert [s.uid for s in await store.changed_since(USER, INBOX, 1)] == [4, 5]
    await store.close()


async def test_a_store_written_before_modseqs_without_its_index_is_rebuilt_from_the_mbox(tmp_path: Path) -> None:
    root = tmp_path / "data"
    shutil.copytree(V1_STORE, root)
    (root / "users" / USER / "mail" / INBOX / "index").unlink()
    store = await open_store(root)
    items = await listing(store)
    labelled = {"\\Seen", "$Label1"}
    assert [(s.flags, s.uid, s.modseq) for s in items] == [(labelled, None, None), (labelled, None, None),
                                                          (set(), None, None)]
    assert [await store.read_message(USER, INBOX, s.id) for s in items] == [v1_body(1), v1_body(3), v1_body(4)]
    assert (await store.mailbox_info(USER, INBOX)).uidvalidity != V1_UIDVALIDITY
    assert await store.highest_modseq(USER, INBOX) == 1 and await store.vanished_since(USER, INBOX, 0) == []
    assert index_magic(root) == mbox_index.MAGIC
    await store.assign_uids(USER, INBOX, [s.id for s in items])
    assert [(s.uid, s.modseq) for s in await listing(store)] == [(1, 2), (2, 2), (3, 2)]
    await store.close()


async def test_modseqs_and_expunges_survive_checkpoints_and_reopening(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(mbox_index, "CHECKPOINT_MIN", 0)
    store = await store_with_user(tmp_path / "data")
    mf = store.mailbox_file(USER, INBOX)
    ids = list(await deliver_some(store, 6))
    await store.assign_uids(USER, INBOX, ids)  # MODSEQ 2
    await store.store_flags(USER, INBOX, ids[1:3], ["$A"], "add")  # 3
    await store.delete_messages(USER, INBOX, [ids[0]])  # 4: UID 1
    await store.assign_uids(USER, INBOX, [], renumber={ids[5]: 6})  # 5: UID 6 becomes 7
    await store.delete_messages(USER, INBOX, ids[3:5])  # 6: UIDs 4, 5
    generation = mf.generation
    while mf.generation == generation:
        await store.deliver(body_for(9, 200), [Target(USER)])
    expected = {ids[1]: (2, 3), ids[2]: (3, 3), ids[5]: (7, 5)}
    for reopened in (False, True):
        items = {s.id: (s.uid, s.modseq) for s in await listing(store) if s.uid}
        assert items == expected, reopened
        assert await store.highest_modseq(USER, INBOX) == 6
        assert await store.vanished_since(USER, INBOX, 1) == [1, 4, 5, 6]
        assert await store.vanished_since(USER, INBOX, 4) == [4, 5, 6]
        assert await store.vanished_since(USER, INBOX, 5) == [4, 5]
        await store.close()
        store = await open_store(tmp_path / "data")
    await store.close()


async def test_expunges_are_forgotten_after_the_window_by_every_process_alike(tmp_path: Path, monkeypatch) -> None:
    """The floor is written in the change records, so a process that replays the log forgets what
    the writer forgot, and a checkpoint keeps the floor."""
    store = await store_with_user(tmp_path / "data")
    ids = list(await deliver_some(store, 4))
    await store.assign_uids(USER, INBOX, ids)  # MODSEQ 2
    store.vanished_keep = 0.3
    await store.delete_messages(USER, INBOX, [ids[0]])  # 3
    await asyncio.sleep(0.4)
    await store.delete_messages(USER, INBOX, [ids[1]])  # 4: forgets UID 1 (MODSEQ 3, the floor)
    store.vanished_keep = 3600.0
    other = await open_store(tmp_path / "data")
    for each in (store, other):
        assert await each.vanished_since(USER, INBOX, 2) is None
        assert await each.vanished_since(USER, INBOX, 3) == [2]
    await other.close()
    monkeypatch.setattr(mbox_index, "CHECKPOINT_MIN", 0)
    mf = store.mailbox_file(USER, INBOX)
    generation = mf.generation
    await store.deliver(body_for(9, 200), [Target(USER)])
    assert mf.generation > generation  # checkpointed
    await store.close()
    store = await open_store(tmp_path / "data")
    assert await store.vanished_since(USER, INBOX, 2) is None and await store.vanished_since(USER, INBOX, 3) == [2]
    await store.close()


async def test_processes_changing_flags_at_once_never_share_a_modseq(tmp_path: Path) -> None:
    root = tmp_path / "data"
    store = await store_with_user(root)
    ids = list(await deliver_some(store, 60))
    await store.assign_uids(USER, INBOX, ids)
    start = await store.highest_modseq(USER, INBOX)
    await store.close()
    scripts = [[{"do": "flags", "ids": [str(i)], "flags": [f"$w{w}"], "mode": "add"} for i in ids[w::3]]
               for w in range(3)]
    run_workers_at_once(root, scripts, {"_checkpoint_min": 0})
    store = await open_store(root)
    modseqs = [s.modseq for s in await listing(store)]
    assert len(set(modseqs)) == 60 and min(modseqs) > start  # sixty calls, sixty MODSEQs
    assert await store.highest_modseq(USER, INBOX) == max(modseqs) == start + 60
    await store.close()


# ----------------------------------------------------------------------------- compaction


@pytest.mark.parametrize("method", ["auto", "rewrite"])
async def test_compaction_reclaims_space_and_keeps_contents_and_flags(tmp_path: Path, method: str) -> None:
    store = await store_with_user(tmp_path / "data", method=method, compact_budget=1 << 30, defrag_window=256 * 1024,
                             defrag_min_extents=2)
    bodies = await deliver_some(store, 300)
    ids = list(bodies)
    await store.store_flags(USER, INBOX, ids[::4], ["\\Seen", "$Keep"], "add")
    await store.store_flags(USER, INBOX, ids[1::9], ["\\Flagged"], "add")
    await store.assign_uids(USER, INBOX, ids)
    before = {s.id: s for s in await listing(store)}
    path = store.mailbox_paths(USER, INBOX)[0]
    size_before = path.stat().st_size
    rnd = random.Random(3)
    victims = rnd.sample(ids, 150)
    for k in range(0, 150, 10):
        await store.delete_messages(USER, INBOX, victims[k : k + 10])
    live = [i for i in ids if i not in set(victims)]
    deleted_bytes = sum(len(bodies[v]) for v in victims)
    assert path.stat().st_size < size_before - deleted_bytes * 0.6  # most of the space is back at once
    after = await listing(store)
    assert [s.id for s in after] == live
    for s in after:
        assert (s.flags, s.uid, s.internal_date) == (before[s.id].flags, before[s.id].uid, before[s.id].internal_date)
        assert await store.read_message(USER, INBOX, s.id) == bodies[s.id]
    view = python_mbox_view(path)
    assert len(view) == len(live)
    assert all(same_message(seen, bodies[i]) for (seen, _), i in zip(view, live))
    # and a rebuild from the compacted file finds the same messages and flags
    await store.close()
    store.mailbox_paths(USER, INBOX)[1].unlink()
    store = await open_store(tmp_path / "data", method=method)
    assert [(s.id, s.flags) for s in await listing(store)] == [(s.id, s.flags) for s in after]
    await store.close()


async def test_deleting_the_oldest_message_writes_a_few_kilobytes_however_large_the_mailbox(tmp_path: Path) -> None:
    require_collapse(tmp_path)
    store = await store_with_user(tmp_path / "data", defrag=False)
    big = b"x" * 200_000 + b"\n"
    first = (await store.deliver(body_for(1, 9000), [Target(USER)]))[0]
    for _ in range(100):  # 20 MB behind the first message: the "deletion distance"
        await store.deliver(big, [Target(USER)])
    path, _ = store.mailbox_paths(USER, INBOX)
    size = path.stat().st_size
    [(_, _, report)] = await store.compact(USER, INBOX)  # nothing to do yet
    assert report.reclaimed == 0
    mf = store.mailbox_file(USER, INBOX)
    report = await asyncio.to_thread(mf.delete, [first])
    assert report is not None and report.collapses == 1
    assert report.written < 3 * 4096 + 200  # a pad and a From_ line, not the 20 MB behind
    assert size - path.stat().st_size == report.reclaimed >= 4096
    assert len(await listing(store)) == 100
    await store.close()


async def test_keywords_outgrowing_their_slot_move_the_message_and_keep_it_whole(mstore: MboxStore) -> None:
    bodies = await deliver_some(mstore, 3)
    middle = list(bodies)[1]
    many = [f"$keyword{i:03d}" for i in range(60)]
    await mstore.store_flags(USER, INBOX, [middle], many, "add")
    [summary] = (await mstore.get_summaries(USER, INBOX, [middle])).values()
    assert summary.flags == set(many)
    assert [s.id for s in await listing(mstore)] == list(bodies)
    assert await mstore.read_message(USER, INBOX, middle) == bodies[middle]
    view = python_mbox_view(mstore.mailbox_paths(USER, INBOX)[0])
    assert len(view) == 3  # the old copy is gone, not shown twice


# ----------------------------------------------------------------------------- locking across processes

WORKER_BODY = r"""
import asyncio, json, os, sys
sys.path.insert(0, os.environ["REPO"])
from cassmail.config import MboxSettings
from cassmail.store.mbox import MboxStore
from cassmail.store.base import Target
from tests.mbox_messages import body_for, USER

def say(kind, **fields):
    print(json.dumps({"kind": kind, **fields}), flush=True)

async def main(root, script, settings):
    if "_checkpoint_min" in settings:  # checkpoint the index often, to crash in the middle of one too
        import cassmail.store.mbox_index
        cassmail.store.mbox_index.CHECKPOINT_MIN = settings.pop("_checkpoint_min")
    store = MboxStore(MboxSettings(path=root, **settings))
    await store.open()
    for op in script:
        say("begin", op=op)
        if op["do"] == "deliver":
            [message_id] = await store.deliver(body_for(op["n"]), [Target(USER)])
            say("ack", op=op, id=str(message_id))
            continue
        if op["do"] == "flags":
            await store.store_flags(USER, "INBOX", [__import__("uuid").UUID(i) for i in op["ids"]], op["flags"], op["mode"])
        elif op["do"] == "delete":
            await store.delete_messages(USER, "INBOX", [__import__("uuid").UUID(i) for i in op["ids"]])
        elif op["do"] == "compact":
            await store.compact(USER, "INBOX")
        elif op["do"] == "claim":
            say("ack", op=op, before=await store.claim_recent(USER, "INBOX", op["below"]))
            continue
        elif op["do"] == "loop":
            n = op["n"]
            while True:
                n += 1
                say("begin", op={"do": "deliver", "n": n})
                [message_id] = await store.deliver(body_for(n), [Target(USER)])
                say("ack", op={"do": "deliver", "n": n}, id=str(message_id))
                if n % 3 == 0:
                    live = [s.id async for s in store.list_messages(USER, "INBOX")]
                    doomed = [str(i) for i in live[: len(live) // 3]]
                    say("begin", op={"do": "delete", "ids": doomed})
                    await store.delete_messages(USER, "INBOX", [__import__("uuid").UUID(i) for i in doomed])
                    say("ack", op={"do": "delete", "ids": doomed})
        say("ack", op=op)
    await store.close()
"""

#: Run once: the worker for the arguments on its command line.
WORKER = WORKER_BODY + """
asyncio.run(main(sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])))
"""

#: Many runs from one interpreter (the imports paid once): for each job line on stdin
#: (root, script, settings, crash point, output files), a forked child runs the worker with its
#: stdout and stderr in the files, and one line back says how the child ended.
FORK_SERVER = WORKER_BODY + """
import traceback
import cassmail.store.mbox_fs as mbox_fs
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        for fd, name in ((1, job["out"]), (2, job["err"])):
            os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
        mbox_fs._crash_countdown = job["crash_at"]
        code = 0
        try:
            asyncio.run(main(job["root"], job["script"], job["settings"]))
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)
"""


def worker_env() -> dict[str, str]:
    """The environment of a worker process: this repository importable, no crash point set."""
    env = {**os.environ, "REPO": str(REPO), "PYTHONPATH": str(REPO)}
    env.pop("CASSMAIL_MBOX_CRASH_AT", None)
    return env


class ForkServer:
    """One FORK_SERVER process: a worker run costs a fork, not an interpreter and its imports."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", FORK_SERVER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=worker_env(), text=True)

    def run(self, root: Path, script: list[dict[str, Any]], settings: dict[str, Any],
            crash_at: int | None) -> tuple[int, bytes, bytes]:
        out, err = root.parent / f"{root.name}.out", root.parent / f"{root.name}.err"
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"root": str(root), "script": script, "settings": settings,
                                          "crash_at": crash_at, "out": str(out), "err": str(err)}) + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        assert reply, "the fork server died"
        code = json.loads(reply)["code"]
        result = code, out.read_bytes(), err.read_bytes()
        out.unlink(), err.unlink()
        return result

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture
def fork_server() -> Iterator[ForkServer]:
    server = ForkServer()
    yield server
    server.close()


def run_worker(root: Path, script: list[dict[str, Any]], settings: dict[str, Any], crash_at: int | None = None,
               kill_after: float | None = None,
               server: ForkServer | None = None) -> tuple[int, list[dict[str, Any]], str]:
    """Run the worker (in a child of `server` if given, else in an interpreter of its own, killed
    after `kill_after` seconds if given); (exit code, its begin/ack events, the crash point it died
    at or "")."""
    if server is not None:
        assert kill_after is None
        code, out, err = server.run(root, script, settings, crash_at)
    else:
        env = worker_env()
        if crash_at is not None:
            env["CASSMAIL_MBOX_CRASH_AT"] = str(crash_at)
        proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, str(root), json.dumps(script), json.dumps(settings)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        )
        if kill_after is not None:
            time.sleep(kill_after)
            proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
        code = proc.returncode
    if code not in (0, -signal.SIGKILL):
        raise AssertionError(f"worker failed ({code}): {err.decode()[-3000:]}")
    events = []
    for line in out.decode().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut by the kill
    crashed = [line for line in err.decode().splitlines() if line.startswith("cassmail: crash point ")]
    return code, events, crashed[-1].removeprefix("cassmail: crash point ") if crashed else ""


@dataclass
class Numbering:
    """The base state's UIDs and MODSEQs (every base message is numbered, at one MODSEQ)."""

    uidvalidity: int
    uids: dict[uuid.UUID, int]
    modseq: int  # every base message's, and HIGHESTMODSEQ then


class Model:
    """What the mailbox must hold: every acknowledged operation applied; the one in flight when
    the writer died may have happened or not (but wholly: a deletion is one index record).
    MODSEQs too: a base message keeps its MODSEQ until an acknowledged flag change changes its
    flags, and then has one above the base's; the UIDs of deleted base messages are remembered
    as vanished (the deletion in flight: all of them or none)."""

    def __init__(self, messages: dict[uuid.UUID, tuple[bytes, frozenset[str]]], numbering: Numbering) -> None:
        self.messages = dict(messages)
        self.in_flight: dict[str, Any] | None = None
        self.numbering = numbering
        self.touched: set[uuid.UUID] = set()  # base messages an acknowledged flag change changed
        self.vanished: set[int] = set()  # UIDs of base messages deleted by acknowledged deletions

    def replay(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            op = event["op"]
            if event["kind"] == "begin":
                self.in_flight = op
                continue
            self.in_flight = None
            if op["do"] == "deliver":
                self.messages[uuid.UUID(event["id"])] = (body_for(op["n"]), frozenset())
            elif op["do"] == "flags":
                before = dict(self.messages)
                self.apply_flags(self.messages, op)
                self.touched |= {i for i in before if i in self.numbering.uids and before[i] != self.messages[i]}
            elif op["do"] == "delete":
                for i in op["ids"]:
                    if self.messages.pop(uuid.UUID(i), None) is not None and uuid.UUID(i) in self.numbering.uids:
                        self.vanished.add(self.numbering.uids[uuid.UUID(i)])

    @staticmethod
    def apply_flags(messages: dict[uuid.UUID, tuple[bytes, frozenset[str]]], op: dict[str, Any]) -> None:
        for i in op["ids"]:
            key = uuid.UUID(i)
            if key in messages:
                body, flags = messages[key]
                new = set(op["flags"])
                messages[key] = (body, frozenset(new if op["mode"] == "set" else flags | new if op["mode"] == "add" else flags - new))

    async def check(self, store: MboxStore) -> None:
        found = {s.id: s for s in await listing(store)}
        expected = dict(self.messages)
        op = self.in_flight or {}
        if op.get("do") == "deliver":
            extra = set(found) - set(expected)
            assert len(extra) <= 1, "at most the delivery in flight may have landed"
            for i in extra:
                expected[i] = (body_for(op["n"]), frozenset())
        if op.get("do") == "delete":
            doomed = {uuid.UUID(i) for i in op["ids"]} & set(expected)
            gone = doomed - set(found)
            assert gone in (set(), doomed), "a deletion applies wholly or not at all"
            for i in gone:
                expected.pop(i)
        assert set(found) == set(expected), (set(found) ^ set(expected), op)
        flagged_alternative = dict(expected)
        if op.get("do") == "flags":
            self.apply_flags(flagged_alternative, op)
        for message_id, summary in found.items():
            body, flags = expected[message_id]
            assert summary.flags in (flags, flagged_alternative[message_id][1]), (message_id, summary.flags, flags)
            assert await store.read_message(USER, INBOX, message_id) == body
        await self.check_modseqs(store, found, op)

    async def check_modseqs(self, store: MboxStore, found: dict[uuid.UUID, Any], op: dict[str, Any]) -> None:
        highest = await store.highest_modseq(USER, INBOX)
        if (await store.mailbox_info(USER, INBOX)).uidvalidity != self.numbering.uidvalidity:
            # an index rebuilt from the mbox alone: UIDs, MODSEQs and expunges start again
            assert highest == 1 and await store.vanished_since(USER, INBOX, 0) == []
            assert all(s.uid is None and s.modseq is None for s in found.values())
            return
        base = self.numbering
        maybe = {uuid.UUID(i) for i in op.get("ids", ())} if op.get("do") == "flags" else set()
        for message_id, summary in found.items():
            if message_id not in base.uids:
                assert summary.uid is None and summary.modseq is None, summary
            elif message_id in self.touched:
                assert summary.uid == base.uids[message_id] and base.modseq < summary.modseq <= highest, summary
            else:
                assert summary.uid == base.uids[message_id], summary
                changed = message_id in maybe and base.modseq < summary.modseq <= highest  # by the change in flight
                assert summary.modseq == base.modseq or changed, summary
        vanished = await store.vanished_since(USER, INBOX, base.modseq)
        assert vanished is not None and vanished == sorted(vanished)
        extra = set(vanished) - self.vanished
        deleting = [uuid.UUID(i) for i in op["ids"]] if op.get("do") == "delete" else []
        doomed = {base.uids[i] for i in deleting if i in base.uids} - self.vanished
        assert self.vanished <= set(vanished) and extra in (set(), doomed), (vanished, self.vanished, op)
        assert not set(vanished) & {s.uid for s in found.values()}
        assert highest >= base.modseq + bool(self.touched or self.vanished)

    async def settle(self, store: MboxStore) -> None:
        """Take what the store holds as the model, deciding the operation in flight."""
        found = await listing(store)
        self.messages = {s.id: (await store.read_message(USER, INBOX, s.id), s.flags) for s in found}
        self.touched = {s.id for s in found if s.modseq is not None and s.modseq > self.numbering.modseq}
        self.vanished = set(await store.vanished_since(USER, INBOX, self.numbering.modseq) or ())
        self.in_flight = None


async def base_state(root: Path, settings: dict[str, Any]) -> Model:
    """24 messages, numbered (the script's deliveries are not)."""
    store = await store_with_user(root, **settings)
    messages = {}
    for n in range(1000, 1024):
        body = body_for(n)
        [message_id] = await store.deliver(body, [Target(USER)])
        messages[message_id] = (body, frozenset())
    uids = await store.assign_uids(USER, INBOX, list(messages))
    numbering = Numbering((await store.mailbox_info(USER, INBOX)).uidvalidity, uids,
                          await store.highest_modseq(USER, INBOX))
    assert {s.modseq for s in await listing(store)} == {numbering.modseq}
    await store.close()
    return Model(messages, numbering)


async def verify_everywhere(root: Path, model: Model, settings: dict[str, Any]) -> None:
    """The model holds after recovery, after a full compaction, for Python's mailbox module, and
    after a rebuild of the index from the mbox alone."""
    store = await open_store(root, **settings)
    await model.check(store)
    await store.compact(USER, INBOX)
    await model.check(store)
    # Python's mailbox module sees the same messages (in file order, which is delivery order,
    # not necessarily id order when several processes deliver at once).
    view = python_mbox_view(store.mailbox_paths(USER, INBOX)[0])
    bodies = [await store.read_message(USER, INBOX, s.id) for s in await listing(store)]
    assert sorted(seen for seen, _ in view) == sorted(b if b.endswith(b"\n") else b + b"\n" for b in bodies)
    await store.close()
    store.mailbox_paths(USER, INBOX)[1].unlink()
    store = await open_store(root, **settings)
    await model.check(store)
    await store.close()


CRASH_SETTINGS: dict[str, dict[str, Any]] = {
    "collapse": {"method": "auto", "defrag_window": 1024 * 1024, "defrag_min_extents": 2, "compact_budget": 1 << 30,
                 "_checkpoint_min": 0},
    "rewrite": {"method": "rewrite", "compact_budget": 1 << 30},
}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["collapse", "rewrite"])
async def test_a_writer_killed_at_every_step_loses_nothing_acknowledged(tmp_path: Path, method: str,
                                                                       fork_server: ForkServer) -> None:
    if method == "collapse":
        require_collapse(tmp_path)  # the collapse steps are among the crash points it must reach
    settings = CRASH_SETTINGS[method]
    base = tmp_path / "base"
    start = await base_state(base, settings)
    ids = [str(i) for i in start.messages]
    script = [
        {"do": "deliver", "n": 1},
        {"do": "flags", "ids": ids[0:6], "flags": ["\\Seen", "$A"], "mode": "add"},
        {"do": "delete", "ids": ids[2:9]},  # a run of neighbours: one collapse with a pad
        {"do": "deliver", "n": 2},
        {"do": "flags", "ids": ids[10:11], "flags": [f"$k{i:03d}" for i in range(40)], "mode": "add"},  # moves it
        {"do": "delete", "ids": ids[12:13] + ids[15:16] + ids[22:24]},
        {"do": "flags", "ids": ids[0:3], "flags": ["\\Seen"], "mode": "remove"},
        {"do": "compact"},
    ]
    # The crash points are independent runs, so a few run at once, each on its own copy and in its own fork
    # server (a server runs one job at a time, over one pipe): the workers run in threads while the event
    # loop verifies what another one left. Points are handed out in order, and a runner stops only at a
    # point beyond a run that completed, so every point before the first completion is run and verified.
    points = itertools.count(1)
    completed: list[int] = []
    crashed: dict[int, str] = {}

    async def runner(server: ForkServer) -> None:
        for crash_at in points:
            if completed and crash_at > min(completed):
                return
            assert crash_at < 400, "the script never finished"
            root = tmp_path / f"run{crash_at}"
            await asyncio.to_thread(shutil.copytree, base, root)
            code, events, label = await asyncio.to_thread(run_worker, root, script, settings, crash_at=crash_at,
                                                          server=server)
            model = Model(start.messages, start.numbering)
            model.replay(events)
            await verify_everywhere(root, model, settings)
            await asyncio.to_thread(shutil.rmtree, root)
            if code == 0:
                completed.append(crash_at)
            else:
                crashed[crash_at] = label

    servers = [fork_server] + [ForkServer() for _ in range(min(os.cpu_count() or 2, 4) - 1)]
    try:
        async with asyncio.TaskGroup() as group:
            for server in servers:
                group.create_task(runner(server))
    finally:
        for server in servers[1:]:
            server.close()
    labels = [crashed[i] for i in range(1, min(completed))]
    # Every kind of step was interrupted: appends (also torn in the middle), index records, flag
    # slots, deletion marks, checkpoints and, per method, collapses and pads or the tail rewrite.
    wanted = {"torn write", "append.written", "append.synced", "index.appended", "flags.written", "delete.marked",
              "compact.begun", "compact.synced"}
    wanted |= (
        {"compact.collapsed", "compact.absorbed", "defrag.moved", "checkpoint.before", "checkpoint.renamed"}
        if method == "collapse"
        else {"rewrite.copied"}
    )
    assert wanted <= set(labels), wanted - set(labels)
    print(f"{len(labels)} crash points: " + ", ".join(sorted(set(labels))))


@pytest.mark.slow
async def test_a_compactor_killed_at_random_moments_loses_nothing_acknowledged(tmp_path: Path) -> None:
    settings = CRASH_SETTINGS["collapse"]
    root = tmp_path / "data"
    model = await base_state(root, settings)
    rnd = random.Random(11)
    for round_ in range(8):
        code, events, _ = run_worker(root, [{"do": "loop", "n": 2000 + 1000 * round_}], settings,
                                     kill_after=rnd.uniform(0.6, 1.5))
        assert code == -signal.SIGKILL
        model.replay(events)
        store = await open_store(root, **settings)
        await model.check(store)
        await model.settle(store)  # the operation in flight decided, the next round starts from a known state
        await store.close()
    await verify_everywhere(root, model, settings)


async def test_deliveries_and_deletions_from_several_processes_interleave_safely(tmp_path: Path) -> None:
    settings = CRASH_SETTINGS["collapse"]
    root = tmp_path / "data"
    model = await base_state(root, settings)
    scripts = [
        [{"do": "deliver", "n": 100 * w + n} for n in range(25)] for w in range(3)
    ]
    ids = [str(i) for i in model.messages]
    scripts.append([{"do": "delete", "ids": [i]} for i in ids[:20]] + [{"do": "compact"}])
    for events in run_workers_at_once(root, scripts, settings):
        model.replay(events)
    assert len(model.messages) == 24 - 20 + 75
    await verify_everywhere(root, model, settings)


async def test_recent_claims_from_several_processes_give_each_uid_to_one_and_survive_checkpoints(
    tmp_path: Path,
) -> None:
    """Three processes claim \\Recent at once, each up to a growing UIDNEXT as a session would, with
    the index checkpointed every few records: each UID is owned by exactly one claim."""
    root = tmp_path / "data"
    await (await store_with_user(root)).close()
    rnd = random.Random(7)
    scripts = [[{"do": "claim", "below": b} for b in sorted(rnd.sample(range(2, 300), 40))] for _ in range(3)]
    results = run_workers_at_once(root, scripts, {"_checkpoint_min": 0})
    claims = [(e["op"]["below"], e["before"]) for events in results for e in events if e["kind"] == "ack"]
    assert len(claims) == 120
    highest = max(below for below, _ in claims)
    assert sorted(recent_owners(claims)) == list(range(1, highest))
    store = await open_store(root)
    assert await store.recent_mark(USER, INBOX) == highest
    assert store.mailbox_file(USER, INBOX).generation > 1  # claims were checkpointed meanwhile
    await store.close()


def run_workers_at_once(
    root: Path, scripts: list[list[dict[str, Any]]], settings: dict[str, Any]
) -> list[list[dict[str, Any]]]:
    """Run one worker process per script, all at once; the events each printed."""
    env = worker_env()
    procs = [
        subprocess.Popen([sys.executable, "-c", WORKER, str(root), json.dumps(s), json.dumps(settings)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        for s in scripts
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()[-2000:]
        results.append([json.loads(line) for line in out.decode().splitlines()])
    return results


async def test_a_writer_waits_for_another_tools_fcntl_lock_and_gives_up_in_time(tmp_path: Path) -> None:
    store = await store_with_user(tmp_path / "data", lock_timeout=0.5)
    path = store.mailbox_paths(USER, INBOX)[0]
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl,sys,time; f=open(sys.argv[1],'r+'); fcntl.lockf(f, fcntl.LOCK_EX); "
         "print('locked', flush=True); time.sleep(float(sys.argv[2]))", str(path), "1.5"],
        stdout=subprocess.PIPE,
    )
    assert holder.stdout is not None and holder.stdout.readline() == b"locked\n"
    with pytest.raises(StoreUnavailable):
        await store.deliver(b"blocked\n", [Target(USER)])
    holder.wait()
    [message_id] = await store.deliver(b"after\n", [Target(USER)])
    assert await store.read_message(USER, INBOX, message_id) == b"after\n"
    await store.close()


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_changes_and_arrivals_kept_by_modseq_agree_with_a_pass_over_every_message(
        tmp_path: Path, monkeypatch, seed: int) -> None:
    """What changed above a MODSEQ and what arrived (kept as changes are applied, not found by a
    pass over every message) is what such a pass finds, in two stores on one directory (each
    replaying the other's records) through deliveries, numbering, flag changes that move a
    message (its keywords outgrow their slot), deletions, compactions and checkpoints."""
    monkeypatch.setattr(mbox_index, "CHECKPOINT_MIN", 2048)
    rng = random.Random(seed)
    one = await store_with_user(tmp_path / "data", keyword_reserve=8)
    two = await open_store(tmp_path / "data", keyword_reserve=8)
    stores = [one, two]
    try:
        for step in range(160):
            store = rng.choice(stores)
            live = [s.id for s in await listing(store)]
            action = rng.random()
            if action < 0.3 or not live:
                await store.deliver(b"Subject: %d\n\nbody\n" % step, [Target(USER)])
            elif action < 0.5:
                await store.assign_uids(USER, INBOX, rng.sample(live, rng.randint(1, len(live))))
            elif action < 0.75:
                flags = rng.choice([["\\Seen"], ["$Label%d" % rng.randint(1, 99)], ["$AVeryLongKeywordThatMoves%d" % step]])
                await store.store_flags(USER, INBOX, rng.sample(live, rng.randint(1, min(3, len(live)))), flags,
                                        rng.choice(["add", "remove", "set"]))
            elif action < 0.9:
                await store.delete_messages(USER, INBOX, rng.sample(live, 1))
            else:
                await store.compact(USER, INBOX)
            for reader in stores:
                every = await listing(reader)
                highest = await reader.highest_modseq(USER, INBOX)
                for mark in {0, 1, rng.randint(0, highest), max(highest - 2, 0), highest}:
                    changed = await reader.changed_since(USER, INBOX, mark)
                    assert [s.id for s in changed] == [
                        s.id for s in every if s.uid is not None and s.modseq is not None and s.modseq > mark]
                    assert changed == [s for s in every if s.id in {c.id for c in changed}]
                    arrived, now = await reader.arrivals(USER, INBOX, mark)
                    assert now == highest
                    assert [s.id for s in arrived] == [
                        s.id for s in every if s.uid is None or (s.modseq is not None and s.modseq > mark)]
    finally:
        await one.close()
        await two.close()


async def test_reads_run_on_the_event_loop_only_while_nothing_has_to_be_waited_for(tmp_path: Path) -> None:
    """Reads of an open mailbox run in the caller's thread while its lock is free and its bytes
    are in the page cache; another tool's lock, or bytes only on disk, send them to a thread
    (the event loop goes on meanwhile) and they still give the right answer."""
    store = await store_with_user(tmp_path / "data", lock_timeout=30.0)
    body = b"Subject: read\n\n" + b"x" * 300_000 + b"\n"
    [message_id] = await store.deliver(body, [Target(USER)])
    assert await store.read_message(USER, INBOX, message_id) == body  # the mailbox is open here now
    loop_thread = threading.get_ident()
    threads: list[int] = []
    original = mbox_index.MailboxFile.read_step

    def read_step(self: mbox_index.MailboxFile, state: mbox_index.ReadState) -> bytes | None:
        threads.append(threading.get_ident())
        return original(self, state)

    mbox_index.MailboxFile.read_step = read_step  # type: ignore[method-assign]
    try:
        assert await store.read_message(USER, INBOX, message_id) == body
        assert threads and set(threads) == {loop_thread}  # cached bytes, a free lock: no thread
        threads.clear()
        path = store.mailbox_paths(USER, INBOX)[0]
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # (clean pages: the delivery was fsync'd)
            evicted = mbox_fs.pread_cached(fd, 4096, path.stat().st_size - 4096) is None  # (tmpfs keeps them)
        finally:
            os.close(fd)
        assert await store.read_message(USER, INBOX, message_id) == body
        assert any(t != loop_thread for t in threads) or not evicted  # bytes read from the disk: in a thread
        holder = subprocess.Popen(
            [sys.executable, "-c", "import fcntl,sys; f=open(sys.argv[1],'r+'); fcntl.lockf(f, fcntl.LOCK_EX); "
             "print('locked', flush=True); sys.stdin.readline()", str(path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        try:
            assert holder.stdout is not None and holder.stdout.readline() == b"locked\n"
            reading = asyncio.create_task(listing(store))
            ticks = 0
            for _ in range(20):  # the event loop is not held by the read that waits
                await asyncio.sleep(0.01)
                ticks += 1
            assert ticks == 20 and not reading.done()
        finally:
            release(holder)
        assert [s.id for s in await asyncio.wait_for(reading, 10)] == [message_id]
    finally:
        mbox_index.MailboxFile.read_step = original  # type: ignore[method-assign]
    await store.close()


#: Another mbox tool holding `<mbox>.lock` the classic way (O_EXCL create, its pid inside) until
#: told to let go on stdin.
DOTLOCK_HOLDER = r"""
import os, sys
lock = sys.argv[1]
fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
os.write(fd, b"%d\n" % os.getpid())
os.close(fd)
print("locked", flush=True)
sys.stdin.readline()
os.unlink(lock)
"""


def hold_dotlock(lock: Path) -> subprocess.Popen[bytes]:
    holder = subprocess.Popen([sys.executable, "-c", DOTLOCK_HOLDER, str(lock)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
    assert holder.stdout is not None and holder.stdout.readline() == b"locked\n"
    return holder


def release(holder: subprocess.Popen[bytes]) -> None:
    assert holder.stdin is not None
    holder.stdin.write(b"go\n")
    holder.stdin.close()
    assert holder.wait(10) == 0


async def test_a_delivery_waits_while_a_live_process_holds_the_dotlock(tmp_path: Path) -> None:
    store = await store_with_user(tmp_path / "data", lock_timeout=30.0)
    [before] = await store.deliver(b"before\n", [Target(USER)])
    path = store.mailbox_paths(USER, INBOX)[0]
    lock = Path(str(path) + ".lock")
    holder = hold_dotlock(lock)
    try:
        delivery = asyncio.create_task(store.deliver(b"waited for the lock\n", [Target(USER)]))
        await asyncio.sleep(1.0)
        assert not delivery.done()  # still waiting: the holder is alive, its lock is not broken
        assert lock.read_text() == f"{holder.pid}\n"
        assert b"waited for the lock" not in path.read_bytes()
    finally:
        release(holder)
    [message_id] = await asyncio.wait_for(delivery, 10)
    assert [s.id for s in await listing(store)] == [before, message_id]
    assert await store.read_message(USER, INBOX, message_id) == b"waited for the lock\n"
    assert not lock.exists()  # the store released its own dot-lock too
    assert [seen for seen, _ in python_mbox_view(path)] == [b"before\n", b"waited for the lock\n"]
    await store.close()


async def test_a_delivery_gives_up_after_lock_timeout_while_the_dotlock_is_held(tmp_path: Path) -> None:
    store = await store_with_user(tmp_path / "data", lock_timeout=0.5)
    [before] = await store.deliver(b"before\n", [Target(USER)])
    path = store.mailbox_paths(USER, INBOX)[0]
    lock = Path(str(path) + ".lock")
    size = path.stat().st_size
    holder = hold_dotlock(lock)
    try:
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match=rf"^mailbox busy: .*{re.escape(str(lock))} held for more than 0\.5 s$"):
            await store.deliver(b"refused\n", [Target(USER)])
        assert 0.5 <= time.monotonic() - started < 10
        assert lock.read_text() == f"{holder.pid}\n"  # a live holder's lock is never broken
        assert path.stat().st_size == size  # nothing was written
    finally:
        release(holder)
    assert [s.id for s in await listing(store)] == [before]
    [after] = await store.deliver(b"after\n", [Target(USER)])  # the sender's retry, once the lock is free
    assert [s.id for s in await listing(store)] == [before, after]
    await store.close()


async def test_numbering_and_recent_claims_go_on_while_another_tool_holds_the_dotlock(tmp_path: Path) -> None:
    """The dot-lock guards the mbox file against older mbox tools; numbering and \\Recent claims
    append to the index alone, so they neither take it nor wait for it. A flag change writes the
    mbox's X-Status and waits as a delivery does."""
    store = await store_with_user(tmp_path / "data", lock_timeout=0.5)
    ids = list(await deliver_some(store, 2))
    path = store.mailbox_paths(USER, INBOX)[0]
    lock = Path(str(path) + ".lock")
    holder = hold_dotlock(lock)
    try:
        assert await store.assign_uids(USER, INBOX, ids) == {ids[0]: 1, ids[1]: 2}
        assert await store.claim_recent(USER, INBOX, 3) == 1
        with pytest.raises(StoreUnavailable, match="held for more than 0.5 s"):
            await store.store_flags(USER, INBOX, ids[:1], ["\\Seen"], "add")
        assert lock.read_text() == f"{holder.pid}\n"
    finally:
        release(holder)
    assert await store.recent_mark(USER, INBOX) == 3
    assert [(s.uid, s.flags) for s in await listing(store)] == [(1, frozenset()), (2, frozenset())]
    await store.close()


class Syncs:
    """Counts fdatasync calls per file (by the name the descriptor points at), calling the real one."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.files: list[str] = []
        real = os.fdatasync

        def counted(fd: int) -> None:
            self.files.append(Path(os.readlink(f"/proc/self/fd/{fd}")).name)
            real(fd)

        monkeypatch.setattr(os, "fdatasync", counted)

    def take(self) -> list[str]:
        taken, self.files = sorted(self.files), []
        return taken


async def test_each_write_syncs_what_its_acknowledgement_needs_and_no_more(mstore: MboxStore, monkeypatch) -> None:
    """An APPEND's message and its UID: the mbox once, the index once (one record pair). A flag
    change: the index, whose record is the change. A \\Recent claim: nothing of its own (lost
    to a power cut, its messages are only recent once more)."""
    [before] = list(await deliver_some(mstore, 1))
    await mstore.assign_uids(USER, INBOX, [before])
    syncs = Syncs(monkeypatch)
    appended = await mstore.append(b"appended\n", Target(USER, INBOX, frozenset({"\\Draft"})))
    message_id = appended.id
    assert appended.uid == 2 and syncs.take() == ["index", "mbox"]
    await mstore.store_flags(USER, INBOX, [message_id], ["\\Seen"], "add")
    assert syncs.take() == ["index"]
    assert await mstore.claim_recent(USER, INBOX, 3) == 1
    assert syncs.take() == []
    await mstore.close()
    # what a reader of the files finds (the process ended; no sync was asked for on the way)
    store = await open_store(mstore.root)
    assert [(s.uid, s.flags) for s in await listing(store)] == [(1, frozenset()), (2, frozenset({"\\Draft", "\\Seen"}))]
    assert await store.recent_mark(USER, INBOX) == 3
    # the slots in the mbox say so too (Status R: seen, O: old; X-Status T: draft)
    assert set(python_mbox_view(store.mailbox_paths(USER, INBOX)[0])[1][1]) - {" "} == set("ROT")
    await store.close()


async def test_a_dotlock_is_a_fresh_link_to_the_processs_own_pid_file(mstore: MboxStore, tmp_path: Path) -> None:
    """A dot-lock costs a touch, a link and an unlink: it is a hard link to one file per process
    holding its pid, touched first so that tools judging locks by their age (procmail) see a new
    one. Where no link can be made to it (another file system) a file of its own is made."""
    root = mstore.root
    lock = str(mstore.mailbox_paths(USER, INBOX)[0]) + ".lock"
    source = mbox_fs.dotlock_source(str(root))
    assert source == str(root / f".dotlock.{os.getpid()}")
    os.utime(source, (0, 0))
    mbox_fs.dotlock(lock, 1.0, source)
    try:
        assert os.stat(lock).st_ino == os.stat(source).st_ino
        assert Path(lock).read_text() == f"{os.getpid()}\n" and time.time() - os.stat(lock).st_mtime < 60
    finally:
        mbox_fs.dotunlock(lock)
    elsewhere = Path("/dev/shm")
    if elsewhere.is_dir() and os.stat(elsewhere).st_dev != os.stat(root).st_dev:
        other = mbox_fs.dotlock_source(str(elsewhere))
        try:
            mbox_fs.dotlock(lock, 1.0, other)
            assert Path(lock).read_text() == f"{os.getpid()}\n" and os.stat(lock).st_ino != os.stat(other).st_ino
            mbox_fs.dotunlock(lock)
        finally:
            os.unlink(other)
    assert not Path(lock).exists()
    # a write by the store leaves no lock behind and the pid file where it was
    [message_id] = await mstore.deliver(b"locked and unlocked\n", [Target(USER)])
    assert await mstore.read_message(USER, INBOX, message_id) == b"locked and unlocked\n"
    assert not Path(lock).exists() and Path(source).exists()
    # the pid files of processes that no longer run are removed when a store opens
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (root / f".dotlock.{dead.pid}").write_text(f"{dead.pid}\n")
    await (await open_store(root)).close()
    assert not (root / f".dotlock.{dead.pid}").exists() and Path(source).exists()


async def test_a_stale_dotlock_of_a_dead_process_is_broken(mstore: MboxStore) -> None:
    path = mstore.mailbox_paths(USER, INBOX)[0]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    Path(str(path) + ".lock").write_text(f"{dead.pid}\n")
    [message_id] = await mstore.deliver(b"through\n", [Target(USER)])
    assert await mstore.read_message(USER, INBOX, message_id) == b"through\n"
    assert not Path(str(path) + ".lock").exists()


async def test_a_long_download_survives_a_compaction_between_its_chunks(mstore: MboxStore) -> None:
    first = await deliver_some(mstore, 10)
    body = os.urandom(3 * 1024 * 1024)
    [big] = await mstore.deliver(body, [Target(USER)])
    stream = mstore.read_chunks(USER, INBOX, big)
    got = [await stream.__anext__()]
    await mstore.delete_messages(USER, INBOX, list(first))  # collapses ranges before the message
    got += [c async for c in stream]
    assert b"".join(got) == body
    with pytest.raises(NoSuchMessage):
        await mstore.read_message(USER, INBOX, next(iter(first)))


# ----------------------------------------------------------------------------- command line


def test_store_compact_runs_from_the_command_line(tmp_path: Path) -> None:
    root = tmp_path / "data"

    async def prepare() -> None:
        store = await store_with_user(root, compact_on_delete=False)
        bodies = await deliver_some(store, 40)
        await store.delete_messages(USER, INBOX, list(bodies)[:20])
        await store.close()

    asyncio.run(prepare())
    size = MboxStore(MboxSettings(path=str(root))).mailbox_paths(USER, INBOX)[0].stat().st_size
    env = {**os.environ, "CASSMAIL_STORE_BACKEND": "mbox", "CASSMAIL_STORE_MBOX_PATH": str(root)}
    result = subprocess.run([sys.executable, "-m", "cassmail.cli", "store", "compact"], capture_output=True, env=env,
                            cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr.decode()
    out = result.stdout.decode()
    assert USER in out and "INBOX" in out
    after = MboxStore(MboxSettings(path=str(root))).mailbox_paths(USER, INBOX)[0].stat().st_size
    assert after < size
