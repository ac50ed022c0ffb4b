"""The WheelFS store's own promises: its layout on disk, what the file system may do to it
(timeouts, entries missing from listings, deleted files coming back, entries under new
names), UIDs from two processes, and what a delivery and an IMAP check cost in file-system
operations. Faults come from a FileSystem subclass: the store's one door to the disk. The tests
never change the store's directories behind its back: a stale replica, a merge's duplicate or a
renamed entry is what the file-system layer shows the store, as WheelFS would."""

from __future__ import annotations

import asyncio
import errno
import json
import multiprocessing
import os
import shutil
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from cassmail.auth import hash_password
from cassmail.config import WheelFSSettings
from cassmail.model import INBOX, sortable_id
from cassmail.store.base import NoSuchMessage, StoreUnavailable, Target
from cassmail.store.wheelfs import WheelFSStore
from cassmail.store.wheelfs_fs import FileSystem
from tests.conftest import FAST_HASH
from tests.contract.test_store_contract import recent_owners

USER = "anne@wheel.example"
BODY = b"From: a@x.example\r\nSubject: w\r\n\r\nbody\r\n"


class FaultyFS(FileSystem):
    """The real file system, with the faults a wide-area file system shows, switched on by tests.

    - `stall` / `error`: an operation hangs or fails (a server that does not answer);
    - `hidden`: entries missing from listings (a replica that has not seen them yet);
    - `bring_back`: a stale replica's copy of a directory merged in by union, as WheelFS merges
      `.EventualConsistency` directories: every entry it holds is listed again and reads as the
      replica has it, until the name is removed;
    - `show_duplicate`: an entry listed a second time under a new name (both names reach one file);
    - `show_renamed`: an entry listed only under a new name (the old name reaches nothing).
    """

    def __init__(self) -> None:
        super().__init__()
        self.hidden: set[str] = set()  # name fragments left out of every listing
        self.stall: Callable[[str, str], bool] = lambda op, path: False
        self.stall_seconds = 0.0
        self.error: Callable[[str, str], bool] = lambda op, path: False
        self.error_code, self.error_text = errno.ETIMEDOUT, "injected: the file server did not answer"
        self.replica: dict[str, str] = {}  # a store path -> the stale replica's copy of it
        self.duplicates: dict[str, str] = {}  # a name a merge made -> the store path it duplicates
        self.renamed: dict[str, str] = {}  # a store path -> the only name it is listed under now

    def before(self, op: str, path: str) -> None:
        super().before(op, path)
        if self.stall(op, path):
            time.sleep(self.stall_seconds)
        if self.error(op, path):
            raise OSError(self.error_code, self.error_text, path)

    # ------------------------------------------------------------------ faults of the namespace

    def bring_back(self, directory: Path, replica: Path) -> None:
        """Merge `replica` (an old copy of `directory`) into what `directory` shows."""
        for copy in replica.rglob("*"):
            if copy.is_file():
                self.replica[os.path.normpath(directory / copy.relative_to(replica))] = str(copy)

    def show_duplicate(self, path: Path, new_name: str) -> None:
        self.duplicates[os.path.normpath(path.with_name(new_name))] = os.path.normpath(path)

    def show_renamed(self, path: Path, new_name: str) -> None:
        self.renamed[os.path.normpath(path)] = os.path.normpath(path.with_name(new_name))

    def where(self, path: str) -> str:
        path = os.path.normpath(path)
        if path in self.duplicates:
            return self.where(self.duplicates[path])
        for old, new in self.renamed.items():
            if path == new:
                return old
            if path == old:
                return f"{old}.renamed-away-by-a-merge"  # a name nothing is under
        if path in self.replica and not os.path.lexists(path):
            return self.replica[path]
        return path

    def listed(self, path: str, names: list[str]) -> list[str]:
        path = os.path.normpath(path)
        shown = set(names)
        for extra, target in [*self.replica.items(), *self.duplicates.items()]:
            if os.path.dirname(extra) == path and os.path.lexists(target):
                shown.add(os.path.basename(extra))
        for old, new in self.renamed.items():
            if os.path.dirname(old) == path and os.path.basename(old) in shown:
                shown.discard(os.path.basename(old))
                shown.add(os.path.basename(new))
        return [n for n in sorted(shown) if not any(h in n for h in self.hidden)]

    def unlink(self, path: str, missing_ok: bool = False) -> None:
        """Removing a merge's duplicate removes that name only, not the entry it duplicates."""
        if os.path.normpath(path) in self.duplicates:
            self.before("unlink", path)
            del self.duplicates[os.path.normpath(path)]
            return
        super().unlink(path, missing_ok)


def settings_for(root: Path, **changes: object) -> WheelFSSettings:
    values = dict(root=str(root), home_site="here", rep_sites=2, sync_level=2, timeout=5.0)
    values.update(changes)
    return WheelFSSettings(**values)  # type: ignore[arg-type]


Opener = Callable[..., Awaitable[WheelFSStore]]


@pytest.fixture
async def opened() -> AsyncIterator[Opener]:
    """Opens a store on a root (another node on the same directory), closed after the test."""
    stores: list[WheelFSStore] = []

    async def open_one(root: Path, fs: FileSystem | None = None, **changes: object) -> WheelFSStore:
        store = WheelFSStore(settings_for(root, **changes), fs=fs)
        await store.open()
        stores.append(store)
        return store

    yield open_one
    for store in stores:
        await store.close()


