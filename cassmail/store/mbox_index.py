"""One mailbox of the mbox store: the mbox file, its side index, and compaction.

The index (`<name>.idx`)
------------------------
A 32-byte header (magic, generation, UIDVALIDITY, CRC) and then a log of records,
each framed as length, CRC32 and type. A checkpoint writes the whole state as
records (one ENTRY per region of the mbox, then STATE) into a new file with the
next generation and renames it over the old one; operations append a record and
fdatasync it before they are acknowledged. So STAT, LIST and SELECT read only
the index (a process replays just the records appended since it last looked), a
delivery costs one append to each file, and a torn last record (a writer killed
in the middle of an append) fails its CRC and is cut off by the next writer.
Anything else wrong (bad header, a bad record followed by good ones, an index
that does not match the mbox's size or bytes) makes the next writer rebuild the
index from the mbox alone (`mbox_format.scan`): ids, dates, flags and expunge
marks come from the records themselves; UIDs do not, and the rebuilt mailbox
gets a new UIDVALIDITY, which is what RFC 3501 prescribes when UIDs cannot be
kept (the alternative, a UID counter in the mbox, would cost an in-place write
per UID assignment to protect a case that only a lost index creates).

The IMAP \\Recent mark (Store.claim_recent) is a RECENT record holding the new
mark, appended under the write lock like UIDS, and written after STATE by a
checkpoint once it is above 1. An index without one reads as mark 1 ("never
claimed"): a new mailbox, a rebuilt one (its UIDs start again, so must the
mark), and one kept from before the record existed. For the last, every message
is recent once more, for the one session that claims first after the upgrade.
That is chosen over guessing a mark from the UID counter, which would take
\\Recent away from messages numbered by COPY but never yet claimed; and the
index of a mailbox no session has claimed stays as older versions wrote it.

MODSEQs (RFC 7162, see Store.highest_modseq) live in the index too, changed in
the record of the change itself, under the write lock, so two processes never
hand out one MODSEQ: FLAGS_AT, DELETE_AT and UIDS_AT are FLAGS, DELETE and UIDS
with a prefix (the call's MODSEQ, the time, the vanished floor). Replaying one
gives the MODSEQ to each numbered message it changes (a deletion: to the UIDs it
makes vanish, as does a renumbering to the UID given up) and raises the
mailbox's counter to it; an ENTRY carries its message's MODSEQ, since a flag
change may move a message to the end. The vanished list keeps, per call, its
MODSEQ, time and UIDs; each change record names the floor, the highest MODSEQ
of the calls older than `vanished_keep` that its writer dropped, so every
process forgets the same ones (`vanished_since` below the floor is None). A
checkpoint writes the counter, the floor and the list as one MODSEQS record
after STATE. Messages numbered before MODSEQs existed have MODSEQ 0 in the index,
which reads as 1, and an index without a MODSEQS record has HIGHESTMODSEQ 1.
Such an index (magic CMIDX01) is read as it is and checkpointed to the current
format (CMIDX02) by the first writer that takes it, which is the upgrade.

The index models the mbox as a tiling: every byte belongs to one segment, a
live message, a deleted one (marked, not yet reclaimed) or dead space (bytes a
crash left behind). Message ids are version-1 timeuuids; listings go by id.

Deletion and compaction
-----------------------
`delete` appends one DELETE record and fdatasyncs it, then marks the messages
expunged in their X-Status so a rebuild never brings them back. Then it reclaims
space within a budget (`compact_budget` bytes written, `compact_seconds`), and
`cassmail store compact` finishes whatever the budget left.

Each maximal run of dead segments [a, b) is reclaimed with
FALLOC_FL_COLLAPSE_RANGE, which removes a block-aligned range from the middle of
the file by re-pointing extents: no data moves, so the cost does not depend on
how far the deleted mail sits from the end of the file (the "deletion distance"
that makes a classic mbox rewrite slow). Message boundaries are not block
aligned, so the collapsed range is the largest block-aligned range inside the
run that still leaves room for a pad, and the unaligned remainder, at most about
two blocks, is absorbed into the next live message: its From_ line is moved to
`a` and an `X-Cassmail-Pad:` header fills the rest, exactly up to where that
message's own headers begin. Other mbox readers see one header more (a header is
the one thing an mbox reader accepts anywhere between a From_ line and a body),
the store skips it, and the next reclaim next to that message swallows the pad
with its own remainder. Run at the end of the file are simply truncated. Where
the file system cannot collapse (not ext4/XFS, or `method = "rewrite"`), the
tail after the first dead byte is rewritten, through a side file so a crash can
always redo it.

Crash safety: before touching the mbox a compaction appends its whole plan
(COMPACT_BEGIN: every range and every byte it will write) and fdatasyncs it; it
works from the highest offset down, so the plan's offsets stay true, and the
file size tells a recovering writer exactly which collapses happened (each one
shrinks the file); the pad writes are idempotent and are redone. COMPACT_END
closes it. A killed compactor therefore never loses a message, and since
deletions are in the index (and in X-Status) before compaction starts, never
shows a deleted one again.

Collapsing makes extents: the blocks on either side of a collapsed range are no
longer neighbours on disk. After a compaction, a defragmentation step moves data
only where that removes fragments: around each collapse point it gathers a run
of whole extents of at most `defrag_window` bytes and, when the run has at least
`defrag_min_extents` extents, gives it fresh contiguous blocks with
EXT4_IOC_MOVE_EXT (the data stays the same at every instant, so this step needs
no journal). Elsewhere defragmentation is skipped.

Locking
-------
Writers (deliveries, flag changes, deletes, UID assignment, compaction) take an
exclusive whole-file OFD lock on the mbox and then the dot-lock `<mbox>.lock`;
readers take a shared lock just long enough to sync the index and read one
chunk, so a compaction can run between two chunks of a long download, and the
reader finds the message at its new offset. mutt, procmail and Dovecot use the
same fcntl lock and dot-lock, so none of them sees a half-done change either.
"""

from __future__ import annotations

import bisect
import errno
import logging
import mmap
import os
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from cassmail.config import MboxSettings
from cassmail.model import MessageSummary, uuid_from_bytes
from cassmail.store import mbox_fs
from cassmail.store.base import MailboxStatus, count_status, needs_uid, uid_work
from cassmail.store.mbox_format import (
    META_TAG,
    PAD_MIN,
    Unquoter,
    encode_slot,
    from_line,
    keyword_capacity,
    keywords_text,
    pad,
    parse_meta,
    quote,
    record_head,
    scan,
    slot_length,
    trailer_length,
)

log = logging.getLogger(__name__)

MAGIC = b"CMIDX02\n"
#: The magic of indexes written before MODSEQs: read as they are, checkpointed by the first writer.
MAGIC_V1 = b"CMIDX01\n"
_HEADER = struct.Struct(">8sQII")  # magic, generation, uidvalidity, reserved; then CRC32 and 4 spare bytes
HEADER_SIZE = 32
_FRAME = struct.Struct(">IIB")  # payload length, CRC32 of type and payload, type
_SEG = struct.Struct(">16sQQIIIiQQqIB")
_ID = struct.Struct(">16s")
ZERO_ID = b"\0" * 16

ENTRY, STATE, FLAGS, DELETE, UIDS, COMPACT_BEGIN, COMPACT_END, RECENT = 1, 2, 3, 4, 5, 6, 7, 8
#: FLAGS, DELETE and UIDS with a _CHANGE prefix (written since MODSEQs; the three above are only read),
#: and the checkpoint's MODSEQ state.
FLAGS_AT, DELETE_AT, UIDS_AT, MODSEQS = 9, 10, 11, 12
_CHANGE = struct.Struct(">QQQ")  # the call's MODSEQ (0: none), time (us since 1970), vanished floor
_MODSEQ = struct.Struct(">Q")
_VANISHED = struct.Struct(">QQI")  # one call's MODSEQ, time (us) and number of UIDs, then the UIDs
RUN_COLLAPSE, RUN_TRUNCATE, RUN_REWRITE = 1, 2, 3

#: Bytes read per step when streaming a body: the unit of read_chunks and of lock hold time.
READ_CHUNK = 256 * 1024
#: A checkpoint is written when the log part of the index exceeds this and the snapshot's size.
CHECKPOINT_MIN = 256 * 1024
#: Budget units charged per collapse (it is a journal transaction, not free).
COLLAPSE_COST = 4096


class MailboxGone(Exception):
    """The mailbox file was deleted, renamed or replaced since it was opened here."""


class MessageGone(Exception):
    """A message being read was deleted meanwhile (the store answers NoSuchMessage)."""


class NeedsRecovery(Exception):
    """A reader found work for a writer (a crashed writer's leftovers); retry with the exclusive lock."""


class WouldWait(Exception):
    """Work tried `without_waiting` met something to wait for (a lock another thread or process
    holds, bytes not in the page cache) or something to write; nothing was changed."""


# --------------------------------------------------------------------------- the model


