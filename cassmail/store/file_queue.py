"""The outbound queue and the DKIM keys of the file-based stores (mbox, WheelFS).

Both stores keep the queue beside the mail, as files, through the WheelFS store's
counted file-system layer (`wheelfs_fs.FileSystem`): the mbox store on its local
disk, the WheelFS store in its strong tree (no `.EventualConsistency`), where an
exclusive create succeeds for one node only. No lock is taken: the one
compare-and-set is that exclusive create, as for the WheelFS store's UIDs::

    entries/<sid>/message         a JSON line (sender, recipients, size, created, first due
                                  time), then the message; written once, fsync'd
    entries/<sid>/state.<k>       schedule and recipients' results, written by lease k's holder
    entries/<sid>/lease.<k>       attempt k's lease: owner and until (exclusive create)
    entries/<sid>/held            present while an operator holds the entry
    entries/<sid>/retry           an operator asked for an attempt now
    due/<bucket>/<time>.<sid>     empty marker: look at the entry at <time> (microseconds)

An entry is built in a staging directory and renamed into place, after its
first marker is made: a marker may name an entry that is not there yet (a
scan leaves it alone for an hour: an enqueue under way, or one that died) but
an entry always has a marker, so nothing queued is ever out of sight. A worker
takes an entry by creating `lease.<k+1>` exclusively, after checking that lease
k ran out; only the holder of lease k writes `state.<k>`, and readers take the
state of the highest k, so a worker whose lease ran out cannot undo what the
next one recorded. Each change of when an entry is next looked at (taken:
at the lease's end; rescheduled: at its due time) makes the new marker before
removing the old, so a worker that dies leaves the entry due at the end of its
lease. `<sid>` is the entry's id as a sortable UUIDv6 (directory order is
arrival order) and markers sort by time inside a bucket of a minute, so a
scan lists only the buckets that are due.

Accepting is durable before it returns: the message is written, its marker
made and the entry renamed into place, and only then is each of them fsync'd
(the file, the entry's directory, `entries/`, the marker's directory), so a
journaling file system commits them all at once. A crash before the fsyncs may
keep the marker without the entry (left alone for an hour, then removed),
never the entry without its marker: the marker is made first. What a worker
writes when it takes an entry (its lease, the marker at the lease's end) is not:
a crash that loses it only frees the entry early, and the old marker is still
there. Results and schedules are fsync'd (losing them would send twice).
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from cassmail.model import address_key, new_message_id, normalize_domain, parse_sortable_id, sortable_id
from cassmail.store.file_sieve import FileSieve
from cassmail.store.base import (
    Body,
    SieveScriptInfo,
    DkimKey,
    InvalidInput,
    NoSuchDomain,
    NoSuchQueueEntry,
    QueuedRecipient,
    QueueEntry,
    Store,
    check_dkim_key,
    check_enqueue,
    decode_name,
    encode_name,
)
from cassmail.store.wheelfs_fs import FileSystem

T = TypeVar("T")

#: Seconds per directory of due markers.
BUCKET_SECONDS = 60
#: A marker naming no entry is left alone this long (an enqueue may still be renaming it into place).
ORPHAN_MARKER_AGE = 3600.0
#: Seconds after which a lease file left empty (its creator died before writing it) is free.
ABANDONED_LEASE = 60.0
#: A held entry is looked at again this often (a release makes it due at once anyway).
HELD_RECHECK = 3600.0
_US = 1_000_000


class FileQueue:
    """The queue under one directory. Blocking calls: the stores run them off the event loop."""

    def __init__(self, fs: FileSystem, root: str, fsync: bool) -> None:
        self.fs, self.root, self.fsync = fs, root, fsync
        self.entries = os.path.join(root, "entries")
        self.due = os.path.join(root, "due")

    def open(self) -> None:
        self.fs.makedirs(self.entries)
        self.fs.makedirs(self.due)
        for name in self.fs.listdir(self.entries):  # left by an enqueue that died (nothing names them)
            path = os.path.join(self.entries, name)
            try:
                if name.startswith(".new-") and time.time() - self.fs.stat(path).st_mtime > ORPHAN_MARKER_AGE:
                    self.fs.rmtree(path)
            except FileNotFoundError:
                continue

    # ----------------------------------------------------------------- paths and records

    def _dir(self, entry_id: uuid.UUID) -> str:
        return os.path.join(self.entries, sortable_id(entry_id))

    def _marker(self, sid: str, when: float) -> str:
        micros = max(int(when * _US), 0)
        return os.path.join(self.due, f"{micros // (BUCKET_SECONDS * _US):012d}", f"{micros:017d}.{sid}")

    def _put_marker(self, sid: str, when: float, durable: bool = True) -> str:
        path = self._marker(sid, when)
        for _ in range(3):  # a scan may remove an empty bucket directory between the two calls
            self.fs.makedirs(os.path.dirname(path))
            try:
                self.fs.write_file(path, b"", exclusive=False, fsync=False)
                break
            except FileNotFoundError:
                continue
        if self.fsync and durable:
            self.fs.fsync_dir(os.path.dirname(path))
        return path

    def _move_marker(self, sid: str, old: float | None, new: float, durable: bool = True) -> None:
        """The new marker first, then the old one goes: the entry is never without one."""
        if old is not None and self._marker(sid, old) == self._marker(sid, new):
            return
        self._put_marker(sid, new, durable)
        if old is not None:
            self.fs.unlink(self._marker(sid, old), missing_ok=True)

    def _json(self, path: str) -> Any:
        return json.loads(self.fs.read_bytes(path))

    def _write_json(self, path: str, value: Any, exclusive: bool = False, durable: bool = True) -> None:
        data = json.dumps(value, separators=(",", ":")).encode() + b"\n"
        if exclusive:
            self.fs.write_file(path, data, exclusive=True, fsync=self.fsync and durable)
        else:
            self.fs.replace_file(path, data, self.fsync and durable)

    def _envelope(self, directory: str) -> tuple[dict[str, Any], int]:
        """The JSON line at the head of an entry's message file, and where the message starts."""
        path = os.path.join(directory, "message")
        fd = self.fs.open_read(path)
        try:
            head = b""
            while b"\n" not in head:
                more = self.fs.pread(fd, path, 65536, len(head))
                if not more:
                    raise FileNotFoundError(path)  # still being written: not there yet
                head += more
        finally:
            self.fs.close(fd, path)
        line = head[: head.index(b"\n")]
        return json.loads(line), len(line) + 1

    def _load(self, entry_id: uuid.UUID) -> tuple[QueueEntry, int, dict[str, Any]]:
        """The entry, its current lease number and the lease record ({} before the first);
        NoSuchQueueEntry when it is not (or no longer, or not yet) there."""
        directory = self._dir(entry_id)
        try:
            envelope, _ = self._envelope(directory)
            names = set(self.fs.listdir(directory))
        except (FileNotFoundError, NotADirectoryError):
            raise NoSuchQueueEntry(entry_id) from None
        lease_k = max((int(n[6:]) for n in names if n.startswith("lease.") and n[6:].isdigit()), default=0)
        state_k = max((int(n[6:]) for n in names if n.startswith("state.") and n[6:].isdigit()), default=0)
        try:
            state = (self._json(os.path.join(directory, f"state.{state_k}")) if state_k
                     else {"due": envelope["due"], "attempts": 0, "recipients": {}})
            lease = self._lease(os.path.join(directory, f"lease.{lease_k}")) if lease_k else {}
        except FileNotFoundError:
            raise NoSuchQueueEntry(entry_id) from None
        due = state["due"]
        if "retry" in names:  # an operator asked for an attempt: due since then
            try:
                due = min(due, self.fs.stat(os.path.join(directory, "retry")).st_mtime)
            except FileNotFoundError:
                pass
        results = state.get("recipients", {})
        recipients = tuple(
            QueuedRecipient(address, *results.get(address, ("pending", "", ""))) for address in envelope["recipients"]
        )
        entry = QueueEntry(
            id=entry_id, sender=envelope["sender"], recipients=recipients, size=envelope["size"],
            created=envelope["created"], due=due,
            attempts=state.get("attempts", 0), held="held" in names, warned=state.get("warned", False),
            last_error=state.get("last_error", ""), lease_owner=lease.get("owner", ""),
            lease_until=lease.get("until", 0.0), smtputf8=envelope.get("smtputf8", False),
        )
        return entry, lease_k, state

    def _lease(self, path: str) -> dict[str, Any]:
        """A lease record. One still empty is being written by the worker that created it (the
        exclusive create comes before the write): held by it, or, if that worker died before
        writing, free `ABANDONED_LEASE` seconds after its creation."""
        data = self.fs.read_bytes(path)
        if data.endswith(b"\n"):
            return json.loads(data)  # type: ignore[no-any-return]
        return {"owner": "", "until": self.fs.stat(path).st_mtime + ABANDONED_LEASE}

    @staticmethod
    def _next_look(entry: QueueEntry, marker_time: float, now: float) -> float:
        """When a scan should look at the entry next (the marker it ought to have)."""
        if entry.held:
            return marker_time if marker_time > now else now + HELD_RECHECK
        return max(entry.due, entry.lease_until)

    # ----------------------------------------------------------------- accepting

    def enqueue(
        self, body: Body, sender: str, recipients: Sequence[str], smtputf8: bool, due: float | None, max_size: int,
        lease: tuple[str, float] | None = None, cancelled: Callable[[], bool] = lambda: False,
    ) -> uuid.UUID:
        view, sender, rcpts = check_enqueue(body, sender, recipients, max_size)
        entry_id = new_message_id()
        sid = sortable_id(entry_id)
        now = time.time()
        due = now if due is None else due
        staging = os.path.join(self.entries, f".new-{sid}")
        marker: str | None = None
        self.fs.mkdir(staging)
        path = os.path.join(staging, "message")
        fd: int | None = None
        try:
            envelope = {"sender": sender, "recipients": rcpts, "size": view.nbytes, "created": now, "due": due,
                        "smtputf8": smtputf8}
            fd = self.fs.open_write(path, exclusive=True)
            self.fs.write_all(fd, path, json.dumps(envelope, separators=(",", ":")).encode() + b"\n")
            self.fs.write_all(fd, path, view)
            first_look = due
            if lease:  # held by the accepting worker from the start (see Store.enqueue)
                first_look = max(due, now + lease[1])
                self._write_json(os.path.join(staging, "lease.1"), {"owner": lease[0], "until": now + lease[1]},
                                 exclusive=True, durable=False)
            marker = self._put_marker(sid, first_look, durable=False)
            if cancelled():
                raise TimeoutError("the caller gave up on this enqueue")
            self.fs.rename(staging, self._dir(entry_id))
            path = os.path.join(self._dir(entry_id), "message")
            if self.fsync:
                # Every change is made first, then each is made durable: a journaling file system
                # (ext4) commits them all in the first fsync and the others find nothing left to do.
                self.fs.fsync(fd, path)
        except BaseException:
            if fd is not None:
                self.fs.close(fd, path)
                fd = None
            self.fs.rmtree(staging)
            self.fs.rmtree(self._dir(entry_id))
            if marker is not None:
                self.fs.unlink(marker, missing_ok=True)
            raise
        finally:
            if fd is not None:
                self.fs.close(fd, path)
        if self.fsync:
            for directory in (self._dir(entry_id), self.entries, os.path.dirname(marker)):
                self.fs.fsync_dir(directory)
        return entry_id

    # ----------------------------------------------------------------- workers

    def take_due(self, owner: str, limit: int, lease: float) -> list[QueueEntry]:
        now = time.time()
        taken: list[QueueEntry] = []
        now_bucket = int(now * _US) // (BUCKET_SECONDS * _US)
        for bucket in sorted(self.fs.listdir(self.due)):
            if not bucket.isdigit() or int(bucket) > now_bucket or len(taken) >= limit:
                break
            directory = os.path.join(self.due, bucket)
            try:
                names = sorted(self.fs.listdir(directory))
            except FileNotFoundError:
                continue
            for name in names:
                if len(taken) >= limit:
                    break
                micros, _, sid = name.partition(".")
                if not micros.isdigit() or int(micros) > now * _US:
                    break
                got = self._take(sid, int(micros) / _US, owner, lease, now)
                if got is not None:
                    taken.append(got)
            if int(bucket) < now_bucket and len(taken) < limit:
                self._drop_if_empty(directory)
        return taken

    def _drop_if_empty(self, directory: str) -> None:
        try:
            if not self.fs.listdir(directory):
                self.fs.before("rmdir", directory)
                os.rmdir(self.fs.where(directory))
        except OSError:
            pass  # a marker arrived, or another worker removed it first

    def _take(self, sid: str, marker_time: float, owner: str, lease: float, now: float) -> QueueEntry | None:
        try:
            entry_id = parse_sortable_id(sid)
        except (InvalidInput, ValueError):
            return None
        try:
            entry, lease_k, _ = self._load(entry_id)
        except NoSuchQueueEntry:
            if marker_time < now - ORPHAN_MARKER_AGE:
                self.fs.unlink(self._marker(sid, marker_time), missing_ok=True)
            return None
        look = self._next_look(entry, marker_time, now)
        if look > now or entry.held:
            self._move_marker(sid, marker_time, look)
            return None
        until = now + lease
        try:
            self._write_json(os.path.join(self._dir(entry_id), f"lease.{lease_k + 1}"),
                             {"owner": owner, "until": until}, exclusive=True, durable=False)
        except FileExistsError:
            return None  # another worker took it first
        except FileNotFoundError:
            return None  # finished meanwhile
        self._move_marker(sid, marker_time, until, durable=False)
        directory = self._dir(entry_id)
        self.fs.unlink(os.path.join(directory, "retry"), missing_ok=True)
        for k in range(max(lease_k - 2, 1), lease_k):  # older leases say nothing any more
            self.fs.unlink(os.path.join(directory, f"lease.{k}"), missing_ok=True)
        return replace(entry, due=min(entry.due, now), lease_owner=owner, lease_until=until)

    def _holding(self, entry_id: uuid.UUID, owner: str) -> tuple[QueueEntry, int, dict[str, Any]] | None:
        """The entry, lease number and state while `owner` holds the newest, unexpired lease."""
        try:
            entry, k, state = self._load(entry_id)
        except NoSuchQueueEntry:
            return None
        if not k or entry.lease_owner != owner or entry.lease_until < time.time():
            return None
        return entry, k, state

    def renew_lease(self, entry_id: uuid.UUID, owner: str, lease: float) -> bool:
        held = self._holding(entry_id, owner)
        if held is None:
            return False
        entry, k, _ = held
        until = time.time() + lease
        self._write_json(os.path.join(self._dir(entry_id), f"lease.{k}"), {"owner": owner, "until": until},
                         durable=False)
        self._move_marker(sortable_id(entry_id), entry.lease_until, until, durable=False)
        return True

    def record_results(self, entry_id: uuid.UUID, owner: str, results: Sequence[QueuedRecipient]) -> bool:
        held = self._holding(entry_id, owner)
        if held is None:
            return False
        _, k, state = held
        self._write_state(entry_id, k, state, results)
        return True

    def _write_state(self, entry_id: uuid.UUID, k: int, state: dict[str, Any], results: Sequence[QueuedRecipient],
                     **changes: Any) -> None:
        recorded = dict(state.get("recipients", {}))
        for r in results:
            recorded[r.address] = [r.state, r.reply, r.remote]
        self._write_json(os.path.join(self._dir(entry_id), f"state.{k}"), {**state, **changes, "recipients": recorded})

    def reschedule(self, entry_id: uuid.UUID, owner: str, due: float, error: str, warned: bool,
                   results: Sequence[QueuedRecipient]) -> bool:
        held = self._holding(entry_id, owner)
        if held is None:
            return False
        entry, k, state = held
        self._write_state(entry_id, k, state, results, due=due, attempts=state.get("attempts", 0) + 1,
                          last_error=error, warned=warned or state.get("warned", False))
        sid = sortable_id(entry_id)
        self._put_marker(sid, due)
        self._write_json(os.path.join(self._dir(entry_id), f"lease.{k}"), {"owner": "", "until": 0.0})
        if self._marker(sid, due) != self._marker(sid, entry.lease_until):
            self.fs.unlink(self._marker(sid, entry.lease_until), missing_ok=True)
        return True

    def finish(self, entry_id: uuid.UUID) -> None:
        try:
            entry, _, _ = self._load(entry_id)
        except NoSuchQueueEntry:
            return
        self._remove(entry)

    def _remove(self, entry: QueueEntry) -> None:
        """The entry's directory, then its marker (one naming no entry would only wait an hour)."""
        sid = sortable_id(entry.id)
        self.fs.rmtree(self._dir(entry.id))
        self.fs.unlink(self._marker(sid, max(entry.due, entry.lease_until)), missing_ok=True)

    def read(self, entry_id: uuid.UUID) -> bytes:
        directory = self._dir(entry_id)
        path = os.path.join(directory, "message")
        try:
            envelope, start = self._envelope(directory)
            fd = self.fs.open_read(path)
        except (FileNotFoundError, NotADirectoryError):
            raise NoSuchQueueEntry(entry_id) from None
        try:
            return self.fs.pread(fd, path, envelope["size"], start)
        finally:
            self.fs.close(fd, path)

    # ----------------------------------------------------------------- operators

    def list(self, domain: str | None) -> list[QueueEntry]:
        wanted = normalize_domain(domain) if domain else None
        out = []
        for name in sorted(self.fs.listdir(self.entries)):
            if name.startswith("."):
                continue
            try:
                entry, _, _ = self._load(parse_sortable_id(name))
            except (NoSuchQueueEntry, InvalidInput, ValueError):
                continue
            if wanted is None or any(r.address.rpartition("@")[2] == wanted for r in entry.recipients):
                out.append(entry)
        return out

    def get(self, entry_id: uuid.UUID) -> QueueEntry:
        return self._load(entry_id)[0]

    def retry(self, entry_id: uuid.UUID | None) -> int:
        entries = [self.get(entry_id)] if entry_id is not None else self.list(None)
        count = 0
        for entry in entries:
            if entry.held:
                continue
            directory = self._dir(entry.id)
            try:
                self.fs.write_file(os.path.join(directory, "retry"), b"", exclusive=False, fsync=self.fsync)
            except FileNotFoundError:
                continue  # finished meanwhile
            self._put_marker(sortable_id(entry.id), time.time())
            count += 1
        return count

    def hold(self, entry_id: uuid.UUID, held: bool) -> None:
        entry = self.get(entry_id)
        path = os.path.join(self._dir(entry_id), "held")
        if held:
            self.fs.write_file(path, b"", exclusive=False, fsync=self.fsync)
        else:  # released: due now
            self.fs.write_file(os.path.join(self._dir(entry_id), "retry"), b"", exclusive=False, fsync=self.fsync)
            self.fs.unlink(path, missing_ok=True)
            self._put_marker(sortable_id(entry.id), max(time.time(), entry.lease_until))

    def delete(self, entry_id: uuid.UUID) -> None:
        self._remove(self.get(entry_id))