@pytest.fixture
async def faulty(tmp_path: Path, opened: Opener) -> tuple[WheelFSStore, FaultyFS]:
    fs = FaultyFS()
    store = await opened(tmp_path, fs)
    await store.add_domain("wheel.example")
    await store.create_user(USER, hash_password("pw", FAST_HASH))
    return store, fs


async def ids_of(store: WheelFSStore, mailbox: str = INBOX) -> list[uuid.UUID]:
    return [s.id async for s in store.list_messages(USER, mailbox)]


def mail_dir(root: Path) -> Path:
    [box] = [p for p in root.rglob("*") if p.is_dir() and p.parent.name == "anne@wheel.example"
             and (p / "msg").is_dir() and any((p / "msg").iterdir())]
    return box


# ----------------------------------------------------------------------------- layout


async def test_mail_lies_under_the_cue_paths_one_write_once_file_per_message(faulty, tmp_path: Path) -> None:
    store, _ = faulty
    [a] = await store.deliver(BODY, [Target(USER, INBOX, frozenset({"\\Seen", "$Work"}))])
    box = mail_dir(tmp_path)
    # the paper's Wheemail path: the cues between the shared directory and each user's directory
    relative = box.relative_to(tmp_path).parts
    assert relative[:10] == ("cassmail", "mail", ".EventualConsistency", ".Site=here", ".KeepTogether", ".RepSites=2",
                             ".RepLevel=3", ".SyncLevel=2", USER, box.name)
    body = box / "body" / sortable_id(a)
    assert body.read_bytes() == BODY
    [marker] = os.listdir(box / "msg")
    assert marker.startswith(f"{sortable_id(a)}.{len(BODY)}.") and marker.endswith(".S")
    # accounts and UIDs live apart, in a tree without .EventualConsistency
    [account] = list(tmp_path.rglob("account"))
    assert account.relative_to(tmp_path).parts == ("cassmail", "users", ".Site=here", ".KeepTogether", ".RepSites=2",
                                                   ".RepLevel=3", USER, "account")
    # a flag change is a new file, a MODSEQ claim in the strong tree: the message file is never rewritten
    before = body.stat()
    await store.store_flags(USER, INBOX, [a], ["\\Flagged"], "add")
    after = body.stat()
    assert (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)
    assert len(os.listdir(box / "flags")) == 1  # the delivered keyword
    [claims] = [p for p in tmp_path.rglob("modseqs/*") if p.is_dir()]
    assert claims.relative_to(tmp_path).parts == ("cassmail", "users", ".Site=here", ".KeepTogether", ".RepSites=2",
                                                  ".RepLevel=3", USER, "modseqs", box.name)
    assert os.listdir(claims) == ["2"]  # the mailbox's first change: MODSEQ 2
    [summary] = [s async for s in store.list_messages(USER, INBOX)]
    assert summary.flags == {"\\Seen", "$Work", "\\Flagged"}


async def test_without_cues_the_same_store_is_plain_directories(tmp_path: Path, opened: Opener) -> None:
    store = await opened(tmp_path, cues=False)
    await store.add_domain("wheel.example")
    await store.create_user(USER, hash_password("pw", FAST_HASH))
    await store.deliver(BODY, [Target(USER)])
    assert not [p for p in tmp_path.rglob(".*") if p.name.startswith((".Eventual", ".Rep", ".Site"))]
    assert (tmp_path / "cassmail" / "users" / USER / "account").exists()
    assert (tmp_path / "cassmail" / "mail" / USER).is_dir()
    assert len(await ids_of(store)) == 1


async def test_other_cue_settings_on_a_plain_directory_are_refused_not_an_empty_store(tmp_path: Path, opened: Opener) -> None:
    store = await opened(tmp_path)
    await store.close()
    with pytest.raises(StoreUnavailable, match="store.wheelfs: the cue settings"):
        await opened(tmp_path, rep_level=2)
    with pytest.raises(StoreUnavailable, match="store.wheelfs: the cue settings"):
        await opened(tmp_path, cues=False)
    await (await opened(tmp_path)).close()  # the settings it was made with still work


# ----------------------------------------------------------------------------- faults


async def test_a_file_system_that_stops_answering_gives_store_unavailable_and_no_half_message(
    faulty, tmp_path: Path, opened: Opener
) -> None:
    store, fs = faulty
    acknowledged = {}
    for i in range(3):
        [message_id] = await store.deliver(BODY + b"%d" % i, [Target(USER)])
        acknowledged[message_id] = BODY + b"%d" % i
    uids = await store.assign_uids(USER, INBOX, list(acknowledged))
    assert sorted(uids.values()) == [1, 2, 3]
    store.settings.timeout = 0.3
    fs.stall_seconds = 1.0
    fs.stall = lambda op, path: op == "open" and f"{os.sep}msg{os.sep}" in path  # the commit itself hangs
    with pytest.raises(StoreUnavailable, match="no answer"):
        await store.deliver(BODY + b"timed out", [Target(USER)])
    fs.stall = lambda op, path: False
    await asyncio.sleep(1.2)  # the stalled call returns after the 451: the delivery must undo itself
    store.settings.timeout = 5.0
    # what was acknowledged before the timeout is all there, byte for byte, with its UIDs
    assert await ids_of(store) == list(acknowledged)
    for message_id, body in acknowledged.items():
        assert await store.read_message(USER, INBOX, message_id) == body
    fs.error = lambda op, path: op == "readdir"
    with pytest.raises(StoreUnavailable, match="did not answer"):
        await store.list_page(USER, INBOX)
    fs.error = lambda op, path: False
    [a] = await store.deliver(BODY, [Target(USER)])  # the sender's retry
    other_node = await opened(tmp_path)  # and a node that did not live through the faults agrees
    for node in (store, other_node):
        assert await ids_of(node) == [*acknowledged, a]
        assert await node.assign_uids(USER, INBOX, [*acknowledged, a]) == {**uids, a: 4}
        for message_id, body in acknowledged.items():
            assert await node.read_message(USER, INBOX, message_id) == body