@dataclass(slots=True, eq=False)
class Segment:
    """A region of the mbox: a message (live or deleted) or dead space (`id` None)."""

    off: int
    length: int
    id: uuid.UUID | None = None
    head: int = 0  # From_ line and pad
    from_len: int = 0
    meta: int = 0  # X-Cassmail line (0: a record another tool wrote)
    capacity: int = -1  # keyword capacity of the flag slot (-1: no slot)
    stored: int = 0  # bytes of the message as stored (mboxrd-quoted)
    raw: int = 0  # bytes of the message as delivered
    date_us: int = 0
    flags: frozenset[str] = frozenset()
    uid: int = 0
    deleted: bool = False
    modseq: int = 0  # of its last change; 0 while unnumbered or numbered before MODSEQs (reads as 1)
    made: MessageSummary | None = field(default=None, repr=False)
    made_us: int = field(default=0, repr=False)

    @property
    def live(self) -> bool:
        return self.id is not None and not self.deleted

    @property
    def shown_modseq(self) -> int | None:
        """The MODSEQ a listing shows: None while unnumbered, at least 1 once numbered."""
        return (self.modseq or 1) if self.uid else None

    @property
    def slot_off(self) -> int:
        return self.off + self.head + self.meta

    @property
    def content_off(self) -> int:
        return self.slot_off + slot_length(self.capacity)

    def encode(self) -> bytes:
        flags = " ".join(sorted(self.flags)).encode()
        return _SEG.pack(
            self.id.bytes if self.id else ZERO_ID, self.off, self.length, self.head, self.from_len, self.meta,
            self.capacity, self.stored, self.raw, self.date_us, self.uid, self.deleted,
        ) + struct.pack(">H", len(flags)) + flags + _MODSEQ.pack(self.modseq)

    @classmethod
    def decode(cls, payload: bytes) -> Segment:
        fields = _SEG.unpack_from(payload)
        (n,) = struct.unpack_from(">H", payload, _SEG.size)
        flags = payload[_SEG.size + 2 : _SEG.size + 2 + n].decode()
        end = _SEG.size + 2 + n
        if len(payload) not in (end, end + _MODSEQ.size):  # an entry written before MODSEQs ends at its flags
            raise ValueError(f"index entry of {len(payload)} bytes, not {end} or {end + _MODSEQ.size}")
        modseq = _MODSEQ.unpack_from(payload, end)[0] if len(payload) > end else 0
        raw_id, *rest = fields
        return cls(
            rest[0], rest[1], uuid_from_bytes(raw_id) if raw_id != ZERO_ID else None, *rest[2:9],
            frozenset(flags.split()) if flags else frozenset(), rest[9], bool(rest[10]), modseq,
        )

    def summary(self) -> MessageSummary:
        """The listing's view of it; the last one made is kept while the fields it shows stay the
        same (a listing of a large mailbox would otherwise build every summary anew)."""
        assert self.id is not None
        made = self.made
        modseq = self.shown_modseq
        if made is not None and made.id is self.id and made.flags is self.flags and made.size == self.raw \
                and (made.uid or 0) == self.uid and made.modseq == modseq and self.date_us == self.made_us:
            return made
        when = datetime.fromtimestamp(self.date_us / 1_000_000, tz=timezone.utc)
        self.made = MessageSummary(self.id, self.raw, self.flags, when, self.uid or None, modseq)
        self.made_us = self.date_us
        return self.made


def _order_key(message_id: uuid.UUID) -> tuple[int, int, uuid.UUID]:
    return message_id.time, message_id.int, message_id


def _in_arrival_order(segments: Iterable[Segment]) -> list[Segment]:
    return sorted(segments, key=lambda seg: _order_key(seg.id))  # type: ignore[arg-type]


def _first(entry: tuple[int, Segment]) -> int:
    return entry[0]


@dataclass(slots=True)
class Run:
    """One step of a compaction plan (see the module docstring)."""

    kind: int
    a: int  # first byte reclaimed
    start: int = 0  # collapse: the block-aligned start; rewrite: unused
    removed: int = 0  # bytes the file shrinks by
    next_id: uuid.UUID | None = None  # collapse: the live message whose From_ line moves to `a`
    head: bytes = b""  # collapse: the From_ line and pad written at `a`


@dataclass(slots=True)
class Plan:
    seq: int
    size_before: int
    runs: list[Run]
    side: str = ""  # rewrite: the side file holding the new tail

    def encode(self) -> bytes:
        out = bytearray(struct.pack(">IQI", self.seq, self.size_before, len(self.runs)))
        for r in self.runs:
            out += struct.pack(">BQQQ16sI", r.kind, r.a, r.start, r.removed, r.next_id.bytes if r.next_id else ZERO_ID,
                               len(r.head))
            out += r.head
        side = self.side.encode()
        out += struct.pack(">H", len(side)) + side
        return bytes(out)

    @classmethod
    def decode(cls, payload: bytes) -> Plan:
        seq, size_before, n = struct.unpack_from(">IQI", payload)
        pos = struct.calcsize(">IQI")
        runs = []
        item = struct.Struct(">BQQQ16sI")
        for _ in range(n):
            kind, a, start, removed, next_id, head_len = item.unpack_from(payload, pos)
            pos += item.size
            runs.append(Run(kind, a, start, removed, uuid_from_bytes(next_id) if next_id != ZERO_ID else None,
                            payload[pos : pos + head_len]))
            pos += head_len
        (side_len,) = struct.unpack_from(">H", payload, pos)
        return cls(seq, size_before, runs, payload[pos + 2 : pos + 2 + side_len].decode())