class FileKeys:
    """DKIM keys, one small JSON file per domain under one directory (written atomically)."""

    def __init__(self, fs: FileSystem, root: str, fsync: bool) -> None:
        self.fs, self.root, self.fsync = fs, root, fsync

    def open(self) -> None:
        self.fs.makedirs(self.root)

    def _path(self, domain: str) -> str:
        return os.path.join(self.root, encode_name(normalize_domain(domain)))

    def set(self, domain: str, selector: str, pem: str) -> None:
        data = json.dumps({"domain": domain, "selector": selector, "private_key": pem}).encode() + b"\n"
        self.fs.replace_file(self._path(domain), data, self.fsync)

    def get(self, domain: str) -> DkimKey | None:
        try:
            record = json.loads(self.fs.read_bytes(self._path(domain)))
        except FileNotFoundError:
            return None
        return DkimKey(record["domain"], record["selector"], record["private_key"])

    def delete(self, domain: str) -> None:
        self.fs.unlink(self._path(domain), missing_ok=True)

    def list(self) -> list[DkimKey]:
        keys = []
        for name in sorted(self.fs.listdir(self.root)):
            if name.startswith("."):
                continue
            key = self.get(decode_name(name))
            if key is not None:
                keys.append(key)
        return sorted(keys, key=lambda k: k.domain)