async def test_a_message_missing_from_a_listing_is_not_lost_and_gets_a_higher_uid(faulty) -> None:
    store, fs = faulty
    a, b, c = [(await store.deliver(BODY + b"%d" % i, [Target(USER)]))[0] for i in range(3)]
    fs.hidden = {sortable_id(b)}  # this replica has not seen b yet
    assert await ids_of(store) == [a, c]
    assert await store.assign_uids(USER, INBOX, [a, c]) == {a: 1, c: 2}
    fs.hidden = set()
    assert await ids_of(store) == [a, b, c]
    assert (await store.assign_uids(USER, INBOX, [a, b, c]))[b] == 3  # above every UID handed out
    assert await store.read_message(USER, INBOX, b) == BODY + b"1"


async def test_a_deleted_message_that_a_stale_replica_brings_back_stays_deleted(
    faulty, tmp_path: Path, opened: Opener
) -> None:
    store, fs = faulty
    bodies = {}
    for i, flags in enumerate([{"$Work"}, set(), set()]):
        [message_id] = await store.deliver(BODY + b"%d" % i, [Target(USER, INBOX, frozenset(flags))])
        bodies[message_id] = BODY + b"%d" % i
    a, b, c = bodies
    await store.store_flags(USER, INBOX, [a], ["\\Flagged"], "add")
    assert await store.assign_uids(USER, INBOX, [a, b, c]) == {a: 1, b: 2, c: 3}
    box = mail_dir(tmp_path)
    replica = tmp_path / "stale-replica"
    shutil.copytree(box, replica)  # a replica's copy as of now: it will not hear of the deletion
    await store.delete_messages(USER, INBOX, [a])
    # the replica comes back and is merged by union: a's marker, body and keyword record are listed again
    fs.bring_back(box, replica)
    sid = sortable_id(a)
    assert any(n.startswith(sid) for n in fs.listdir(str(box / "msg")))
    assert sid in fs.listdir(str(box / "body"))
    assert len([n for n in fs.listdir(str(box / "flags")) if n.startswith(sid)]) == 1  # \\Flagged: a MODSEQ claim
    other_node = await opened(tmp_path, fs)  # no memory of the deletion: only the tombstone
    for node in (store, other_node):
        assert await ids_of(node) == [b, c]
        with pytest.raises(NoSuchMessage):
            await node.read_message(USER, INBOX, a)
        assert await node.assign_uids(USER, INBOX, [a, b, c]) == {b: 2, c: 3}
        await node.store_flags(USER, INBOX, [a], ["\\Seen"], "add")  # a flag change brings nothing back
        assert await ids_of(node) == [b, c]
        for message_id in (b, c):
            assert await node.read_message(USER, INBOX, message_id) == bodies[message_id]
    # UID 1 went with the deleted message and is never handed out again
    [d] = await other_node.deliver(BODY + b"d", [Target(USER)])
    assert await store.assign_uids(USER, INBOX, [a, b, c, d]) == {b: 2, c: 3, d: 4}
    assert await other_node.uid_next(USER, INBOX) == 5
    # a deletion while the replica is merged in: b goes (the replica's copy of it stays hidden too)
    await other_node.delete_messages(USER, INBOX, [b])
    assert any(n.startswith(sortable_id(b)) for n in fs.listdir(str(box / "msg")))
    for node in (store, other_node, await opened(tmp_path, fs)):
        assert await ids_of(node) == [c, d]
        assert await node.read_message(USER, INBOX, d) == BODY + b"d"