@dataclass
class CompactReport:
    """What one compaction did, for the CLI and the benchmark."""

    runs: int = 0
    collapses: int = 0
    reclaimed: int = 0  # bytes the mbox shrank by
    written: int = 0  # bytes written into the mbox (pads, rewritten tails, moved data)
    moved: int = 0  # bytes given fresh blocks by defragmentation
    extents_before: int | None = None
    extents_after: int | None = None
    left: int = 0  # dead bytes still in the file (budget exhausted or too small to absorb yet)
    seconds: float = 0.0

    def add(self, other: CompactReport) -> None:
        for name in ("runs", "collapses", "reclaimed", "written", "moved", "left"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.seconds += other.seconds


@dataclass(frozen=True, slots=True)
class Vanished:
    """The UIDs one call expunged or gave up (renumbering), with its MODSEQ and time (us)."""

    modseq: int
    time_us: int
    uids: tuple[int, ...]


@dataclass
class ReadState:
    """Where a streaming read stands between two chunks (no lock is held in between)."""

    message_id: uuid.UUID
    start: int
    end: int | None
    stored_pos: int = 0
    raw_pos: int = 0
    unquoter: Unquoter | None = None
    checked: bool = False
    done: bool = False
    #: The message's size, from the first step on.
    size: int | None = None


# --------------------------------------------------------------------------- the mailbox file


class MailboxFile:
    """An mbox file and its index, shared by every session of one process; all methods block
    (the store runs them in threads) and are safe across threads and processes."""

    def __init__(
        self,
        mbox_path: Path,
        index_path: Path,
        settings: MboxSettings,
        new_uidvalidity: Callable[[], int],
        collapse_ok: bool,
        vanished_keep: Callable[[], float] = lambda: 30 * 86400.0,
        dotlock_dir: str | None = None,
    ) -> None:
        self.mbox_path, self.index_path = Path(mbox_path), Path(index_path)
        self.lock_path = str(self.mbox_path) + ".lock"
        #: Where this process keeps the file its dot-locks link to (mbox_fs.dotlock_source);
        #: None: a file of its own for each lock.
        self._dotlock_dir = dotlock_dir
        self.settings = settings
        self._new_uidvalidity = new_uidvalidity
        self._vanished_keep = vanished_keep  # read at each change (the store's setting may change)
        self._collapse = collapse_ok and settings.method in ("auto", "collapse")
        self._defrag = settings.defrag and self._collapse
        self._thread_lock = threading.RLock()
        #: Set while work runs `without_waiting` (by the thread holding _thread_lock).
        self._no_wait = False
        self.fd = os.open(self.mbox_path, os.O_RDWR)
        self._bs = mbox_fs.block_size(self.mbox_path.parent)
        self._idx_fd: int | None = None
        self._idx_ino = 0
        self._reset()

    # ----------------------------------------------------------------- state

    def _reset(self) -> None:
        self.generation = 0
        self.uidvalidity = 0
        self.uidnext = 1
        self.recent = 1
        self.modseq = 1  # HIGHESTMODSEQ
        self.vanished: list[Vanished] = []  # ascending MODSEQs
        self.vanished_floor = 0  # the highest MODSEQ forgotten
        self._format = 2  # 1: an index written before MODSEQs (see MAGIC_V1)
        self.segments: list[Segment] = []
        self.by_id: dict[uuid.UUID, Segment] = {}
        #: Bytes (as delivered) and number of the live messages, kept as segments come and go.
        self.live_bytes = 0
        self.live_count = 0
        self.end = 0
        self._log_pos = HEADER_SIZE
        self._snapshot_size = HEADER_SIZE
        self._pending: Plan | None = None
        self._torn_at: int | None = None
        self._damaged: str | None = None
        self._order: list[tuple[int, int, uuid.UUID]] | None = None
        #: (MODSEQ, segment) each time a numbered message took a MODSEQ, in the order the changes
        #: were applied (MODSEQs ascend), so what changed above a MODSEQ is found without a pass
        #: over every message; an entry a later change or a deletion made stale is passed over.
        #: None until asked for (then built by sorting), and again when stale entries pile up.
        self._changes: list[tuple[int, Segment]] | None = None
        #: Segments delivered unnumbered (those numbered or deleted since are dropped when looked at).
        self._fresh: list[Segment] = []
        self._seq = 0

    @classmethod
    def create(cls, mbox_path: Path, index_path: Path, uidvalidity: int, durable: bool = True) -> None:
        """A new, empty mailbox: an empty mbox and an index at generation 1."""
        fd = os.open(mbox_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        mbox_fs.atomic_write(index_path, _header(1, uidvalidity) + _frame(STATE, struct.pack(">IQ", 1, 0)), durable)
        if durable:
            mbox_fs.fsync_dir(mbox_path.parent)

    def close(self) -> None:
        with self._thread_lock:
            for fd in (self.fd, self._idx_fd):
                if fd is not None and fd >= 0:
                    os.close(fd)
            self.fd, self._idx_fd = -1, None

    # ----------------------------------------------------------------- locking

    @contextmanager
    def _locked(self, exclusive: bool, mbox: bool = True) -> Iterator[None]:
        """The fcntl lock (shared or exclusive) and the index brought up to date; with `exclusive`
        and `mbox` also the dot-lock, which only writes of the mbox file itself need (older mbox
        tools know nothing of the index). A recovery takes it whenever it runs."""
        with self._thread_lock:
            if self.fd < 0:
                raise MailboxGone(str(self.mbox_path))
            if not self._no_wait:
                mbox_fs.lock_file(self.fd, exclusive, self.settings.lock_timeout)
            elif exclusive or not mbox_fs.try_lock_file(self.fd, False):
                raise WouldWait  # (a write would wait for the disk)
            dotlocked = False
            try:
                self._check_identity()
                if exclusive and mbox and self.settings.dotlock:
                    mbox_fs.dotlock(self.lock_path, self.settings.lock_timeout, self._dotlock_source)
                    dotlocked = True
                self._sync()
                if self._needs_recovery():
                    if not exclusive:
                        raise NeedsRecovery
                    if self.settings.dotlock and not dotlocked:
                        mbox_fs.dotlock(self.lock_path, self.settings.lock_timeout, self._dotlock_source)
                        dotlocked = True
                    self._recover()
                if exclusive and self._format < 2:  # written before MODSEQs: upgraded in place, once
                    self._checkpoint(self.generation + 1, self.uidvalidity)
                yield
                if exclusive:
                    self._maybe_checkpoint()
            finally:
                if dotlocked:
                    mbox_fs.dotunlock(self.lock_path)
                mbox_fs.unlock_file(self.fd)

    @contextmanager
    def without_waiting(self) -> Iterator[None]:
        """Run reads in the calling thread (the event loop's) only as long as nothing has to be
        waited for: WouldWait is raised where a lock is held elsewhere, a read would go to the
        disk, or the work would write or recover; the caller then does it in a thread."""
        if not self._thread_lock.acquire(blocking=False):
            raise WouldWait
        try:
            self._no_wait = True
            yield
        finally:
            self._no_wait = False
            self._thread_lock.release()

    def _pread(self, length: int, offset: int) -> bytes:
        """Message bytes; without waiting, only from the page cache."""
        if not self._no_wait:
            return mbox_fs.pread_exact(self.fd, length, offset)
        data = mbox_fs.pread_cached(self.fd, length, offset)
        if data is None:
            raise WouldWait
        return data

    @property
    def _dotlock_source(self) -> str | None:
        return mbox_fs.dotlock_source(self._dotlock_dir) if self._dotlock_dir is not None else None

    def writing(self, mbox: bool = True) -> Iterator[None]:
        """The exclusive lock; `mbox=False` for a change that appends to the index only (no
        dot-lock)."""
        return self._locked(True, mbox)  # type: ignore[return-value]

    @contextmanager
    def reading(self) -> Iterator[None]:
        with ExitStack() as stack:
            for _ in range(5):
                try:
                    stack.enter_context(self._locked(False))
                    break
                except NeedsRecovery:
                    with self._locked(True):
                        pass
            else:
                stack.enter_context(self._locked(True))
            yield

    def _check_identity(self) -> None:
        st = os.fstat(self.fd)
        try:
            at_path = os.stat(self.mbox_path)
        except FileNotFoundError:
            raise MailboxGone(str(self.mbox_path)) from None
        if st.st_nlink == 0 or at_path.st_ino != st.st_ino or at_path.st_dev != st.st_dev:
            raise MailboxGone(str(self.mbox_path))

    def _sync_files(self) -> None:
        if self.settings.fsync:
            os.fdatasync(self.fd)

    # ----------------------------------------------------------------- index log

    def _sync(self) -> None:
        """Bring the in-memory index up to date with the file (replaying only what is new)."""
        try:
            st = os.stat(self.index_path)
        except FileNotFoundError:
            self._reset()
            self._damaged = "index missing"
            return
        if self._idx_fd is None or st.st_ino != self._idx_ino or st.st_size < self._log_pos:
            self._load()
        elif st.st_size > self._log_pos and self._torn_at is None:
            self._replay(st.st_size)

    def _load(self) -> None:
        if self._idx_fd is not None:
            os.close(self._idx_fd)
            self._idx_fd = None
        self._reset()
        try:
            fd = os.open(self.index_path, os.O_RDWR)
        except FileNotFoundError:
            self._damaged = "index missing"
            return
        self._idx_fd = fd
        self._idx_ino = os.fstat(fd).st_ino
        header = os.pread(fd, HEADER_SIZE, 0)
        if len(header) < HEADER_SIZE or header[:8] not in (MAGIC, MAGIC_V1) \
                or struct.unpack_from(">I", header, 24)[0] != zlib.crc32(header[:24]):
            self._damaged = "bad index header"
            return
        self._format = 2 if header[:8] == MAGIC else 1
        _, self.generation, self.uidvalidity, _ = _HEADER.unpack_from(header)
        self._replay(os.fstat(fd).st_size)
        self._snapshot_size = max(self._log_pos, HEADER_SIZE)

    def _replay(self, size: int) -> None:
        assert self._idx_fd is not None
        data = mbox_fs.pread_exact(self._idx_fd, size - self._log_pos, self._log_pos)
        pos = 0
        try:
            while pos < len(data):
                if pos + _FRAME.size > len(data):
                    self._torn_at = self._log_pos + pos
                    return
                length, crc, kind = _FRAME.unpack_from(data, pos)
                body = data[pos + _FRAME.size : pos + _FRAME.size + length]
                if len(body) < length or zlib.crc32(bytes([kind]) + body) != crc:
                    if pos + _FRAME.size + length >= len(data):
                        self._torn_at = self._log_pos + pos  # the last record, cut short by a crash
                    else:
                        self._damaged = f"bad index record at {self._log_pos + pos}"
                    return
                try:
                    self._apply_record(kind, body)
                except (struct.error, ValueError, KeyError, UnicodeDecodeError) as exc:
                    self._damaged = f"index record at {self._log_pos + pos} does not apply: {exc!r}"
                    return
                pos += _FRAME.size + length
        finally:
            self._log_pos += pos

    def _apply_record(self, kind: int, body: bytes) -> None:
        if kind == ENTRY:
            seg = Segment.decode(body)
            self._add_segment(seg)
            self.modseq = max(self.modseq, seg.modseq)  # a message moved by a flag change: the call's MODSEQ
        elif kind == STATE:
            self.uidnext, end = struct.unpack(">IQ", body)
            if end != self.end:
                raise ValueError(f"index state says the mbox ends at {end}, its entries at {self.end}")
        elif kind == FLAGS:
            for message_id, flags in _decode_id_flags(body):
                seg = self.by_id.get(message_id)
                if seg is not None:
                    seg.flags = flags
        elif kind == DELETE:
            for i in range(0, len(body), 16):
                seg = self.by_id.get(uuid_from_bytes(body[i : i + 16]))
                if seg is not None and not seg.deleted:
                    self._uncount(seg)
                    seg.deleted = True
                    self._order_changed(seg.id, False)
        elif kind == UIDS:
            (self.uidnext,) = struct.unpack_from(">I", body)
            for i in range(4, len(body), 20):
                seg = self.by_id.get(uuid_from_bytes(body[i : i + 16]))
                if seg is not None:
                    (seg.uid,) = struct.unpack_from(">I", body, i + 16)
            self._changes = None  # (numbered without a MODSEQ: built again when asked for)
        elif kind == FLAGS_AT:
            modseq = self._apply_change(body)
            for message_id, flags in _decode_id_flags(body[_CHANGE.size :]):
                seg = self.by_id.get(message_id)
                if seg is not None:
                    seg.flags = flags
                    if seg.uid:
                        seg.modseq = modseq
                        self._changed(seg)
        elif kind == DELETE_AT:
            modseq = self._apply_change(body)
            gone = []
            for i in range(_CHANGE.size, len(body), 16):
                seg = self.by_id.get(uuid_from_bytes(body[i : i + 16]))
                if seg is not None and not seg.deleted:
                    self._uncount(seg)
                    seg.deleted = True
                    self._order_changed(seg.id, False)
                    if seg.uid:
                        gone.append(seg.uid)
            self._remember_vanished(body, gone)
        elif kind == UIDS_AT:
            modseq = self._apply_change(body)
            (self.uidnext,) = struct.unpack_from(">I", body, _CHANGE.size)
            given_up = []
            for i in range(_CHANGE.size + 4, len(body), 20):
                seg = self.by_id.get(uuid_from_bytes(body[i : i + 16]))
                if seg is not None:
                    (uid,) = struct.unpack_from(">I", body, i + 16)
                    if seg.uid and seg.uid != uid:
                        given_up.append(seg.uid)
                    seg.uid, seg.modseq = uid, modseq
                    self._changed(seg)
            self._remember_vanished(body, given_up)
        elif kind == MODSEQS:
            self._apply_modseqs(body)
        elif kind == RECENT:
            (self.recent,) = struct.unpack(">Q", body)
        elif kind == COMPACT_BEGIN:
            self._pending = Plan.decode(body)
        elif kind == COMPACT_END:
            (seq,) = struct.unpack(">I", body)
            if self._pending is None or self._pending.seq != seq:
                raise ValueError("compaction end without its beginning")
            self._apply_plan(self._pending)
            self._pending = None
        else:
            raise ValueError(f"unknown index record type {kind}")

    def _apply_change(self, body: bytes) -> int:
        """The MODSEQ of a change record, after raising the counter to it and forgetting the
        vanished UIDs its writer dropped."""
        modseq, _, floor = _CHANGE.unpack_from(body)
        self.modseq = max(self.modseq, modseq)
        if floor > self.vanished_floor:
            self.vanished_floor = floor
            del self.vanished[: bisect.bisect_right(self.vanished, floor, key=lambda v: v.modseq)]
        return int(modseq)

    def _remember_vanished(self, body: bytes, uids: list[int]) -> None:
        modseq, when_us, _ = _CHANGE.unpack_from(body)
        if uids and modseq > self.vanished_floor:
            if self.vanished and modseq <= self.vanished[-1].modseq:
                raise ValueError(f"vanished UIDs at MODSEQ {modseq} after MODSEQ {self.vanished[-1].modseq}")
            self.vanished.append(Vanished(modseq, when_us, tuple(sorted(uids))))

    def _apply_modseqs(self, body: bytes) -> None:
        """A checkpoint's MODSEQ state: the counter, the floor and the vanished list."""
        highest, floor, count = struct.unpack_from(">QQI", body)
        pos = struct.calcsize(">QQI")
        vanished = []
        for _ in range(count):
            modseq, when_us, n = _VANISHED.unpack_from(body, pos)
            pos += _VANISHED.size
            uids = struct.unpack_from(f">{n}I", body, pos)
            pos += 4 * n
            if modseq <= floor or modseq > highest or (vanished and modseq <= vanished[-1].modseq):
                raise ValueError(f"vanished UIDs at MODSEQ {modseq} out of order")
            vanished.append(Vanished(modseq, when_us, uids))
        if pos != len(body):
            raise ValueError("MODSEQ state longer than its vanished list")
        self.modseq, self.vanished_floor, self.vanished = max(self.modseq, highest), floor, vanished

    def _encode_modseqs(self, floor: int) -> bytes:
        kept = [v for v in self.vanished if v.modseq > floor]
        out = bytearray(struct.pack(">QQI", self.modseq, floor, len(kept)))
        for v in kept:
            out += _VANISHED.pack(v.modseq, v.time_us, len(v.uids)) + struct.pack(f">{len(v.uids)}I", *v.uids)
        return bytes(out)

    def _change(self, modseq: int) -> bytes:
        """The prefix of a change record: its MODSEQ (0: it changes no numbered message), the time
        and the vanished floor, dropping the calls older than `vanished_keep` (oldest first, so
        none is dropped before its time even if clocks disagree)."""
        now_us = time.time_ns() // 1000
        return _CHANGE.pack(modseq, now_us, self._expired_floor(now_us))

    def _expired_floor(self, now_us: int) -> int:
        cutoff = now_us - int(self._vanished_keep() * 1_000_000)
        floor = self.vanished_floor
        for v in self.vanished:
            if v.time_us >= cutoff:
                break
            floor = v.modseq
        return floor

    def _add_segment(self, seg: Segment) -> None:
        if seg.off != self.end:
            raise ValueError(f"segment at {seg.off} does not follow the end {self.end}")
        if seg.id is not None:
            old = self.by_id.get(seg.id)
            was_live = old is not None and old.live
            if old is not None:  # a message moved to the end (its flags outgrew their slot)
                self._uncount(old)
                old.id, old.deleted = None, False
            self.by_id[seg.id] = seg
            if was_live != seg.live:
                self._order_changed(seg.id, seg.live)
            if seg.live:
                if seg.uid:
                    self._changed(seg)
                else:
                    self._fresh.append(seg)
                    if len(self._fresh) > 2 * self.live_count + 1024:  # (nobody looked for a while)
                        self._fresh = [f for f in self._fresh if f.live and not f.uid]
            if seg.live:
                self.live_bytes += seg.raw
                self.live_count += 1
        self.segments.append(seg)
        self.end += seg.length

    def _uncount(self, seg: Segment) -> None:
        """Take a live message out of the totals (it is being deleted or replaced)."""
        if seg.live:
            self.live_bytes -= seg.raw
            self.live_count -= 1

    def _append_log(self, records: Sequence[tuple[int, bytes]], durable: bool = True) -> None:
        """Append records to the index and make them durable: the commit point of an operation.
        Not `durable`: left to the next record that is (a \\Recent claim: see claim_recent)."""
        assert self._idx_fd is not None
        data = b"".join(_frame(kind, body) for kind, body in records)
        mbox_fs.pwrite_all(self._idx_fd, data, self._log_pos)
        if self.settings.fsync and durable:
            os.fdatasync(self._idx_fd)
        mbox_fs.crash_point("index.appended")
        self._log_pos += len(data)

    def _commit(self, records: Sequence[tuple[int, bytes]], durable: bool = True) -> None:
        """Log records, then apply them to memory exactly as a replay in another process would."""
        self._append_log(records, durable)
        for kind, body in records:
            self._apply_record(kind, body)

    def _maybe_checkpoint(self) -> None:
        if self._log_pos - self._snapshot_size > max(CHECKPOINT_MIN, self._snapshot_size):
            self._checkpoint(self.generation + 1, self.uidvalidity)

    def _checkpoint(self, generation: int, uidvalidity: int) -> None:
        """Write the whole state into a new index file and rename it over the old one."""
        records = [_frame(ENTRY, s.encode()) for s in self.segments]
        records.append(_frame(STATE, struct.pack(">IQ", self.uidnext, self.end)))
        if self.recent > 1:
            records.append(_frame(RECENT, struct.pack(">Q", self.recent)))
        records.append(_frame(MODSEQS, self._encode_modseqs(self._expired_floor(time.time_ns() // 1000))))
        body = _header(generation, uidvalidity) + b"".join(records)
        mbox_fs.crash_point("checkpoint.before")
        mbox_fs.atomic_write(self.index_path, body, self.settings.fsync)
        mbox_fs.crash_point("checkpoint.renamed")
        self._load()
        if self._damaged:
            raise OSError(errno.EIO, f"index {self.index_path} unreadable right after writing it: {self._damaged}")

    # ----------------------------------------------------------------- recovery

    def _needs_recovery(self) -> bool:
        return bool(
            self._damaged or self._pending or self._torn_at is not None or os.fstat(self.fd).st_size != self.end
        )

    def _recover(self) -> None:
        """Repair what a crashed writer (or another mbox tool) left; the exclusive lock is held."""
        if self._damaged:
            log.warning("rebuilding index of %s: %s", self.mbox_path, self._damaged)
            self._rebuild()
            return
        if self._torn_at is not None:
            assert self._idx_fd is not None
            os.ftruncate(self._idx_fd, self._torn_at)
            if self.settings.fsync:
                os.fsync(self._idx_fd)
            self._torn_at = None
            self._sync()
        if self._pending is not None and not self._finish_plan(self._pending):
            log.warning("rebuilding index of %s: an interrupted compaction does not match the file", self.mbox_path)
            self._rebuild()
            return
        size = os.fstat(self.fd).st_size
        if size > self.end:
            self._adopt_tail()
        elif size < self.end or not self._spot_check():
            log.warning("rebuilding index of %s: it does not match the mbox (changed by another tool?)", self.mbox_path)
            self._rebuild()

    def _spot_check(self) -> bool:
        """Does the last message sit where the index says? (Cheap; catches an mbox rewritten by another tool.)"""
        last = next((s for s in reversed(self.segments) if s.id is not None), None)
        if last is None:
            return True
        if os.pread(self.fd, 5, last.off) != b"From ":
            return False
        return last.meta == 0 or self._meta_matches(last)

    def _meta_matches(self, seg: Segment) -> bool:
        parsed = parse_meta(self._pread(seg.meta, seg.off + seg.head))
        return parsed is not None and parsed[0] == seg.id

    def _ensure_separator(self) -> None:
        """Make the file end with a blank line, so the next From_ line starts a record for every reader."""
        size = os.fstat(self.fd).st_size
        if size == 0:
            return
        last = os.pread(self.fd, 2, max(size - 2, 0))
        missing = b"" if last == b"\n\n" else b"\n" if last.endswith(b"\n") and size >= 2 else b"\n\n"
        if missing:
            mbox_fs.pwrite_all(self.fd, missing, size)
            self._sync_files()

    def _adopt_tail(self) -> None:
        """Index bytes past the known end: a delivery that died before its index record (dead space:
        it was never acknowledged), or messages another tool appended (adopted)."""
        self._ensure_separator()
        size = os.fstat(self.fd).st_size
        tail = mbox_fs.pread_exact(self.fd, size - self.end, self.end)
        entries = []
        off = self.end
        taken: set[uuid.UUID] = set()
        for rec in scan(tail, int(os.fstat(self.fd).st_mtime * 1_000_000)):
            seg = _segment(rec, off)
            if seg.meta or seg.id is None:
                seg = Segment(off, rec.length)
            else:
                seg.id = _unique_id(seg.id, lambda i: i in self.by_id or i in taken)
                taken.add(seg.id)
            entries.append((ENTRY, seg.encode()))
            off += rec.length
        self._commit(entries)
        self._truncate_dead_tail()

    def _rebuild(self) -> None:
        """A new index from the mbox alone (new generation, new UIDVALIDITY, no UIDs)."""
        self._ensure_separator()
        size = os.fstat(self.fd).st_size
        mtime_us = int(os.fstat(self.fd).st_mtime * 1_000_000)
        generation = self.generation + 1 if self.generation else int(time.time())
        segments: list[Segment] = []
        if size:
            with mmap.mmap(self.fd, size, prot=mmap.PROT_READ) as view:
                segments = [_segment(rec, rec.offset) for rec in scan(view, mtime_us)]  # type: ignore[arg-type]
        seen: dict[uuid.UUID, Segment] = {}
        for seg in segments:
            if seg.id is None:
                continue
            earlier = seen.get(seg.id)
            if earlier is not None and seg.meta:  # one of ours moved to the end: the later copy is current
                earlier.id, earlier.deleted = None, False
            elif earlier is not None:  # two identical records of another tool: both are messages
                seg.id = _unique_id(seg.id, lambda i: i in seen)
            seen[seg.id] = seg
        self._reset()
        for seg in segments:
            self._add_segment(seg)
        self.uidnext = 1
        self._checkpoint(generation, self._new_uidvalidity())

    # ----------------------------------------------------------------- delivery

    def deliver(
        self, raw: memoryview, message_id: uuid.UUID, when_us: int, flags: frozenset[str], number: bool = False
    ) -> int | None:
        """Append one message; durable (both files fdatasync'd) when this returns. With `number`
        (Store.append) it gets its UID in the same index append, and the UID is returned."""
        stored = quote(raw)
        capacity = keyword_capacity(flags, self.settings.keyword_reserve)
        with self.writing():
            self._truncate_dead_tail()
            self._append_record(
                from_line(raw, when_us), message_id, when_us, len(raw), [stored], len(stored),
                trailer_length(raw), flags, capacity, uid=0, number=number,
            )
            return self.by_id[message_id].uid if number else None

    def _append_record(
        self,
        first_line: bytes,
        message_id: uuid.UUID,
        when_us: int,
        raw_len: int,
        stored_parts: Iterable[bytes | memoryview],
        stored_len: int,
        trail: int,
        flags: frozenset[str],
        capacity: int,
        uid: int,
        modseq: int = 0,
        number: bool = False,
    ) -> None:
        head = record_head(first_line, message_id, when_us, raw_len, stored_len, flags, capacity)
        meta_len = len(head) - len(first_line) - slot_length(capacity)
        off = self.end
        mbox_fs.crash_point("append.before")
        mbox_fs.pwrite_all(self.fd, head, off)
        pos = off + len(head)
        for part in stored_parts:
            mbox_fs.pwrite_all(self.fd, part, pos)
            pos += len(part)
        mbox_fs.pwrite_all(self.fd, b"\n" * trail, pos)
        mbox_fs.crash_point("append.written")
        self._sync_files()
        mbox_fs.crash_point("append.synced")
        seg = Segment(
            off, pos + trail - off, message_id, len(first_line), len(first_line), meta_len, capacity, stored_len,
            raw_len, when_us, flags, uid, modseq=modseq,
        )
        self._commit([(ENTRY, seg.encode())] + ([self._uids_record([message_id])] if number else []))

    # ----------------------------------------------------------------- listing and reading

    def _ordered(self) -> list[tuple[int, int, uuid.UUID]]:
        """The live messages' ids in arrival order (TimeUUID time, then the id), as sort keys."""
        if self._order is None:
            self._order = sorted(_order_key(s.id) for s in self.by_id.values() if s.live)  # type: ignore[arg-type]
        return self._order

    def _order_changed(self, message_id: uuid.UUID, live: bool) -> None:
        """Keep the order made by `_ordered` (if any) as a message comes or goes: a delivery
        lands at the end, so a mailbox that grows is not sorted again."""
        order = self._order
        if order is None:
            return
        key = _order_key(message_id)
        if live:
            if not order or order[-1] < key:
                order.append(key)
            else:
                bisect.insort(order, key)
            return
        at = bisect.bisect_left(order, key)
        if at < len(order) and order[at] == key:
            del order[at]

    def page(self, after: uuid.UUID | None, limit: int) -> tuple[list[MessageSummary], uuid.UUID | None]:
        with self.reading():
            order = self._ordered()
            start = 0 if after is None else bisect.bisect_right(order, (after.time, after.int, after))
            chosen = order[start : start + limit]
            items = [self.by_id[i].summary() for _, _, i in chosen]
            more = start + limit < len(order)
            return items, (items[-1].id if more and items else None)

    def summaries(self, ids: Iterable[uuid.UUID]) -> dict[uuid.UUID, MessageSummary]:
        with self.reading():
            return {i: s.summary() for i in ids if (s := self.by_id.get(i)) is not None and s.live}

    def read_step(self, state: ReadState) -> bytes | None:
        """The next piece of a message's bytes [start, end), or None at the end. Holds the shared lock
        only for this step; the message is looked up again each time (compaction may move it)."""
        if state.done:
            return None
        with self.reading():
            seg = self.by_id.get(state.message_id)
            if seg is None or not seg.live:
                raise MessageGone(state.message_id)
            if not state.checked:
                if seg.meta and not self._meta_matches(seg):
                    self._damaged = f"message {state.message_id} is not where the index says"
                    raise NeedsRecovery
                state.checked = True
                state.size = seg.raw
            end = seg.raw if state.end is None else min(state.end, seg.raw)
            if state.start >= end:
                state.done = True
                return None
            if seg.stored == seg.raw:  # nothing was quoted: stored offsets are message offsets
                pos = max(state.start, state.raw_pos)
                n = min(READ_CHUNK, end - pos)
                data = self._pread(n, seg.content_off + pos)
                state.raw_pos = pos + n
                state.done = state.raw_pos >= end
                return data
            # Quoted lines: unquote from the start, passing over bytes before `start`.
            if state.unquoter is None:
                state.unquoter = Unquoter()
            piece = b""
            while not piece and state.stored_pos < seg.stored and state.raw_pos < end:
                n = min(READ_CHUNK, seg.stored - state.stored_pos)
                chunk = self._pread(n, seg.content_off + state.stored_pos)
                state.stored_pos += n
                out = state.unquoter.feed(chunk)
                if state.stored_pos >= seg.stored:
                    out += state.unquoter.finish()
                lo = state.raw_pos
                state.raw_pos += len(out)
                piece = out[max(state.start - lo, 0) : max(end - lo, 0)]
            state.done = state.raw_pos >= end or state.stored_pos >= seg.stored
            return piece or None

    # ----------------------------------------------------------------- flags

    def store_flags(
        self, ids: Iterable[uuid.UUID], change: Callable[[frozenset[str]], frozenset[str]],
        unchanged_since: int | None = None,
    ) -> set[uuid.UUID]:
        """Change flags; the numbered messages changed share one new MODSEQ. With `unchanged_since`,
        a numbered message whose MODSEQ is above it is left alone and returned (MODIFIED), as
        decided under the write lock."""
        with self.writing():
            changes = []
            modified = set()
            for message_id in dict.fromkeys(ids):
                seg = self.by_id.get(message_id)
                if seg is None or not seg.live:
                    continue
                if unchanged_since is not None and seg.uid and (seg.modseq or 1) > unchanged_since:
                    modified.add(message_id)
                    continue
                new = change(seg.flags)
                if new != seg.flags:
                    changes.append((seg, new))
            if not changes:
                return modified
            modseq = self.modseq + 1 if any(s.uid for s, _ in changes) else 0
            in_place = [(s, f) for s, f in changes if s.capacity >= len(keywords_text(f))]
            moved = [(s, f) for s, f in changes if s.capacity < len(keywords_text(f))]
            for seg, new in moved:
                self._relocate(seg, new, modseq if seg.uid else seg.modseq)
            if in_place:
                mbox_fs.crash_point("flags.before")
                for seg, new in in_place:
                    mbox_fs.pwrite_all(self.fd, encode_slot(new, False, seg.capacity), seg.slot_off)
                mbox_fs.crash_point("flags.written")
                # The index record is the change (every reader takes flags from it); the slots
                # are the mbox's own copy, for other mbox tools and a rebuild, and reach the disk
                # with the file's next sync or the kernel's writeback: no fdatasync of their own.
                self._commit([(FLAGS_AT, self._change(modseq) + _encode_id_flags(in_place))])
            if moved and self.settings.compact_on_delete:  # reclaim the old copies as a deletion would
                self._compact(self.settings.compact_budget, self.settings.compact_seconds, defrag_all=False)
            return modified

    def _relocate(self, seg: Segment, flags: frozenset[str], modseq: int) -> None:
        """Move a message to the end with a larger flag slot (its keywords outgrew the old one)."""
        assert seg.id is not None
        old_slot, old_capacity = seg.slot_off, seg.capacity
        first_line = os.pread(self.fd, seg.from_len, seg.off)
        stored_len = seg.stored
        last = os.pread(self.fd, 1, seg.content_off + stored_len - 1) if stored_len else b""
        parts = self._stored_parts(seg)
        trail = 1 if stored_len == 0 or last == b"\n" else 2
        self._truncate_dead_tail()
        self._append_record(
            first_line, seg.id, seg.date_us, seg.raw, parts, stored_len, trail, flags,
            keyword_capacity(flags, self.settings.keyword_reserve), seg.uid, modseq,
        )
        if old_capacity >= 0:  # so a rebuild never takes the old copy for the current one
            mbox_fs.pwrite_all(self.fd, encode_slot(frozenset(), True, old_capacity), old_slot)

    def _stored_parts(self, seg: Segment) -> Iterator[bytes]:
        off, left = seg.content_off, seg.stored
        while left:
            n = min(left, 1 << 20)
            yield mbox_fs.pread_exact(self.fd, n, off)
            off, left = off + n, left - n

    # ----------------------------------------------------------------- UIDs

    def assign_uids(
        self, ids: Sequence[uuid.UUID], renumber: Mapping[uuid.UUID, int] | None = None
    ) -> dict[uuid.UUID, int]:
        """See Store.assign_uids. The check is repeated under the write lock, so of two
        processes renumbering one message only the first moves it; a renumbered message's new
        UID is one UIDS_AT record, like a first one, and its old UID stays below uidnext forever
        (and vanishes with the call's MODSEQ, which every message numbered gets)."""
        wanted = uid_work(ids, renumber)

        def live(i: uuid.UUID) -> Segment | None:
            s = self.by_id.get(i)
            return s if s is not None and s.live else None

        def todo() -> list[uuid.UUID]:
            return [i for i in wanted if (s := live(i)) is not None and needs_uid(s.uid, i, renumber)]

        with self.reading():
            if not todo():
                return {i: s.uid for i in wanted if (s := live(i)) is not None}
        with self.writing(mbox=False):
            missing = todo()
            if missing:
                self._commit([self._uids_record(missing)])
            return {i: s.uid for i in wanted if (s := live(i)) is not None}

    def _uids_record(self, ids: Sequence[uuid.UUID]) -> tuple[int, bytes]:
        """The UIDS_AT record numbering `ids` from UIDNEXT on, with the next MODSEQ."""
        return UIDS_AT, self._change(self.modseq + 1) + struct.pack(">I", self.uidnext + len(ids)) + b"".join(
            i.bytes + struct.pack(">I", self.uidnext + n) for n, i in enumerate(ids)
        )

    def uid_next(self) -> int:
        with self.reading():
            return self.uidnext

    def status(self, recent: bool) -> MailboxStatus:
        """Store.mailbox_status in one pass over the index in memory (no summary made)."""
        with self.reading():
            live = ((seg.flags, seg.raw, seg.uid or None) for seg in self.by_id.values() if seg.live)
            return count_status(live, self.uidnext, self.recent if recent else None)

    def changes_token(self) -> tuple[int, int, int]:
        """Every change appends to the index (a checkpoint writes a new one): its identity and
        length after replaying what others appended tell whether anything changed."""
        with self.reading():
            return self.generation, self._idx_ino or 0, self._log_pos

    def recent_mark(self) -> int:
        with self.reading():
            return self.recent

    def claim_recent(self, below: int) -> int:
        """See Store.claim_recent: the mark is compared again under the write lock, so of two
        processes claiming at once the second finds the first's RECENT record and claims only
        what lies above it. A claim the mark already covers takes the shared lock only.

        The RECENT record is not synced on its own: it reaches the disk with the next record
        that is, or the kernel's writeback. A claim lost to a power cut only shows its messages
        as \\Recent once more, to the next session that claims them."""
        with self.reading():
            if self.recent >= below:
                return self.recent
        with self.writing(mbox=False):
            before = self.recent
            if before < below:
                self._commit([(RECENT, struct.pack(">Q", below))], durable=False)
            return before

    def highest_modseq(self) -> int:
        with self.reading():
            return self.modseq

    def changed_since(self, modseq: int) -> list[MessageSummary]:
        """Numbered live messages whose MODSEQ is above `modseq`, in arrival order (one pass over
        the index in memory, no summary made for the others)."""
        with self.reading():
            return self._changed_since(modseq)

    def vanished_since(self, modseq: int) -> list[int] | None:
        """UIDs that vanished with a MODSEQ above `modseq`, ascending; None when some may be forgotten."""
        with self.reading():
            return self._vanished_since(modseq)

    def changes_since(self, modseq: int) -> tuple[list[MessageSummary], list[int] | None]:
        """Both under one lock (Store.changes_since): ([], None) when expunges may be forgotten."""
        with self.reading():
            vanished = self._vanished_since(modseq)
            return ([], None) if vanished is None else (self._changed_since(modseq), vanished)

    def arrivals(self, modseq: int) -> tuple[list[MessageSummary], int]:
        """The live messages unnumbered yet or numbered (or changed) above `modseq`, in arrival
        order, and HIGHESTMODSEQ now, read together: every message delivered since a look that
        saw `modseq` is among them (Store.arrivals)."""
        with self.reading():
            self._fresh = [seg for seg in self._fresh if seg.live and not seg.uid]
            found = {id(seg): seg for seg in self._fresh}
            found.update((id(seg), seg) for seg in self._changed_above(modseq))
            return [seg.summary() for seg in _in_arrival_order(found.values())], self.modseq

    def _changed_since(self, modseq: int) -> list[MessageSummary]:
        return [seg.summary() for seg in _in_arrival_order(self._changed_above(modseq))]

    def _changed_above(self, modseq: int) -> list[Segment]:
        """The live numbered segments whose MODSEQ is above `modseq`, each once."""
        changes = self._changes
        if changes is None or len(changes) > 2 * self.live_count + 1024:
            changes = self._changes = sorted(
                ((seg.modseq or 1, seg) for seg in self.by_id.values() if seg.live and seg.uid), key=_first)
        start = bisect.bisect_right(changes, modseq, key=_first)
        found: dict[int, Segment] = {}
        for at, seg in changes[start:]:
            if seg.live and seg.uid and (seg.modseq or 1) == at:  # (else a later change or a deletion's)
                found[id(seg)] = seg
        return list(found.values())

    def _changed(self, seg: Segment) -> None:
        if self._changes is not None:
            self._changes.append((seg.modseq or 1, seg))

    def _vanished_since(self, modseq: int) -> list[int] | None:
        if modseq < self.vanished_floor:
            return None
        start = bisect.bisect_right(self.vanished, modseq, key=lambda v: v.modseq)
        return sorted(uid for v in self.vanished[start:] for uid in v.uids)

    def usage(self) -> tuple[int, int, list[int]]:
        """(bytes, messages) of the live messages and the index file's identity they go with
        (inode, size, mtime in ns), read under the lock: the store's quota cache keeps the pair
        and trusts it while the index file keeps that identity (every change appends to it or
        replaces it)."""
        with self.reading():
            stamp = [0, 0, 0]
            if self._idx_fd is not None:
                st = os.fstat(self._idx_fd)
                stamp = [st.st_ino, st.st_size, st.st_mtime_ns]
            return self.live_bytes, self.live_count, stamp

    def info(self) -> int:
        """The UIDVALIDITY (read under the lock, so a rebuild's new one is seen)."""
        with self.reading():
            return self.uidvalidity

    # ----------------------------------------------------------------- deletion and compaction

    def delete(self, ids: Iterable[uuid.UUID], only_deleted: bool = False,
               deleted: set[uuid.UUID] | None = None) -> CompactReport | None:
        """Mark messages deleted (durable before anything else), then compact within the budget.
        The UIDs of the numbered ones vanish with one new MODSEQ. `only_deleted`: only those
        whose flags hold \\Deleted (Store.delete_messages); `deleted` gets the ids deleted."""
        with self.writing():
            victims = [s for i in dict.fromkeys(ids) if (s := self.by_id.get(i)) is not None and s.live
                       and (not only_deleted or "\\Deleted" in s.flags)]
            if not victims:
                return None
            if deleted is not None:
                deleted.update(s.id for s in victims)  # type: ignore[misc]
            mbox_fs.crash_point("delete.before")
            modseq = self.modseq + 1 if any(s.uid for s in victims) else 0
            gone = b"".join(s.id.bytes for s in victims)  # type: ignore[union-attr]
            self._commit([(DELETE_AT, self._change(modseq) + gone)])
            for seg in victims:
                if seg.capacity >= 0:
                    mbox_fs.pwrite_all(self.fd, encode_slot(seg.flags, True, seg.capacity), seg.slot_off)
            mbox_fs.crash_point("delete.marked")
            self._sync_files()
            if not self.settings.compact_on_delete:
                return None
            return self._compact(self.settings.compact_budget, self.settings.compact_seconds, defrag_all=False)

    def compact(self, budget: int | None = None, seconds: float | None = None, defrag_all: bool = True) -> CompactReport:
        """Reclaim every dead byte the budget allows (none: all of them) and, with `defrag_all`,
        merge small extents over the whole file."""
        with self.writing():
            return self._compact(budget, seconds, defrag_all)

    def dead_bytes(self) -> int:
        with self.reading():
            return sum(s.length for s in self.segments if not s.live)

    def _truncate_dead_tail(self) -> None:
        """Cut dead segments off the end before appending (a crashed delivery, a moved message)."""
        if self.segments and not self.segments[-1].live:
            i = len(self.segments)
            while i and not self.segments[i - 1].live:
                i -= 1
            a = self.segments[i].off
            self._run_plan(Plan(self._next_seq(), self.end, [Run(RUN_TRUNCATE, a, a, self.end - a)]))

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _compact(self, budget: int | None, seconds: float | None, defrag_all: bool) -> CompactReport:
        started = time.monotonic()
        report = CompactReport()
        spent = 0
        if self._collapse:
            runs, spent = self._plan_collapse(budget)
            points: list[int] = []
            if runs:
                points = self._run_plan(Plan(self._next_seq(), self.end, runs))
                report.runs = len(runs)
                report.collapses = sum(1 for r in runs if r.kind == RUN_COLLAPSE and r.removed)
                report.reclaimed = sum(r.removed for r in runs)
                report.written = sum(len(r.head) for r in runs)
            deadline = time.monotonic() + seconds if seconds else None  # the time limit is defragmentation's
            if points and self._defrag:
                remaining = None if budget is None else max(budget - spent, 0)
                report.moved = self._defrag_points(points, remaining, deadline)
            if self._defrag and defrag_all:
                remaining = None if budget is None else max(budget - spent - report.moved, 0)
                report.moved += self._defrag_everywhere(remaining, deadline)
        else:
            report = self._compact_rewrite(budget)
        report.left = sum(s.length for s in self.segments if not s.live)
        report.seconds = time.monotonic() - started
        return report

    def _dead_runs(self) -> list[tuple[int, int]]:
        """(first, last) segment indexes of each maximal run of dead segments."""
        runs = []
        i = 0
        while i < len(self.segments):
            if self.segments[i].live:
                i += 1
                continue
            j = i
            while j + 1 < len(self.segments) and not self.segments[j + 1].live:
                j += 1
            runs.append((i, j))
            i = j + 1
        return runs

    def _plan_collapse(self, budget: int | None) -> tuple[list[Run], int]:
        """Runs from the highest offset down, as many as the budget pays for (at least one)."""
        bs = self._bs
        runs: list[Run] = []
        spent = 0
        for first, last in reversed(self._dead_runs()):
            a = self.segments[first].off
            if last + 1 == len(self.segments):
                run = Run(RUN_TRUNCATE, a, a, self.end - a)
                cost = 0
            else:
                nxt = self.segments[last + 1]
                e = nxt.off + nxt.head
                start = -(-a // bs) * bs
                removed = max(0, (e // bs) * bs - start)
                while removed > 0 and e - a - removed < nxt.from_len + PAD_MIN:
                    removed -= bs
                gap = e - a - removed
                if gap < nxt.from_len + PAD_MIN:
                    continue  # too small to absorb: it waits for a neighbour to be deleted
                head = os.pread(self.fd, nxt.from_len, nxt.off) + pad(gap - nxt.from_len)
                run = Run(RUN_COLLAPSE, a, start, removed, nxt.id, head)
                cost = len(head) + (COLLAPSE_COST if removed else 0)
            if runs and budget is not None and spent + cost > budget:
                break
            runs.append(run)
            spent += cost
        return runs, spent

    def _run_plan(self, plan: Plan) -> list[int]:
        """Log a plan, carry it out, log its end, apply it; returns the collapse points afterwards."""
        self._commit([(COMPACT_BEGIN, plan.encode())])
        mbox_fs.crash_point("compact.begun")
        if not self._finish_plan(plan):
            raise OSError(errno.EIO, f"{self.mbox_path} changed size under an exclusive lock")
        shift = 0
        points = []
        for run in sorted(plan.runs, key=lambda r: r.a):
            if run.kind == RUN_COLLAPSE and run.removed:
                points.append(run.start - shift)
            shift += run.removed
        return points

    def _finish_plan(self, plan: Plan) -> bool:
        """Carry out a logged plan from wherever a previous attempt stopped; False if the file
        is in no state the plan could have produced (then the caller rebuilds)."""
        if plan.runs and plan.runs[0].kind == RUN_REWRITE:
            return self._finish_rewrite(plan)
        size = os.fstat(self.fd).st_size
        sizes = [plan.size_before]
        for run in plan.runs:
            sizes.append(run.a if run.kind == RUN_TRUNCATE else sizes[-1] - run.removed)
        if size not in sizes:
            return False
        done = sizes.index(size)  # runs [0, done) have changed the size; run done-1's pad may be missing
        for n, run in enumerate(plan.runs):
            if n < done - 1:
                continue
            collapsed = n < done
            if run.kind == RUN_TRUNCATE:
                if not collapsed:
                    os.ftruncate(self.fd, run.a)
                    mbox_fs.crash_point("compact.truncated")
                continue
            if run.removed and not collapsed:
                mbox_fs.collapse_range(self.fd, run.start, run.removed)
                mbox_fs.crash_point("compact.collapsed")
            mbox_fs.pwrite_all(self.fd, run.head, run.a)
            mbox_fs.crash_point("compact.absorbed")
        self._sync_files()
        mbox_fs.crash_point("compact.synced")
        self._commit([(COMPACT_END, struct.pack(">I", plan.seq))])
        return True

    def _apply_plan(self, plan: Plan) -> None:
        """The index side of a finished plan: drop the dead segments, move the next messages' From_
        lines down, shift everything above by what was removed below it."""
        if plan.runs and plan.runs[0].kind == RUN_REWRITE:
            self._apply_rewrite(plan)
            return
        runs = sorted(plan.runs, key=lambda r: r.a)
        out: list[Segment] = []
        shift = 0
        i = j = 0
        segs = self.segments
        while i < len(segs):
            seg = segs[i]
            if j < len(runs) and seg.off == runs[j].a:
                run = runs[j]
                while i < len(segs) and not segs[i].live:
                    if segs[i].id is not None:
                        del self.by_id[segs[i].id]  # type: ignore[arg-type]
                    i += 1
                if run.kind == RUN_TRUNCATE:
                    if i != len(segs):
                        raise ValueError("truncation would cut live messages")
                    shift += run.removed
                    j += 1
                    break
                nxt = segs[i]
                if nxt.id != run.next_id:
                    raise ValueError("compaction plan does not match the index")
                old_end = nxt.off + nxt.length
                nxt.length = old_end - run.removed - run.a
                nxt.off = run.a - shift
                nxt.head = len(run.head)
                shift += run.removed
                out.append(nxt)
                i += 1
                j += 1
                continue
            seg.off -= shift
            out.append(seg)
            i += 1
        if j != len(runs):
            raise ValueError("compaction plan names regions the index does not have")
        self.segments = out
        self.end = out[-1].off + out[-1].length if out else 0
        self._order = None

    # ----------------------------------------------------------------- rewrite fallback

    def _compact_rewrite(self, budget: int | None) -> CompactReport:
        """Where ranges cannot be collapsed: rewrite everything after the first dead byte, through a
        side file (written and fsync'd before the plan is logged) so a crash can always redo it."""
        report = CompactReport()
        runs = self._dead_runs()
        if not runs:
            return report
        a = self.segments[runs[0][0]].off
        keep = [s for s in self.segments[runs[0][0] :] if s.live]
        new_tail = sum(s.length for s in keep)
        if budget is not None and new_tail > budget:
            return report
        side = str(self.index_path) + ".tail"
        fd = os.open(side, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            pos = 0
            for seg in keep:
                for part in _ranges(seg.off, seg.length):
                    data = mbox_fs.pread_exact(self.fd, part[1], part[0])
                    mbox_fs.pwrite_all(fd, data, pos)
                    pos += len(data)
            if self.settings.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        removed = self.end - a - new_tail
        self._commit([(COMPACT_BEGIN, Plan(self._next_seq(), self.end, [Run(RUN_REWRITE, a, 0, removed)], side).encode())])
        mbox_fs.crash_point("compact.begun")
        pending = self._pending
        assert pending is not None
        self._finish_rewrite(pending)
        report.runs, report.reclaimed, report.written = len(runs), removed, new_tail
        return report

    def _finish_rewrite(self, plan: Plan) -> bool:
        run = plan.runs[0]
        new_size = plan.size_before - run.removed
        try:
            fd = os.open(plan.side, os.O_RDONLY)
        except FileNotFoundError:
            return os.fstat(self.fd).st_size == new_size and self._end_rewrite(plan)
        try:
            length = os.fstat(fd).st_size
            if run.a + length != new_size:
                return False
            pos = 0
            while pos < length:
                data = os.pread(fd, min(1 << 20, length - pos), pos)
                mbox_fs.pwrite_all(self.fd, data, run.a + pos)
                pos += len(data)
                mbox_fs.crash_point("rewrite.copied")
        finally:
            os.close(fd)
        os.ftruncate(self.fd, new_size)
        self._sync_files()
        mbox_fs.crash_point("compact.synced")
        return self._end_rewrite(plan)

    def _end_rewrite(self, plan: Plan) -> bool:
        self._commit([(COMPACT_END, struct.pack(">I", plan.seq))])
        Path(plan.side).unlink(missing_ok=True)
        return True

    def _apply_rewrite(self, plan: Plan) -> None:
        run = plan.runs[0]
        out = [s for s in self.segments if s.off < run.a]
        pos = run.a
        for seg in self.segments:
            if seg.off < run.a:
                continue
            if not seg.live:
                if seg.id is not None:
                    del self.by_id[seg.id]
                continue
            seg.off = pos
            pos += seg.length
            out.append(seg)
        self.segments = out
        self.end = out[-1].off + out[-1].length if out else 0
        self._order = None

    # ----------------------------------------------------------------- defragmentation

    def _defrag_points(self, points: list[int], budget: int | None, deadline: float | None) -> int:
        moved = 0
        done_until = -1
        for p in sorted(points):
            if p < done_until:
                continue
            if (budget is not None and moved >= budget) or (deadline and time.monotonic() > deadline):
                break
            window = self._window_around(p)
            if window is None:
                continue
            lo, hi = window
            if budget is not None and moved + (hi - lo) > budget:
                continue
            moved += self._move(lo, hi)
            done_until = hi
        return moved

    def _window_around(self, point: int) -> tuple[int, int] | None:
        """The run of whole extents around `point`, at most `defrag_window` bytes, if it has at least
        `defrag_min_extents` of them (moving it then removes that many fragments less one)."""
        w = self.settings.defrag_window
        limit = -(-self.end // self._bs) * self._bs  # the last, partial block moves too
        lo_q = max(0, point - w)
        extents = [e for e in mbox_fs.fiemap(self.fd, lo_q, min(limit, point + w) - lo_q) if e.logical + e.length <= limit]
        if len(extents) < self.settings.defrag_min_extents:
            return None
        k = next((n for n, e in enumerate(extents) if e.logical <= point < e.logical + e.length), None)
        if k is None:
            return None
        i = j = k
        total = extents[k].length
        while True:
            left = extents[i - 1].length if i > 0 else None
            right = extents[j + 1].length if j + 1 < len(extents) else None
            options = [(n, side) for n, side in ((left, "l"), (right, "r")) if n is not None and total + n <= w]
            if not options:
                break
            n, side = min(options)
            total += n
            if side == "l":
                i -= 1
            else:
                j += 1
        if j - i + 1 < self.settings.defrag_min_extents:
            return None
        return extents[i].logical, extents[j].logical + extents[j].length

    def _defrag_everywhere(self, budget: int | None, deadline: float | None) -> int:
        """Walk the whole extent map and move every window of small extents worth moving."""
        w = self.settings.defrag_window
        limit = -(-self.end // self._bs) * self._bs  # the last, partial block moves too
        extents = [e for e in mbox_fs.fiemap(self.fd, 0, limit) if e.logical + e.length <= limit]
        moved = 0
        i = 0
        while i < len(extents):
            j, total = i, extents[i].length
            while j + 1 < len(extents) and total + extents[j + 1].length <= w:
                j += 1
                total += extents[j].length
            if j - i + 1 >= self.settings.defrag_min_extents:
                if (budget is not None and moved + total > budget) or (deadline and time.monotonic() > deadline):
                    break
                moved += self._move(extents[i].logical, extents[j].logical + extents[j].length)
                i = j + 1
            else:
                i += 1
        return moved

    def _move(self, lo: int, hi: int) -> int:
        try:
            got = mbox_fs.move_to_fresh_blocks(self.fd, self.index_path.parent, lo, hi - lo, self._bs)
        except OSError as exc:
            if exc.errno == errno.EBUSY:  # pages in use right now: skip this window, not defragmentation
                return 0
            log.info("defragmentation off for %s: %s", self.mbox_path, exc)
            self._defrag = False
            return 0
        mbox_fs.crash_point("defrag.moved")
        return hi - lo if got == 1 else 0

    def extents(self) -> int:
        with self.reading():
            return len(mbox_fs.fiemap(self.fd))


# --------------------------------------------------------------------------- helpers


def _header(generation: int, uidvalidity: int) -> bytes:
    head = _HEADER.pack(MAGIC, generation, uidvalidity, 0)
    return head + struct.pack(">II", zlib.crc32(head), 0)


def _frame(kind: int, body: bytes) -> bytes:
    return _FRAME.pack(len(body), zlib.crc32(bytes([kind]) + body), kind) + body


def _encode_id_flags(items: Sequence[tuple[Segment, frozenset[str]]]) -> bytes:
    out = bytearray()
    for seg, flags in items:
        text = " ".join(sorted(flags)).encode()
        out += seg.id.bytes + struct.pack(">H", len(text)) + text  # type: ignore[union-attr]
    return bytes(out)


def _decode_id_flags(body: bytes) -> Iterator[tuple[uuid.UUID, frozenset[str]]]:
    pos = 0
    while pos < len(body):
        message_id = uuid_from_bytes(body[pos : pos + 16])
        (n,) = struct.unpack_from(">H", body, pos + 16)
        text = body[pos + 18 : pos + 18 + n].decode()
        yield message_id, frozenset(text.split()) if text else frozenset()
        pos += 18 + n


def _segment(rec: object, offset: int) -> Segment:
    """A segment from a record found by `mbox_format.scan`, placed at `offset`."""
    from cassmail.store.mbox_format import Record

    assert isinstance(rec, Record)
    return Segment(
        offset, rec.length, rec.id, rec.head, rec.from_len, rec.meta, rec.capacity, rec.stored, rec.raw,
        rec.date_us, rec.flags, 0, rec.expunged,
    )


def _unique_id(message_id: uuid.UUID, taken: Callable[[uuid.UUID], bool]) -> uuid.UUID:
    """The id, or the next one up in its node bits, that is not taken (identical foreign records)."""
    while taken(message_id):
        message_id = uuid.UUID(int=message_id.int + 1)
    return message_id


def _ranges(off: int, length: int, step: int = 1 << 20) -> Iterator[tuple[int, int]]:
    end = off + length
    while off < end:
        yield off, min(step, end - off)
        off += step


__all__ = ["CompactReport", "MailboxFile", "MailboxGone", "ReadState", "Segment", "META_TAG"]