class FileQueueStore(Store):
    """The queue, DKIM and Sieve methods of the Store contract for a file-based store, which sets
    `queue`, `keys` and `sieve` and runs blocking work through its `_call(fn, *args, cancel=...)`."""

    queue: FileQueue
    keys: FileKeys
    sieve: FileSieve

    async def _call(self, fn: Callable[..., T], *args: Any, cancel: threading.Event | None = None) -> T:
        raise NotImplementedError  # pragma: no cover - every file store has its own

    async def enqueue(
        self, body: Body, sender: str, recipients: Sequence[str], *, smtputf8: bool = False, due: float | None = None,
        lease: tuple[str, float] | None = None,
    ) -> uuid.UUID:
        cancel = threading.Event()
        return await self._call(self.queue.enqueue, body, sender, recipients, smtputf8, due, self.max_message_size,
                                lease, cancel.is_set, cancel=cancel)

    async def take_due(self, owner: str, limit: int, lease: float) -> list[QueueEntry]:
        return await self._call(self.queue.take_due, owner, limit, lease)

    async def renew_lease(self, entry_id: uuid.UUID, owner: str, lease: float) -> bool:
        return await self._call(self.queue.renew_lease, entry_id, owner, lease)

    async def read_queued(self, entry_id: uuid.UUID) -> bytes:
        return await self._call(self.queue.read, entry_id)

    async def record_results(self, entry_id: uuid.UUID, owner: str, results: Sequence[QueuedRecipient]) -> bool:
        return await self._call(self.queue.record_results, entry_id, owner, results)

    async def reschedule(
        self, entry_id: uuid.UUID, owner: str, due: float, error: str, *, warned: bool = False,
        results: Sequence[QueuedRecipient] = (),
    ) -> bool:
        return await self._call(self.queue.reschedule, entry_id, owner, due, error, warned, results)

    async def finish(self, entry_id: uuid.UUID) -> None:
        await self._call(self.queue.finish, entry_id)

    async def list_queue(self, domain: str | None = None) -> list[QueueEntry]:
        return await self._call(self.queue.list, domain)

    async def get_queued(self, entry_id: uuid.UUID) -> QueueEntry:
        return await self._call(self.queue.get, entry_id)

    async def retry_queued(self, entry_id: uuid.UUID | None = None) -> int:
        return await self._call(self.queue.retry, entry_id)

    async def hold_queued(self, entry_id: uuid.UUID, held: bool) -> None:
        await self._call(self.queue.hold, entry_id, held)

    async def delete_queued(self, entry_id: uuid.UUID) -> None:
        await self._call(self.queue.delete, entry_id)

    async def set_dkim_key(self, domain: str, selector: str, private_key_pem: str) -> None:
        domain, selector, private_key_pem = check_dkim_key(domain, selector, private_key_pem)
        if not await self.is_local_domain(domain):
            raise NoSuchDomain(domain)
        await self._call(self.keys.set, domain, selector, private_key_pem)

    async def get_dkim_key(self, domain: str) -> DkimKey | None:
        return await self._call(self.keys.get, domain)

    async def delete_dkim_key(self, domain: str) -> None:
        await self._call(self.keys.delete, domain)

    async def list_dkim_keys(self) -> list[DkimKey]:
        return await self._call(self.keys.list)

    async def put_sieve_script(self, user: str, name: str, content: str) -> None:
        await self._call(self.sieve.put, address_key(user), name, content)

    async def get_sieve_script(self, user: str, name: str) -> str:
        return await self._call(self.sieve.get, address_key(user), name)

    async def list_sieve_scripts(self, user: str) -> list[SieveScriptInfo]:
        return await self._call(self.sieve.list, address_key(user))

    async def set_active_sieve_script(self, user: str, name: str | None) -> None:
        await self._call(self.sieve.set_active, address_key(user), name)

    async def delete_sieve_script(self, user: str, name: str) -> None:
        await self._call(self.sieve.delete, address_key(user), name)

    async def rename_sieve_script(self, user: str, old: str, new: str) -> None:
        await self._call(self.sieve.rename, address_key(user), old, new)

    async def active_sieve_script(self, user: str) -> tuple[str, str] | None:
        return await self._call(self.sieve.active_script, address_key(user))

    async def note_vacation(self, user: str, key: str, seconds: float) -> bool:
        return await self._call(self.sieve.note_vacation, address_key(user), key, seconds)