async def test_an_entry_duplicated_or_renamed_by_a_merge_is_one_message(faulty, tmp_path: Path, opened: Opener) -> None:
    store, fs = faulty
    [a] = await store.deliver(BODY, [Target(USER, INBOX, frozenset({"$Work"}))])
    [b] = await store.deliver(BODY + b"b", [Target(USER)])
    assert await store.assign_uids(USER, INBOX, [a, b]) == {a: 1, b: 2}
    box = mail_dir(tmp_path)
    sid = sortable_id(a)
    marker = next(n for n in os.listdir(box / "msg") if n.startswith(sid))
    [record] = [n for n in os.listdir(box / "flags") if n.startswith(sid)]
    # the merge lists a's marker and flag record twice, and its body only under a new name
    fs.show_duplicate(box / "msg" / marker, f"{marker}#conflict-2")
    fs.show_duplicate(box / "flags" / record, f"{record}#conflict-2")
    fs.show_renamed(box / "body" / sid, f"{sid}#conflict-1")
    assert {marker, f"{marker}#conflict-2"} <= set(fs.listdir(str(box / "msg")))
    assert f"{sid}#conflict-1" in fs.listdir(str(box / "body")) and sid not in fs.listdir(str(box / "body"))
    other_node = await opened(tmp_path, fs)
    for node in (store, other_node):
        summaries = [s async for s in node.list_messages(USER, INBOX)]
        assert [(s.id, s.uid) for s in summaries] == [(a, 1), (b, 2)]
        assert summaries[0].size == len(BODY) and summaries[0].flags == {"$Work"}
        assert await node.read_message(USER, INBOX, a) == BODY
        assert await node.assign_uids(USER, INBOX, [a, b]) == {a: 1, b: 2}
    # the duplicate took no UID: the next message gets the next one
    [c] = await other_node.deliver(BODY + b"c", [Target(USER)])
    assert await store.assign_uids(USER, INBOX, [a, b, c]) == {a: 1, b: 2, c: 3}
    await other_node.delete_messages(USER, INBOX, [a])
    for node in (store, other_node, await opened(tmp_path, fs)):
        assert await ids_of(node) == [b, c]
        with pytest.raises(NoSuchMessage):
            await node.read_message(USER, INBOX, a)
        assert await node.read_message(USER, INBOX, b) == BODY + b"b"
    assert await store.uid_next(USER, INBOX) == 4


async def test_no_uid_is_reused_when_a_claimer_dies_or_its_write_fails(faulty, tmp_path: Path, opened: Opener) -> None:
    store, fs = faulty
    ids = [(await store.deliver(BODY, [Target(USER)]))[0] for _ in range(4)]
    assert await store.assign_uids(USER, INBOX, ids[:1]) == {ids[0]: 1}
    [uids] = [p for p in tmp_path.rglob("uids") if p.is_dir()]
    [claims] = list(uids.iterdir())
    # a node created claim 2 and died before writing it: readers wait, then count it as burnt
    FileSystem().write_file(str(claims / "2"), b"", exclusive=True, fsync=True)
    other_node = await opened(tmp_path, claim_timeout=30.0)
    with pytest.raises(StoreUnavailable, match="another node is assigning"):
        await other_node.assign_uids(USER, INBOX, ids[1:2])
    old = time.time() - 60
    os.utime(claims / "2", (old, old))
    assert await other_node.assign_uids(USER, INBOX, ids[1:2]) == {ids[1]: 3}
    # a claim whose fsync fails: the caller hears "unavailable", and the UID is never given to another
    fs.error = lambda op, path: op == "fsync" and f"{os.sep}uids{os.sep}" in path
    with pytest.raises(StoreUnavailable):
        await store.assign_uids(USER, INBOX, ids[2:3])
    fs.error = lambda op, path: False
    assert await other_node.assign_uids(USER, INBOX, ids) == {ids[0]: 1, ids[1]: 3, ids[2]: 4, ids[3]: 5}
    assert await store.assign_uids(USER, INBOX, ids) == {ids[0]: 1, ids[1]: 3, ids[2]: 4, ids[3]: 5}
    assert await store.uid_next(USER, INBOX) == 6


def _allocate_in_another_process(root: str, rounds: int, barrier: threading.Barrier, out: multiprocessing.Queue) -> None:
    """One 'node': deliver and assign UIDs in a loop, report what it was told."""

    async def run() -> list[tuple[str, int]]:
        store = WheelFSStore(settings_for(Path(root)))
        await store.open()
        seen: list[tuple[str, int]] = []
        try:
            barrier.wait()
            for _ in range(rounds):
                [mine] = await store.deliver(BODY, [Target(USER)])
                everything = await ids_of(store)
                for message_id, uid in (await store.assign_uids(USER, INBOX, everything)).items():
                    seen.append((message_id.hex, uid))
                assert mine in everything
        finally:
            await store.close()
        return seen

    out.put(asyncio.run(run()))


async def in_processes(target: Callable[..., None], root: Path, plans: list[Any]) -> list[Any]:
    """Run `target(root, plan, barrier, out)` in a process of its own per plan, all let go at once
    by the barrier; what each put on `out`."""
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(len(plans)), ctx.Queue()
    workers = [ctx.Process(target=target, args=(str(root), plan, barrier, out)) for plan in plans]
    for w in workers:
        w.start()
    results = [await asyncio.to_thread(out.get, True, 120) for _ in workers]
    for w in workers:
        w.join(30)
        assert w.exitcode == 0
    return results


async def test_two_processes_assigning_uids_never_give_one_twice(faulty, tmp_path: Path) -> None:
    results = await in_processes(_allocate_in_another_process, tmp_path, [25, 25])
    uid_of: dict[str, int] = {}
    for seen in results:
        for message_id, uid in seen:
            assert uid_of.setdefault(message_id, uid) == uid  # both processes were told the same UID
    assert len(uid_of) == 50
    assert sorted(uid_of.values()) == list(range(1, 51))  # no UID given twice, none skipped
    assert await store_uids(faulty[0]) == uid_of


async def store_uids(store: WheelFSStore) -> dict[str, int]:
    return {s.id.hex: s.uid async for s in store.list_messages(USER, INBOX) if s.uid is not None}


# ----------------------------------------------------------------------------- IMAP \Recent


def _claim_recent_in_another_process(
    root: str, belows: list[int], barrier: threading.Barrier, out: multiprocessing.Queue
) -> None:
    """One 'node': claim \\Recent up to each of `belows` in turn, report (below, returned)."""

    async def run() -> list[tuple[int, int]]:
        store = WheelFSStore(settings_for(Path(root)))
        await store.open()
        try:
            barrier.wait()
            return [(below, await store.claim_recent(USER, INBOX, below)) for below in belows]
        finally:
            await store.close()

    out.put(asyncio.run(run()))


async def test_two_processes_claiming_recent_give_each_uid_to_one(faulty, tmp_path: Path) -> None:
    plans = [list(range(3, 120, 3)), list(range(2, 121, 4))]  # interleaved: most claims race one another
    results = await in_processes(_claim_recent_in_another_process, tmp_path, plans)
    claims = [claim for result in results for claim in result]
    highest = max(below for below, _ in claims)
    assert sorted(recent_owners(claims)) == list(range(1, highest))
    assert await faulty[0].recent_mark(USER, INBOX) == highest


async def test_a_recent_claim_whose_claimer_died_or_failed_is_owned_by_nobody(faulty, tmp_path: Path, opened: Opener) -> None:
    store, fs = faulty
    assert await store.claim_recent(USER, INBOX, 3) == 1
    [chain] = [p for p in (tmp_path / "cassmail").rglob("recent/*") if p.is_dir()]
    # a node created the claim from 3 and died before writing it: readers wait, then skip UID 3
    FileSystem().write_file(str(chain / "3"), b"", exclusive=True, fsync=True)
    other_node = await opened(tmp_path, claim_timeout=30.0)
    with pytest.raises(StoreUnavailable, match="another node is claiming .Recent"):
        await other_node.claim_recent(USER, INBOX, 8)
    old = time.time() - 60
    os.utime(chain / "3", (old, old))
    assert await other_node.claim_recent(USER, INBOX, 8) == 4  # UID 3 is nobody's
    # a claim whose fsync fails: its caller hears "unavailable", and those UIDs go to nobody else
    fs.error = lambda op, path: op == "fsync" and f"{os.sep}recent{os.sep}" in path
    with pytest.raises(StoreUnavailable):
        await store.claim_recent(USER, INBOX, 12)
    fs.error = lambda op, path: False
    assert await other_node.claim_recent(USER, INBOX, 15) == 12
    assert await store.recent_mark(USER, INBOX) == 15
    # deleting a mailbox takes its claims along
    await store.create_mailbox(USER, "Lists")
    await store.claim_recent(USER, "Lists", 5)
    assert len([p for p in (tmp_path / "cassmail").rglob("recent/*") if p.is_dir()]) == 2
    await store.delete_mailbox(USER, "Lists")
    assert [p for p in (tmp_path / "cassmail").rglob("recent/*") if p.is_dir()] == [chain]


async def test_a_body_read_failing_after_another_node_deleted_the_message_is_no_such_message(
    faulty, tmp_path: Path, opened: Opener
) -> None:
    """Another NFS client or WheelFS replica removed the file under an open descriptor: the
    next read fails (ESTALE). A tombstone says why: the message is gone, not the store."""
    store, fs = faulty
    body = os.urandom(4 * store.settings.chunk_size)
    gone, kept = [(await store.deliver(body, [Target(USER)]))[0] for _ in range(2)]
    fs.error_code, fs.error_text = errno.ESTALE, "injected: stale file handle"
    streams = {m: store.read_chunks(USER, INBOX, m) for m in (gone, kept)}
    for stream in streams.values():
        assert await anext(stream) == body[: store.settings.chunk_size]
    await (await opened(tmp_path)).delete_messages(USER, INBOX, [gone])
    fs.error = lambda op, path: op == "read" and f"{os.sep}body{os.sep}" in path
    with pytest.raises(NoSuchMessage):
        await anext(streams[gone])
    with pytest.raises(StoreUnavailable, match="stale file handle"):  # a live message that cannot be read
        await anext(streams[kept])


# ----------------------------------------------------------------------------- MODSEQs (RFC 7162)


def _change_flags_in_another_process(root: str, plan: tuple[int, int], barrier: threading.Barrier,
                                     out: multiprocessing.Queue) -> None:
    """One 'node': each round, an unconditional flag change of its own message (then the MODSEQ
    that gave it) and a compare-and-set (UNCHANGEDSINCE the MODSEQ just read) of the shared one."""
    me, rounds = plan

    async def run() -> tuple[list[int], list[tuple[int, bool]]]:
        store = WheelFSStore(settings_for(Path(root)))
        await store.open()
        mine, cas = [], []
        try:
            ids = await ids_of(store)
            own, shared = ids[me], ids[-1]
            barrier.wait()
            for r in range(rounds):
                await store.store_flags(USER, INBOX, [own], [f"$p{me}r{r}"], "set")
                mine.append((await store.get_summaries(USER, INBOX, [own]))[own].modseq)
                seen = (await store.get_summaries(USER, INBOX, [shared]))[shared].modseq
                modified = await store.store_flags(USER, INBOX, [shared], [f"$p{me}r{r}"], "set", unchanged_since=seen)
                cas.append((seen, not modified))
        finally:
            await store.close()
        return mine, cas

    out.put(asyncio.run(run()))


async def test_two_processes_never_share_a_modseq_and_unchanged_since_lets_one_of_them_win(faulty, tmp_path: Path) -> None:
    store, _ = faulty
    ids = [(await store.deliver(BODY, [Target(USER)]))[0] for _ in range(3)]
    await store.assign_uids(USER, INBOX, ids)
    start = await store.highest_modseq(USER, INBOX)
    results = await in_processes(_change_flags_in_another_process, tmp_path, [(0, 15), (1, 15)])
    mine = [m for own, _ in results for m in own]
    # each call on its own message got a MODSEQ of its own, above the last, and no other call got it
    assert all(own == sorted(set(own)) for own, _ in results)
    assert len(set(mine)) == len(mine) == 30 and min(mine) > start
    # compare-and-set: of the calls that read one MODSEQ, one at most changed the message
    wins = [seen for _, cas in results for seen, won in cas if won]
    assert wins and len(set(wins)) == len(wins)
    assert not set(wins) & set(mine)  # a MODSEQ read on the shared message was never one of an own change
    listed = {s.id: s for s in [s async for s in store.list_messages(USER, INBOX)]}
    assert await store.highest_modseq(USER, INBOX) == max(s.modseq for s in listed.values())
    [flag] = listed[ids[2]].flags
    assert flag.startswith("$p")


async def test_a_modseq_claim_its_claimer_left_empty_is_waited_for_then_passed(faulty, tmp_path: Path, opened: Opener) -> None:
    store, fs = faulty
    ids = [(await store.deliver(BODY, [Target(USER)]))[0] for _ in range(4)]
    await store.assign_uids(USER, INBOX, ids)
    assert await store.highest_modseq(USER, INBOX) == 2
    [claims] = [p for p in tmp_path.rglob("modseqs/*") if p.is_dir()]
    # a node took MODSEQ 3 and died before writing what it sequences: readers wait, then skip it
    FileSystem().write_file(str(claims / "3"), b"", exclusive=True, fsync=True)
    other_node = await opened(tmp_path, claim_timeout=30.0)
    with pytest.raises(StoreUnavailable, match="another node is changing messages"):
        await other_node.highest_modseq(USER, INBOX)
    with pytest.raises(StoreUnavailable, match="another node is changing messages"):
        await other_node.store_flags(USER, INBOX, ids[:1], ["\\Seen"], "add")
    old = time.time() - 60
    os.utime(claims / "3", (old, old))
    assert await other_node.highest_modseq(USER, INBOX) == 3
    await other_node.store_flags(USER, INBOX, ids[:1], ["\\Seen"], "add")
    assert (await other_node.get_summaries(USER, INBOX, ids[:1]))[ids[0]].modseq == 4

    # A node dies after its change and before writing the claim that says what it was (here: the
    # write fails, as for a node gone; the claim is left empty, and counted abandoned once old).
    def abandoned(name: str) -> None:
        assert (claims / name).read_bytes() == b""
        os.utime(claims / name, (old, old))

    fs.error = lambda op, path: op == "write" and f"{os.sep}modseqs{os.sep}" in path
    with pytest.raises(StoreUnavailable):  # a flag change: nothing of it is ever visible
        await store.store_flags(USER, INBOX, ids[1:2], ["\\Flagged"], "add")
    abandoned("5")
    with pytest.raises(StoreUnavailable):  # a deletion: the message is buried, its UID not said to vanish
        await store.delete_messages(USER, INBOX, ids[2:3])
    abandoned("6")
    [late] = await store.deliver(BODY, [Target(USER)])
    with pytest.raises(StoreUnavailable):  # a numbering: its UID claim names MODSEQ claim 7
        await store.assign_uids(USER, INBOX, [late])
    abandoned("7")
    fs.error = lambda op, path: False
    for node in (other_node, await opened(tmp_path), store):
        listed = {s.id: s for s in [s async for s in node.list_messages(USER, INBOX)]}
        assert list(listed) == [ids[0], ids[1], ids[3], late]
        assert listed[ids[1]].flags == set() and listed[ids[1]].modseq == 2
        assert (listed[late].uid, listed[late].modseq) == (5, 7)
        # the first listing after the abandoned claims gave the buried message's UID a MODSEQ
        assert await node.vanished_since(USER, INBOX, 4) == [3]
        assert await node.highest_modseq(USER, INBOX) == 8


async def test_a_message_deleted_by_another_node_while_it_is_numbered_has_its_uid_vanish(
    faulty, tmp_path: Path, opened: Opener
) -> None:
    store, fs = faulty
    [a] = await store.deliver(BODY, [Target(USER)])
    other_node = await opened(tmp_path)
    mark = await store.highest_modseq(USER, INBOX)
    fs.stall_seconds = 0.4
    fs.stall = lambda op, path: op == "open" and f"{os.sep}uids{os.sep}" in path  # this node is slow to number it
    numbering = asyncio.create_task(store.assign_uids(USER, INBOX, [a]))
    await asyncio.sleep(0.2)
    await other_node.delete_messages(USER, INBOX, [a])  # no UID yet: nothing to say vanished
    assert await numbering == {a: 1}  # numbered as it was listed, then found deleted
    fs.stall = lambda op, path: False
    for node in (store, other_node):
        assert await ids_of(node) == []
        assert await node.vanished_since(USER, INBOX, mark) == [1]


async def test_a_process_that_starts_reads_the_checkpoint_and_the_claims_after_it(
    faulty, tmp_path: Path, opened: Opener, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cassmail.store import wheelfs_modseq

    monkeypatch.setattr(wheelfs_modseq, "CHECKPOINT_EVERY", 16)
    store, _ = faulty
    ids = [(await store.deliver(BODY, [Target(USER, INBOX, frozenset({"$Start"}))]))[0] for _ in range(10)]
    await store.assign_uids(USER, INBOX, ids)
    for i in range(60):
        mode = ("add", "remove", "set")[i % 3]
        await store.store_flags(USER, INBOX, [ids[i % 10]], [f"$k{i % 4}"], mode)
        if i in (20, 41):
            await store.delete_messages(USER, INBOX, [ids[i % 10]])
        if i == 30:
            await store.assign_uids(USER, INBOX, [], renumber={ids[3]: 4})
        await ids_of(store)  # a listing: the checkpoint is written after enough claims
    [checkpoint] = [p for p in tmp_path.rglob("checkpoints/*") if p.is_file()]
    highest = await store.highest_modseq(USER, INBOX)
    assert highest > 40 and highest - 16 <= json.loads(checkpoint.read_bytes())["modseq"] <= highest + 1
    expected = [(s.id, s.uid, s.flags, s.modseq) async for s in store.list_messages(USER, INBOX)]
    fs = FileSystem()
    fresh = await opened(tmp_path, fs)
    with fs.counting() as ops:
        assert [(s.id, s.uid, s.flags, s.modseq) async for s in fresh.list_messages(USER, INBOX)] == expected
    # the mailbox, 8 keyword records, the checkpoint and the claims after it (fewer than 16), not 50 claims
    assert ops["open"] < 30
    for node in (store, fresh):
        assert await node.highest_modseq(USER, INBOX) == max(m for *_, m in expected)
        assert await node.vanished_since(USER, INBOX, 2) == [1, 2, 4]  # two deletions, one renumbering
        assert await node.uid_next(USER, INBOX) == 12


V1_STORE = Path(__file__).parent / "fixtures" / "wheelfs-store-v1"
V1_USER = "anne@old.example"


def v1_copy(root: Path) -> Path:
    """A copy of the store written before MODSEQs (fixtures/wheelfs-store-v1.md), with the empty
    directories git does not keep."""
    shutil.copytree(V1_STORE, root)
    for line in (V1_STORE.parent / "wheelfs-store-v1.dirs").read_text().split():
        (root / line).mkdir(parents=True, exist_ok=True)
    return root


async def test_a_store_written_before_modseqs_opens_with_modseq_1_and_sequences_changes_from_2(
    tmp_path: Path, opened: Opener
) -> None:
    root = v1_copy(tmp_path / "store")
    [old_claims] = [p for p in root.rglob("uids/*") if p.is_dir()]
    claims_before = {p.name: p.read_bytes() for p in old_claims.iterdir()}
    store = await opened(root, cues=False)
    listed = [s async for s in store.list_messages(V1_USER, INBOX)]
    assert [(s.uid, s.flags, s.modseq) for s in listed] == [
        (1, {"\\Seen", "$Work"}, 1), (2, {"\\Flagged"}, 1), (5, set(), 1), (None, set(), None),
    ]
    a, b, c, new = (s.id for s in listed)
    assert await store.read_message(V1_USER, INBOX, a) == b"Subject: old 0\r\n\r\nbody 0\r\n"
    assert await store.highest_modseq(V1_USER, INBOX) == 1 and await store.uid_next(V1_USER, INBOX) == 6
    assert await store.changed_since(V1_USER, INBOX, 1) == [] and len(await store.changed_since(V1_USER, INBOX, 0)) == 3
    # UID 3 (deleted) and 4 (renumbered) went before MODSEQs: not known, and said to be below 1
    assert await store.vanished_since(V1_USER, INBOX, 1) == []
    assert await store.vanished_since(V1_USER, INBOX, 0) is None
    for name in ("Drafts", "Trash"):
        assert [s async for s in store.list_messages(V1_USER, name)] == []
        assert await store.highest_modseq(V1_USER, name) == 1

    # changes from now on: MODSEQ 2, 3, 4
    assert await store.store_flags(V1_USER, INBOX, [b, a], ["\\Flagged"], "remove", unchanged_since=1) == set()
    assert await store.assign_uids(V1_USER, INBOX, [new]) == {new: 6}
    await store.delete_messages(V1_USER, INBOX, [c])
    expected = [(a, 1, {"\\Seen", "$Work"}, 1), (b, 2, set(), 2), (new, 6, set(), 3)]
    # the same seen by this process, and after reopening by one that has read nothing yet
    for node in (store, await opened(root, cues=False)):
        assert [(s.id, s.uid, s.flags, s.modseq) async for s in node.list_messages(V1_USER, INBOX)] == expected
        assert await node.highest_modseq(V1_USER, INBOX) == 4
        assert await node.vanished_since(V1_USER, INBOX, 1) == [5]
        assert await node.vanished_since(V1_USER, INBOX, 4) == []
        assert [s.id for s in await node.changed_since(V1_USER, INBOX, 2)] == [new]
        assert await node.store_flags(V1_USER, INBOX, [a, b], ["\\Seen"], "add", unchanged_since=1) == {b}
    # the old claims are read as they are, never rewritten
    assert {p.name: p.read_bytes() for p in old_claims.iterdir() if p.name in claims_before} == claims_before


# ----------------------------------------------------------------------------- cost in file-system operations


async def test_a_delivery_and_an_imap_check_cost_a_small_fraction_of_wheemails_operations(faulty) -> None:
    """The paper counted over 60 file-system operations per SMTP delivery and over 600 for an
    IMAP check finding no new mail; here, with 200 messages in the mailbox (some flagged)."""
    store, fs = faulty
    ids = [(await store.deliver(BODY, [Target(USER)]))[0] for _ in range(200)]
    await store.store_flags(USER, INBOX, ids[:20], ["\\Seen"], "add")
    await store.assign_uids(USER, INBOX, ids)
    await store.list_page(USER, INBOX)  # this node has read the flag records and claims once
    with fs.counting() as delivery:
        assert await store.is_local_domain("wheel.example") and await store.user_exists(USER)
        [new] = await store.deliver(BODY, [Target(USER)])
    await store.assign_uids(USER, INBOX, [new])
    with fs.counting() as check:  # SELECT/NOOP: the mailbox, its summaries, UIDs of new ones, UIDNEXT
        await store.mailbox_info(USER, INBOX)
        everything = [s async for s in store.list_messages(USER, INBOX)]
        await store.assign_uids(USER, INBOX, [s.id for s in everything if s.uid is None])
        await store.uid_next(USER, INBOX)
    print(f"\nfile-system operations: delivery {sum(delivery.values())} {dict(delivery)}; "
          f"IMAP check {sum(check.values())} {dict(check)}")
    assert sum(delivery.values()) <= 30
    assert sum(check.values()) <= 30
    assert check["read"] <= 6  # no body is read, and flag records already seen are not read again


# ----------------------------------------------------------------------------- interrupted renames


async def test_a_rename_stopped_by_a_crash_is_finished_by_the_next_listing(faulty, tmp_path: Path) -> None:
    store, _ = faulty
    [a] = await store.deliver(BODY, [Target(USER)])
    [boxes] = [p for p in tmp_path.rglob("boxes") if p.is_dir()]
    # a node created the new names and died before removing the old ones
    dead_node = FileSystem()
    record = json.loads(dead_node.read_bytes(str(boxes / "Drafts")))
    dead_node.write_file(str(boxes / "Old drafts"), json.dumps({**record, "renamed": time.time_ns()}).encode() + b"\n",
                         exclusive=True, fsync=True)
    inbox = json.loads(dead_node.read_bytes(str(boxes / "INBOX")))
    dead_node.write_file(str(boxes / "Old mail"),
                         json.dumps({**inbox, "renamed": time.time_ns() - 120 * 10**9}).encode() + b"\n",
                         exclusive=True, fsync=True)
    names = [m.name for m in await store.list_mailboxes(USER)]
    assert "Old drafts" in names and "Drafts" not in names and "Old mail" in names and INBOX in names
    assert await ids_of(store, "Old mail") == [a]  # the mail went with the name
    assert await ids_of(store, INBOX) == []  # and INBOX is a fresh, empty mailbox
    assert (await store.mailbox_info(USER, INBOX)).uidvalidity != inbox["uidvalidity"]


async def test_tombstones_go_after_the_grace_and_never_while_a_replica_still_shows_the_message(
    tmp_path: Path, opened: Opener
) -> None:
    fs = FaultyFS()
    store = await opened(tmp_path, fs, tombstone_grace=1.0)
    await store.add_domain("wheel.example")
    await store.create_user(USER, hash_password("pw", FAST_HASH))
    a, b, c = [(await store.deliver(BODY, [Target(USER)]))[0] for _ in range(3)]
    box = mail_dir(tmp_path)
    marker_b = next(n for n in os.listdir(box / "msg") if n.startswith(sortable_id(b)))
    replica = tmp_path / "stale-replica"
    (replica / "msg").mkdir(parents=True)
    shutil.copy(box / "msg" / marker_b, replica / "msg" / marker_b)  # a replica that holds b's marker
    await asyncio.sleep(1.2)  # the messages are older than the grace; their deletions are not yet
    await store.delete_messages(USER, INBOX, [a])
    assert os.listdir(box / "dead") == [sortable_id(a)]
    long_ago = time.time() - 10
    os.utime(box / "dead" / sortable_id(a), (long_ago, long_ago))
    await (await opened(tmp_path, fs, tombstone_grace=1.0)).delete_messages(USER, INBOX, [b])
    assert os.listdir(box / "dead") == [sortable_id(b)]  # a's record went, b's is young
    # b's marker comes back from the replica after its grace: removed again, its tombstone kept
    fs.bring_back(box, replica)
    assert marker_b in fs.listdir(str(box / "msg"))
    os.utime(box / "dead" / sortable_id(b), (long_ago, long_ago))
    await (await opened(tmp_path, fs, tombstone_grace=1.0)).delete_messages(USER, INBOX, [c])
    assert sorted(os.listdir(box / "dead")) == sorted([sortable_id(b), sortable_id(c)])
    assert fs.listdir(str(box / "msg")) == [] and fs.listdir(str(box / "body")) == []  # the merged view too
    assert os.listdir(box / "msg") == [] and os.listdir(box / "body") == []
    assert await ids_of(await opened(tmp_path, fs)) == []
