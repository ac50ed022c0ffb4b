"""The WheelFS backend of the Store contract: one file per message on a shared file system.

Built for WheelFS (the wide-area file system whose paths carry semantic cues)
and, with `cues = false`, for any shared POSIX file system: NFS, CephFS, a
local directory. Any number of cassmail nodes may share one root; there is no
lock service and no lock file. The layout is in wheelfs_layout; the rules
that keep mail safe on a file system whose replicas may disagree are:

- Nothing is ever rewritten in place. A body is written once to its final
  name and acknowledged only after fsync and close() succeeded; then an
  empty marker whose name carries size, date and flags commits it to
  listings. Flag changes and deletions are new files (flag records,
  tombstones), so replicas merged by union (what WheelFS does with
  `.EventualConsistency` directories) lose nothing and resurrect nothing: a
  marker that comes back after its deletion is hidden by its tombstone.
- Accounts, aliases, mailbox lists and UIDs live in a tree without
  `.EventualConsistency`, where an exclusive create (O_EXCL) succeeds for one
  node only. That is the compare-and-set: UID n is claimed by creating
  `uids/<mailbox>/<n>` holding the message id, and a claimer walks the claims
  in order before it creates the next one, so no UID is given twice and UIDs
  only grow. Renumbering a message (IMAP, see Store.assign_uids) claims a
  new UID holding the same id; its UID is its highest claim. The IMAP
  \\Recent mark is a chain of the same kind of claims: `recent/<mailbox>/<m>`,
  created by the one session that claims the UIDs from m on, holds the mark it
  raised the chain to, where the next claim starts.
- MODSEQs (RFC 7162) are a third chain, `modseqs/<mailbox>/<n>` (wheelfs_modseq).
  A change takes the next claim empty, makes the change, then writes what it
  did into the claim: readers wait for an empty claim, so nobody sees a
  HIGHESTMODSEQ at or above n before change n is complete, and a flag change
  decides UNCHANGEDSINCE from the claims below its own, all read, which no
  later change can alter. Flag changes are the claims themselves (mode, flags,
  the messages changed); a numbering's UID claims name its MODSEQ claim; an
  expunge's claim names the UIDs its tombstones made vanish.
- Every file-system call goes through one `FileSystem` object
  (wheelfs_fs), which counts it and is where tests inject faults; every call
  is bounded by `timeout`, and any failure is a StoreUnavailable (SMTP 451),
  never an acknowledgement.
"""

from __future__ import annotations

import asyncio
import bisect
import errno
import json
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

from cassmail.config import WheelFSSettings
from cassmail.model import (
    DEFAULT_MAILBOXES,
    HIERARCHY_DELIMITER,
    INBOX,
    InvalidAddress,
    InvalidInput,
    InvalidMailboxName,
    MailboxInfo,
    MessageSummary,
    Page,
    address_key,
    flag_set,
    mailbox_name,
    message_id_time,
    new_message_id,
    normalize_domain,
    parse_sortable_id,
)
from cassmail.store import wheelfs_cues
from cassmail.store.base import (
    Alias,
    AliasExists,
    Body,
    DomainInUse,
    FlagMode,
    MailboxExists,
    MailboxNotAllowed,
    NoSuchAlias,
    NoSuchDomain,
    NoSuchMailbox,
    NoSuchMessage,
    NoSuchUser,
    StoreUnavailable,
    Target,
    UserExists,
    check_alias,
    check_flag_mode,
    check_recent_below,
    check_rename,
    checked_password_hash,
    decode_name,
    internal_date_micros,
    needs_uid,
    prepare_delivery,
    uid_work,
)
from cassmail.store.file_queue import FileKeys, FileQueue, FileQueueStore
from cassmail.store.file_sieve import FileSieve
from cassmail.store.wheelfs_fs import FileSystem
from cassmail.store.wheelfs_layout import (
    LAYOUT_FILE,
    MAILBOX_PARTS,
    Layout,
    Marker,
    file_name,
    flag_record,
    leading_sid,
    modseq_claim,
    parse_flag_record,
    parse_flag_record_name,
    parse_marker,
    parse_modseq_claim,
    parse_recent_claim,
    parse_uid_claim,
    recent_claim,
    sid_of,
    uid_claim,
)
from cassmail.store.wheelfs_modseq import ABANDONED, Chains, changed_flags
from cassmail.store.wheelfs_quota import WheelFSQuota
from cassmail.threads import THREADS

T = TypeVar("T")
log = logging.getLogger("cassmail.store.wheelfs")

#: Mailboxes whose caches (tombstones seen, flag records read, claims walked) a process keeps.
CACHED_MAILBOXES = 1024
#: Seconds a reader waits for a UID claim another node is writing before answering "try later".
CLAIM_WAIT = 2.0
#: Old tombstones looked at (one stat each) per deletion.
TOMBSTONES_PER_DELETE = 64
#: Seconds a directory's modification time must be old before a changes token trusts it (see
#: WheelFSStore.changes_token).
TOKEN_SETTLE = 1.0


class _Cancelled(Exception):
    """The caller stopped waiting (timeout): a delivery must not commit after its 451."""


@dataclass
class _MailboxCache:
    """What one process has learnt about one mailbox; all of it is write-once on disk."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    dead: set[str] = field(default_factory=set)
    markers: dict[str, tuple[Marker, uuid.UUID, datetime] | None] = field(default_factory=dict)
    young: dict[str, float] = field(default_factory=dict)  # tombstone -> when it passes the grace
    flag_records: dict[str, tuple[str, str, str, frozenset[str]]] = field(default_factory=dict)
    chains: Chains = field(default_factory=Chains)  # UID and MODSEQ claims read (under `lock`)
    recent_lock: threading.Lock = field(default_factory=threading.Lock)  # apart: a claim never holds up a listing
    recent: int = 1  # the \Recent mark: the end of the claim chain as far as walked


@dataclass
class _Message:
    marker: Marker
    id: uuid.UUID
    internal_date: datetime
    marker_name: str
    flags: frozenset[str]  # as delivered: the marker's and the keyword record's (and changes made before MODSEQs)


@dataclass
class _OpenClaim:
    """A claim made by exclusive create and not written yet: its readers wait for it."""

    path: str
    fd: int
    started: float  # time.monotonic() before the create
    n: int = 0


class WheelFSStore(WheelFSQuota, FileQueueStore):
    def __init__(self, settings: WheelFSSettings, max_message_size: int = 0, fs: FileSystem | None = None) -> None:
        self.settings = settings
        self.max_message_size = max_message_size
        self.fs = fs or FileSystem()
        cue_args = dict(
            eventual_consistency=settings.eventual_consistency, home_site=settings.home_site,
            keep_together=settings.keep_together, rep_sites=settings.rep_sites, rep_level=settings.rep_level,
            sync_level=settings.sync_level, max_time=settings.max_time,
        )
        strong = wheelfs_cues.build(wheelfs_cues.store_cues(eventual=False, **cue_args)) if settings.cues else []
        mail = wheelfs_cues.build(wheelfs_cues.store_cues(eventual=True, **cue_args)) if settings.cues else []
        self.layout = Layout(os.path.abspath(settings.root), strong, mail)
        self._caches: OrderedDict[str, _MailboxCache] = OrderedDict()
        self._caches_lock = threading.Lock()
        self._validity_hint: dict[str, int] = {}
        self.queue = FileQueue(self.fs, self.layout.queue, settings.fsync)
        self.keys = FileKeys(self.fs, self.layout.dkim, settings.fsync)
        self.sieve = FileSieve(self.fs, settings.fsync, self._require_user)

    # ================================================================= lifecycle

    async def open(self) -> None:
        await self._call(self._open_sync)

    def _open_sync(self) -> None:
        fs, layout = self.fs, self.layout
        fs.makedirs(layout.root)
        record_path = os.path.join(layout.root, LAYOUT_FILE)
        try:
            fs.write_file(record_path, layout.record(), exclusive=True, fsync=self.settings.fsync)
        except FileExistsError:
            data = fs.read_bytes(record_path)
            if not data.endswith(b"\n"):  # its maker died while writing it: nothing else was made yet
                fs.replace_file(record_path, layout.record(), self.settings.fsync)
                data = layout.record()
            recorded = json.loads(data)
            if (recorded["strong"], recorded["mail"]) != (layout.strong_components, layout.mail_components):
                self._cues_changed(recorded, record_path)
        for path in (layout.domains, layout.aliases, layout.users, layout.mail_root):
            fs.makedirs(path)
        self.queue.open()
        self.keys.open()
        # Left by a node that stopped mid-way: a removed user, or a creation older than any can take.
        for name in fs.listdir(layout.users):
            path = os.path.join(layout.users, name)
            try:
                if name.startswith(".gone-") or (name.startswith(".new-") and time.time() - fs.stat(path).st_mtime > 3600):
                    fs.rmtree(path)
            except FileNotFoundError:
                continue  # another node cleaned it first

    def _cues_changed(self, recorded: dict[str, Any], record_path: str) -> None:
        """Settings name other cues than the store was created with.

        On WheelFS cue components are not directories, so the old and the new paths
        reach the same directories, and new persistent cues apply to what is created
        from now on (logged). On a plain file system they would be another, empty
        store: refuse to start.
        """
        layout = self.layout
        before = Layout(layout.root, recorded["strong"], recorded["mail"])
        for old, new in ((before.users, layout.users), (before.mail_root, layout.mail_root)):
            try:
                same = os.path.samestat(self.fs.stat(old), self.fs.stat(new))
            except FileNotFoundError:
                same = False
            if not same:
                raise StoreUnavailable(
                    f"store.wheelfs: the cue settings give {'/'.join(layout.mail_components) or 'no cues'}, but the "
                    f"store at {layout.root} was made with {'/'.join(recorded['mail']) or 'no cues'}; on this file "
                    "system cues are directories, so the mail would not be found (set the old values back)"
                )
        old_cues = wheelfs_cues.resolve(recorded["mail"], creating=True).cues
        new_cues = wheelfs_cues.resolve(layout.mail_components, creating=True).cues
        changed = sorted({c.component() for c in old_cues.values()} ^ {c.component() for c in new_cues.values()})
        log.warning("wheelfs cues changed (%s); persistent cues apply to directories created from now on", ", ".join(changed))
        self.fs.replace_file(record_path, layout.record(), self.settings.fsync)

    async def close(self) -> None:
        with self._caches_lock:
            self._caches.clear()

    # ================================================================= plumbing

    async def _call(self, fn: Callable[..., T], *args: Any, cancel: threading.Event | None = None) -> T:
        """Run blocking file work off the event loop, bounded by `timeout`; storage failures
        (an OSError, a timeout, a file that is not what it should be) become StoreUnavailable."""

        def guarded() -> T:
            try:
                return fn(*args)
            except OSError as exc:
                raise StoreUnavailable(f"wheelfs store: {exc}") from exc
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError) as exc:
                raise StoreUnavailable(f"wheelfs store: unreadable metadata: {exc}") from exc

        try:
            return await asyncio.wait_for(THREADS.run(guarded), self.settings.timeout)
        except TimeoutError as exc:
            if cancel is not None:
                cancel.set()
            raise StoreUnavailable(f"wheelfs store: no answer from the file system in {self.settings.timeout:g} s") from exc

    def _cache(self, mailbox_id: str) -> _MailboxCache:
        with self._caches_lock:
            cache = self._caches.get(mailbox_id)
            if cache is None:
                cache = self._caches[mailbox_id] = _MailboxCache()
                while len(self._caches) > CACHED_MAILBOXES:
                    self._caches.popitem(last=False)
            else:
                self._caches.move_to_end(mailbox_id)
            return cache

    def _read_json(self, path: str) -> dict[str, Any]:
        return json.loads(self.fs.read_bytes(path))  # type: ignore[no-any-return]

    def _write_json(self, path: str, value: dict[str, Any], exclusive: bool) -> None:
        self.fs.write_file(path, json.dumps(value).encode() + b"\n", exclusive, self.settings.fsync)

    @staticmethod
    def _user_file(key: str) -> str:
        try:
            return file_name(key)
        except ValueError:
            raise InvalidAddress(f"address too long for a file name of the wheelfs store: {key!r}") from None

    @staticmethod
    def _box_file(name: str) -> str:
        try:
            return file_name(name)
        except ValueError:
            raise InvalidMailboxName(f"mailbox name too long for a file name of the wheelfs store: {name!r}") from None

    def _account_path(self, key: str) -> str:
        return os.path.join(self.layout.user(self._user_file(key)), "account")

    def _require_user(self, key: str) -> str:
        """The user's directory, or NoSuchUser."""
        user_dir = self.layout.user(self._user_file(key))
        if not self.fs.exists(os.path.join(user_dir, "account")):
            raise NoSuchUser(key)
        return user_dir

    # ================================================================= domains

    async def add_domain(self, domain: str) -> None:
        domain = normalize_domain(domain)
        path = os.path.join(self.layout.domains, file_name(domain))
        await self._call(self.fs.write_file, path, b"", False, self.settings.fsync)

    async def remove_domain(self, domain: str) -> None:
        domain = normalize_domain(domain)

        def remove() -> None:
            path = os.path.join(self.layout.domains, file_name(domain))
            if not self.fs.exists(path):
                raise NoSuchDomain(domain)
            users = self._users_sync(domain)
            aliases = [a for a in self._alias_keys() if a.rpartition("@")[2] == domain]
            if users or aliases:
                raise DomainInUse(domain, len(users), len(aliases))
            self.fs.unlink(path, missing_ok=True)

        await self._call(remove)

    async def list_domains(self) -> list[str]:
        def listing() -> list[str]:
            return sorted(decode_name(n) for n in self.fs.listdir(self.layout.domains) if not n.startswith("."))

        return await self._call(listing)

    # ================================================================= users

    async def create_user(self, user: str, password_hash: str) -> None:
        key = address_key(user)
        await self._call(self._create_user_sync, key, checked_password_hash(password_hash))

    def _create_user_sync(self, key: str, password_hash: str) -> None:
        fs = self.fs
        domain = key.rpartition("@")[2]
        user_file = self._user_file(key)
        final = self.layout.user(user_file)
        if not fs.exists(os.path.join(self.layout.domains, file_name(domain))):
            raise NoSuchDomain(domain)
        if fs.exists(os.path.join(final, "account")):
            raise UserExists(key)
        if fs.exists(self.layout.alias(user_file)):
            raise AliasExists(key)
        # Built aside and renamed into place: a user exists with all six mailboxes or not at all.
        staging = self.layout.user(f".new-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        made: list[str] = []
        try:
            for sub in ("boxes", "validity", "uids"):
                fs.makedirs(os.path.join(staging, sub))
            fs.makedirs(self.layout.user_mail(user_file))
            base = int(time.time())
            for i, (name, special) in enumerate(DEFAULT_MAILBOXES.items()):
                record = self._new_mailbox(staging, user_file, special, base + i)
                made.append(record["id"])
                self._write_json(os.path.join(staging, "boxes", self._box_file(name)), record, exclusive=True)
            self._write_json(
                os.path.join(staging, "account"),
                {"user": key, "password_hash": password_hash, "created": int(time.time())},
                exclusive=True,
            )
            self._move_into_place(staging, final, key)
        except BaseException:
            fs.rmtree(staging)
            for mailbox_id in made:
                fs.rmtree(self.layout.mailbox(user_file, mailbox_id))
            raise
        if self.settings.fsync:
            fs.fsync_dir(self.layout.users)

    def _move_into_place(self, staging: str, final: str, key: str) -> None:
        for _ in range(2):
            try:
                self.fs.rename(staging, final)
                return
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.EISDIR):
                    raise
            if self.fs.exists(os.path.join(final, "account")):
                raise UserExists(key)
            self._discard_user_dir(final)  # left by a deletion that did not finish
        raise UserExists(key)

    def _discard_user_dir(self, path: str) -> None:
        """Take a user directory out of the namespace in one rename, then remove its files."""
        grave = self.layout.user(f".gone-{uuid.uuid4().hex[:12]}")
        try:
            self.fs.rename(path, grave)
        except FileNotFoundError:
            return
        self.fs.rmtree(grave)

    def _new_mailbox(self, user_dir: str, user_file: str, special_use: str | None, uidvalidity_hint: int) -> dict[str, Any]:
        """Claim a UIDVALIDITY and make the mailbox's mail directories; returns its record."""
        uidvalidity = self._claim_uidvalidity(user_dir, uidvalidity_hint)
        mailbox_id = uuid.uuid4().hex
        box = self.layout.mailbox(user_file, mailbox_id)
        self.fs.mkdir(box)
        for part in MAILBOX_PARTS:
            self.fs.mkdir(os.path.join(box, part))
        return {"id": mailbox_id, "uidvalidity": uidvalidity, "special_use": special_use, "subscribed": True}

    def _claim_uidvalidity(self, user_dir: str, hint: int) -> int:
        """A UIDVALIDITY never handed out in this account: an exclusive create per value."""
        candidate = max(hint, self._validity_hint.get(user_dir, 0))
        for _ in range(10_000):
            try:
                self.fs.write_file(os.path.join(user_dir, "validity", str(candidate)), b"", True, self.settings.fsync)
            except FileExistsError:
                candidate += 1
                continue
            self._validity_hint[user_dir] = candidate + 1
            return candidate
        raise StoreUnavailable("no free UIDVALIDITY found")  # pragma: no cover - 10,000 mailboxes in one second

    async def delete_user(self, user: str) -> None:
        key = address_key(user)

        def delete() -> None:
            user_file = self._user_file(key)
            user_dir = self._require_user(key)
            # Out of every alias before the account goes: a failure here leaves the user whole,
            # and deleting again finishes; the other order could leave aliases naming nobody.
            try:
                listed = self.fs.listdir(self.layout.aliases_of(user_file))
            except FileNotFoundError:
                listed = []  # in no alias
            for name in listed:
                if not name.startswith("."):
                    self._drop_from_alias(name, key)
            try:
                self.fs.unlink(os.path.join(user_dir, "account"))
            except FileNotFoundError:
                raise NoSuchUser(key) from None
            self._discard_user_dir(user_dir)
            self.fs.rmtree(self.layout.user_mail(user_file))

        await self._call(delete)

    async def get_password_hash(self, user: str) -> str:
        key = address_key(user)

        def read() -> str:
            try:
                return str(self._read_json(self._account_path(key))["password_hash"])
            except FileNotFoundError:
                raise NoSuchUser(key) from None

        return await self._call(read)

    async def set_password_hash(self, user: str, password_hash: str) -> None:
        key = address_key(user)
        password_hash = checked_password_hash(password_hash)

        def change() -> None:
            path = self._account_path(key)
            try:
                account = self._read_json(path)
            except FileNotFoundError:
                raise NoSuchUser(key) from None
            account["password_hash"] = password_hash
            self.fs.replace_file(path, json.dumps(account).encode() + b"\n", self.settings.fsync)

        await self._call(change)

    async def list_users(self, domain: str | None = None) -> list[str]:
        wanted = normalize_domain(domain) if domain is not None else None
        return await self._call(self._users_sync, wanted)

    def _users_sync(self, domain: str | None = None) -> list[str]:
        keys = []
        for name in self.fs.listdir(self.layout.users):
            if name.startswith("."):
                continue
            key = decode_name(name)
            if domain is not None and key.rpartition("@")[2] != domain:
                continue
            if self.fs.exists(os.path.join(self.layout.users, name, "account")):
                keys.append(key)
        return sorted(keys)

    # ================================================================= aliases

    def _alias_keys(self) -> list[str]:
        return sorted(decode_name(n) for n in self.fs.listdir(self.layout.aliases) if not n.startswith("."))

    def _read_alias(self, alias_file: str) -> list[str] | None:
        try:
            return [str(u) for u in self._read_json(self.layout.alias(alias_file))["users"]]
        except FileNotFoundError:
            return None

    def _write_alias(self, alias_file: str, key: str, users: Sequence[str]) -> None:
        data = json.dumps({"alias": key, "users": sorted(users)}).encode() + b"\n"
        self.fs.replace_file(self.layout.alias(alias_file), data, self.settings.fsync)

    async def set_alias(self, alias: str, users: Iterable[str]) -> None:
        key, targets = check_alias(alias, users)
        await self._call(self._set_alias_sync, key, targets)

    def _set_alias_sync(self, key: str, targets: tuple[str, ...]) -> None:
        """Checks, then a mark in each user's `aliases/` (so deleting the user finds the alias),
        then the alias file, replaced atomically, then the marks of users it no longer lists.
        There is no lock service: a user created at the same address at the same moment on
        another node is caught by looking again after the write (the alias is taken back)."""
        fs = self.fs
        domain = key.rpartition("@")[2]
        alias_file = self._user_file(key)
        if not fs.exists(os.path.join(self.layout.domains, file_name(domain))):
            raise NoSuchDomain(domain)
        if fs.exists(self._account_path(key)):
            raise UserExists(key, "an alias cannot have a user's address")
        for target in targets:
            self._require_user(target)
        before = self._read_alias(alias_file) or []
        for target in targets:
            marks = self.layout.aliases_of(self._user_file(target))
            fs.makedirs(marks)
            fs.write_file(os.path.join(marks, alias_file), b"", False, self.settings.fsync)
        self._write_alias(alias_file, key, targets)
        if fs.exists(self._account_path(key)):
            fs.unlink(self.layout.alias(alias_file), missing_ok=True)
            raise UserExists(key, "an alias cannot have a user's address")
        for old in before:
            if old not in targets:
                fs.unlink(os.path.join(self.layout.aliases_of(self._user_file(old)), alias_file), missing_ok=True)

    async def delete_alias(self, alias: str) -> None:
        key = address_key(alias)

        def delete() -> None:
            alias_file = self._user_file(key)
            users = self._read_alias(alias_file)
            if users is None:
                raise NoSuchAlias(key)
            self.fs.unlink(self.layout.alias(alias_file), missing_ok=True)
            for user in users:
                self.fs.unlink(os.path.join(self.layout.aliases_of(self._user_file(user)), alias_file), missing_ok=True)

        await self._call(delete)

    async def get_alias(self, alias: str) -> list[str] | None:
        key = address_key(alias)
        try:
            alias_file = self._user_file(key)
        except InvalidAddress:
            return None  # too long for a file name: no alias can have been stored under it
        users = await self._call(self._read_alias, alias_file)
        return sorted(users) if users else None

    async def list_aliases(self, domain: str | None = None) -> list[Alias]:
        wanted = normalize_domain(domain) if domain is not None else None

        def listing() -> list[Alias]:
            found = []
            for key in self._alias_keys():
                if wanted is not None and key.rpartition("@")[2] != wanted:
                    continue
                users = self._read_alias(file_name(key))
                if users:  # None: removed meanwhile
                    found.append(Alias(key, tuple(sorted(users))))
            return found

        return await self._call(listing)

    def _drop_from_alias(self, alias_file: str, user: str) -> None:
        """Take a user out of an alias (named by its file); the alias goes with its last user."""
        users = self._read_alias(alias_file)
        if users is None or user not in users:
            return  # a mark left by a replaced alias
        rest = [u for u in users if u != user]
        if rest:
            self._write_alias(alias_file, decode_name(alias_file), rest)
        else:
            self.fs.unlink(self.layout.alias(alias_file), missing_ok=True)

    # ================================================================= mailboxes

    def _boxes(self, key: str) -> dict[str, dict[str, Any]]:
        """name -> record of every mailbox of a user, with renames a crash left half done repaired."""
        user_dir = self._require_user(key)
        boxes_dir = os.path.join(user_dir, "boxes")
        records: dict[str, dict[str, Any]] = {}
        for entry in self.fs.listdir(boxes_dir):
            if entry.startswith("."):
                continue
            try:
                records[decode_name(entry)] = self._read_json(os.path.join(boxes_dir, entry))
            except FileNotFoundError:
                continue  # deleted or renamed meanwhile
        by_id: dict[str, list[str]] = {}
        for name, record in records.items():
            by_id.setdefault(record["id"], []).append(name)
        for names in by_id.values():
            if len(names) < 2:
                continue
            # A rename creates the new name before it removes the old: two names of one mailbox
            # are a rename under way or one a crash stopped. The newest name wins; the others go
            # (INBOX only by the renamer, which puts a fresh INBOX in its place).
            newest = max(names, key=lambda n: (records[n].get("renamed", 0), n))
            for name in names:
                if name not in (newest, INBOX):
                    self.fs.unlink(os.path.join(boxes_dir, self._box_file(name)), missing_ok=True)
                    del records[name]
            stamp = records[newest].get("renamed", 0)
            if INBOX in names and newest != INBOX and time.time_ns() - stamp > self.settings.claim_timeout * 1e9:
                # the renamer of INBOX died before giving it a fresh mailbox: do it for it
                fresh = self._new_mailbox(user_dir, self._user_file(key), None, int(time.time()))
                self.fs.replace_file(os.path.join(boxes_dir, INBOX), json.dumps(fresh).encode() + b"\n", self.settings.fsync)
                records[INBOX] = fresh
        return records

    def _box(self, key: str, name: str) -> dict[str, Any]:
        """One mailbox's record: NoSuchUser or NoSuchMailbox when it is not there."""
        user_dir = self.layout.user(self._user_file(key))
        try:
            return self._read_json(os.path.join(user_dir, "boxes", self._box_file(name)))
        except FileNotFoundError:
            self._require_user(key)
            raise NoSuchMailbox(key, name) from None

    @staticmethod
    def _info(name: str, record: dict[str, Any]) -> MailboxInfo:
        return MailboxInfo(name, int(record["uidvalidity"]), record.get("special_use"), bool(record.get("subscribed", True)))

    async def list_mailboxes(self, user: str) -> list[MailboxInfo]:
        key = address_key(user)

        def listing() -> list[MailboxInfo]:
            records = self._boxes(key)
            return [self._info(n, records[n]) for n in sorted(records, key=lambda n: (n != INBOX, n))]

        return await self._call(listing)

    async def mailbox_info(self, user: str, name: str) -> MailboxInfo:
        key, name = address_key(user), mailbox_name(name)
        return await self._call(lambda: self._info(name, self._box(key, name)))

    async def set_subscribed(self, user: str, name: str, subscribed: bool) -> None:
        key, name = address_key(user), mailbox_name(name)

        def update() -> None:
            record = self._box(key, name)
            if bool(record.get("subscribed", True)) == subscribed:
                return
            path = os.path.join(self.layout.user(self._user_file(key)), "boxes", self._box_file(name))
            self.fs.replace_file(path, json.dumps({**record, "subscribed": subscribed}).encode() + b"\n", self.settings.fsync)

        await self._call(update)

    async def create_mailbox(self, user: str, name: str, special_use: str | None = None) -> MailboxInfo:
        key, name = address_key(user), mailbox_name(name)

        def create() -> MailboxInfo:
            user_dir = self._require_user(key)
            user_file = self._user_file(key)
            path = os.path.join(user_dir, "boxes", self._box_file(name))
            if self.fs.exists(path):
                raise MailboxExists(key, name)
            record = self._new_mailbox(user_dir, user_file, special_use, int(time.time()))
            try:
                self._write_json(path, record, exclusive=True)
            except FileExistsError:
                self.fs.rmtree(self.layout.mailbox(user_file, record["id"]))
                raise MailboxExists(key, name) from None
            return self._info(name, record)

        return await self._call(create)

    async def rename_mailbox(self, user: str, old: str, new: str) -> None:
        key = address_key(user)
        old, new = check_rename(key, old, new)
        await self._call(self._rename_sync, key, old, new)

    def _rename_sync(self, key: str, old: str, new: str) -> None:
        """Each name moves by an exclusive create of the new name (stamped with the time of the
        rename), then removal of the old; a crash in between is finished by the next listing."""
        records = self._boxes(key)
        if old not in records:
            raise NoSuchMailbox(key, old)
        moves = [(old, new)] + [(n, new + n[len(old) :]) for n in sorted(records) if n.startswith(old + HIERARCHY_DELIMITER)]
        for _, target in moves:
            if target in records:
                raise MailboxExists(key, target)
            self._box_file(target)
        user_dir = self.layout.user(self._user_file(key))
        boxes = os.path.join(user_dir, "boxes")
        fresh_inbox = self._new_mailbox(user_dir, self._user_file(key), None, int(time.time())) if old == INBOX else None
        done: list[str] = []
        try:
            for source, target in moves:
                self._write_json(os.path.join(boxes, self._box_file(target)), {**records[source], "renamed": time.time_ns()}, True)
                done.append(target)
        except FileExistsError:
            for target in done:
                self.fs.unlink(os.path.join(boxes, self._box_file(target)), missing_ok=True)
            if fresh_inbox is not None:
                self.fs.rmtree(self.layout.mailbox(self._user_file(key), fresh_inbox["id"]))
            raise MailboxExists(key, moves[len(done)][1]) from None
        for source, _ in moves:
            if source == INBOX and fresh_inbox is not None:
                self.fs.replace_file(os.path.join(boxes, INBOX), json.dumps(fresh_inbox).encode() + b"\n", self.settings.fsync)
            else:
                self.fs.unlink(os.path.join(boxes, self._box_file(source)), missing_ok=True)

    async def delete_mailbox(self, user: str, name: str) -> None:
        key, name = address_key(user), mailbox_name(name)
        if name == INBOX:
            raise MailboxNotAllowed("INBOX cannot be deleted")

        def delete() -> None:
            record = self._box(key, name)
            user_file = self._user_file(key)
            try:
                self.fs.unlink(os.path.join(self.layout.user(user_file), "boxes", self._box_file(name)))
            except FileNotFoundError:
                raise NoSuchMailbox(key, name) from None
            self.fs.rmtree(self.layout.mailbox(user_file, record["id"]))
            self.fs.rmtree(self.layout.uids(user_file, record["id"]))
            self.fs.rmtree(self.layout.recent(user_file, record["id"]))
            self.fs.rmtree(self.layout.modseqs(user_file, record["id"]))
            self.fs.unlink(self.layout.checkpoint(user_file, record["id"]), missing_ok=True)

        await self._call(delete)

    # ================================================================= reading a mailbox

    def _where(self, key: str, name: str) -> tuple[str, str, str]:
        """(user file name, mailbox id, mailbox mail directory) or NoSuchUser / NoSuchMailbox."""
        record = self._box(key, name)
        user_file = self._user_file(key)
        return user_file, record["id"], self.layout.mailbox(user_file, record["id"])

    def _messages(self, box: str, cache: _MailboxCache) -> dict[str, _Message]:
        """Live messages by sid: markers less tombstones, flags from the records, in one pass
        over three directories (bodies are never read)."""
        fs = self.fs
        for name in fs.listdir(os.path.join(box, "dead")):
            sid = leading_sid(name)
            if sid:
                cache.dead.add(sid)  # once this process has seen a tombstone, the message stays dead here
        live: dict[str, _Message] = {}
        names = fs.listdir(os.path.join(box, "msg"))
        if len(cache.markers) > 2 * len(names) + 64:  # forget the names of messages long gone
            listed = set(names)
            cache.markers = {n: v for n, v in list(cache.markers.items()) if n in listed}  # list(): one GIL step
            sids = {leading_sid(n) for n in listed}
            cache.flag_records = {n: v for n, v in list(cache.flag_records.items()) if v[0] in sids}
        for name in names:
            if name not in cache.markers:  # a name never changes meaning: parse it once
                marker = parse_marker(name)
                cache.markers[name] = (marker, marker.id, marker.internal_date) if marker else None
            parsed = cache.markers[name]
            if parsed is None or parsed[0].sid in cache.dead:
                continue
            marker, message_id, date = parsed
            if marker.sid not in live or len(name) < len(live[marker.sid].marker_name):
                live[marker.sid] = _Message(marker, message_id, date, name, marker.flags)  # one per id, however many names
        changes: dict[str, list[tuple[str, str, frozenset[str]]]] = {}
        flags_dir = os.path.join(box, "flags")
        for name in fs.listdir(flags_dir):
            parsed = parse_flag_record_name(name)
            if parsed is None or parsed[0] not in live:
                continue
            record = cache.flag_records.get(name)
            if record is None:
                try:
                    content = parse_flag_record(fs.read_bytes(os.path.join(flags_dir, name)))
                except FileNotFoundError:
                    continue
                if content is None:
                    continue  # still being written: next time
                record = cache.flag_records[name] = (parsed[0], parsed[1], *content)
            changes.setdefault(record[0], []).append(record[1:])
        for sid, records in changes.items():
            flags = live[sid].flags
            for _, mode, values in sorted(set(records), key=lambda r: r[0]):
                flags = values if mode == "set" else flags | values if mode == "add" else flags - values
            live[sid].flags = flags
        return live

    def _scan(self, key: str, name: str) -> tuple[list[MessageSummary], list[str]]:
        """Summaries in arrival order, and their sids: the mail tree's three directories, then the
        UID and MODSEQ claims made since the last look (usually one missing name each)."""
        user_file, mailbox_id, box = self._where(key, name)
        cache = self._cache(mailbox_id)
        live = self._messages(box, cache)
        ordered = sorted(live.items())
        with cache.lock:
            chains = self._sync(user_file, mailbox_id, cache)
            if chains.repair:
                self._repair(user_file, mailbox_id, cache)
            if len(chains.effects) > 2 * len(live) + 64:
                chains.prune(cache.dead)
            self._checkpoint(user_file, mailbox_id, cache)
            out = []
            for sid, m in ordered:
                uid = chains.uid_of.get(m.id)
                modseq = chains.modseq_of(m.id, sid) if uid is not None else None
                out.append(MessageSummary(m.id, m.marker.size, chains.flags_of(sid, m.flags), m.internal_date, uid, modseq))
        return out, [sid for sid, _ in ordered]

    async def list_page(self, user: str, mailbox: str, after: uuid.UUID | None = None, limit: int = 500) -> Page:
        if not 1 <= limit <= 10_000:
            raise InvalidInput(f"page limit must be 1..10000, got {limit}")
        summaries, sids = await self._call(self._scan, address_key(user), mailbox_name(mailbox))
        start = bisect.bisect_right(sids, sid_of(after)) if after is not None else 0
        items = summaries[start : start + limit]
        return Page(items, items[-1].id if len(summaries) > start + limit else None)

    async def list_messages(self, user: str, mailbox: str, page_size: int = 500) -> AsyncIterator[MessageSummary]:
        """Every summary from one scan: a directory is read whole anyway, so pages would only
        read it again."""
        summaries, _ = await self._call(self._scan, address_key(user), mailbox_name(mailbox))
        for summary in summaries:
            yield summary

    async def get_summaries(self, user: str, mailbox: str, ids: Iterable[uuid.UUID]) -> dict[uuid.UUID, MessageSummary]:
        wanted = set(ids)
        summaries, _ = await self._call(self._scan, address_key(user), mailbox_name(mailbox))
        return {s.id: s for s in summaries if s.id in wanted}

    def _open_body(self, key: str, name: str, message_id: uuid.UUID) -> tuple[int, str, int]:
        """(descriptor, path, size) of a live message's body; NoSuchMessage if deleted or unknown."""
        _, mailbox_id, box = self._where(key, name)
        cache = self._cache(mailbox_id)
        sid = sid_of(message_id)
        if self._tombstoned(box, cache, sid):
            raise NoSuchMessage(name, message_id)
        path = os.path.join(box, "body", sid)
        try:
            fd = self.fs.open_read(path)
        except FileNotFoundError:
            if sid not in self._messages(box, cache):
                raise NoSuchMessage(name, message_id) from None
            # listed, but not under its own name: a replica merge may have renamed it
            other = next((n for n in self.fs.listdir(os.path.join(box, "body")) if leading_sid(n) == sid), None)
            if other is None:
                raise StoreUnavailable(f"the body of {message_id} is listed but not reachable yet") from None
            path = os.path.join(box, "body", other)
            fd = self.fs.open_read(path)
        try:
            size = self.fs.stat(path).st_size
        except BaseException:
            self.fs.close(fd, path)
            raise
        return fd, path, size

    def _tombstoned(self, box: str, cache: _MailboxCache, sid: str) -> bool:
        """Whether the message was deleted (its tombstone seen here before, or on disk now)."""
        if sid in cache.dead or self.fs.exists(os.path.join(box, "dead", sid)):
            cache.dead.add(sid)
            return True
        return False

    def _deleted(self, key: str, name: str, message_id: uuid.UUID) -> bool:
        _, mailbox_id, box = self._where(key, name)
        return self._tombstoned(box, self._cache(mailbox_id), sid_of(message_id))

    async def read_chunks(
        self, user: str, mailbox: str, message_id: uuid.UUID, start: int = 0, end: int | None = None
    ) -> AsyncIterator[bytes]:
        """The body is read through one descriptor opened first. Where the file system keeps a
        deleted file readable while it is open (POSIX; NFS on the deleting client), a deletion by
        another session meanwhile does not stop the stream; where a read then fails or comes up
        short (another NFS client, a WheelFS replica), the tombstone makes it NoSuchMessage."""
        key, name = address_key(user), mailbox_name(mailbox)
        fd, path, size = await self._call(self._open_body, key, name, message_id)
        try:
            stop = size if end is None else min(end, size)
            if start < 0 or start > stop:
                raise InvalidInput(f"invalid byte range {start}..{stop} of a {size}-byte message")
            pos, chunk_size = start, self.settings.chunk_size
            while pos < stop:
                try:
                    chunk = await self._call(self.fs.pread, fd, path, min(chunk_size, stop - pos), pos)
                except StoreUnavailable:
                    if await self._call(self._deleted, key, name, message_id):
                        raise NoSuchMessage(name, message_id) from None
                    raise
                if not chunk:
                    if await self._call(self._deleted, key, name, message_id):
                        raise NoSuchMessage(name, message_id)
                    raise StoreUnavailable(f"the body of {message_id} ended early at byte {pos} of {size}")
                pos += len(chunk)
                yield chunk
        finally:
            try:
                await THREADS.run(self.fs.close, fd, path)
            except OSError:
                pass  # closing a descriptor only read from loses nothing

    # ================================================================= delivery

    async def deliver(
        self, body: Body, targets: Sequence[Target], internal_date: datetime | None = None
    ) -> list[uuid.UUID]:
        view, targets, unique = prepare_delivery(body, targets, self.max_message_size)
        date_us = internal_date_micros(internal_date)
        ids = {k: new_message_id() for k in unique}
        cancel = threading.Event()
        await self._call(self._deliver_sync, view, list(unique.values()), ids, date_us, cancel, cancel=cancel)
        return [ids[(t.user, t.mailbox)] for t in targets]

    def _deliver_sync(
        self, view: memoryview, targets: list[Target], ids: dict[tuple[str, str], uuid.UUID], date_us: int,
        cancel: threading.Event,
    ) -> None:
        # Resolve every target first: an unknown user or mailbox fails before anything is written.
        boxes = [(t, self._where(t.user, t.mailbox)[2]) for t in targets]
        self._check_quota(targets, view.nbytes)  # QuotaExceeded before anything is written (wheelfs_quota)
        written: list[tuple[str, str]] = []  # (mailbox directory, sid) with a body on disk
        committed: list[tuple[str, str]] = []  # ... and a marker
        synced: set[str] = set()  # directories to fsync before the commit
        try:
            for target, box in boxes:
                message_id = ids[(target.user, target.mailbox)]
                sid = sid_of(message_id)
                self.fs.write_file(os.path.join(box, "body", sid), view, True, self.settings.fsync)
                written.append((box, sid))
                synced.add(os.path.join(box, "body"))
                keywords = frozenset(f for f in target.flags if not f.startswith("\\"))
                if keywords:
                    record = os.path.join(box, "flags", f"{sid}.{sid_of(new_message_id())}")
                    self.fs.write_file(record, flag_record("add", keywords), True, self.settings.fsync)
                    synced.add(os.path.join(box, "flags"))
            if self.settings.fsync:
                for directory in sorted(synced):
                    self.fs.fsync_dir(directory)
            for target, box in boxes:
                if cancel.is_set():
                    raise _Cancelled
                sid = sid_of(ids[(target.user, target.mailbox)])
                marker = Marker(sid, view.nbytes, date_us, target.flags)
                self.fs.write_file(os.path.join(box, "msg", marker.name()), b"", True, False)
                committed.append((box, sid))
            if self.settings.fsync:
                for box in {b for b, _ in committed}:
                    self.fs.fsync_dir(os.path.join(box, "msg"))
            if cancel.is_set():  # the caller answered 451 meanwhile: the sender will send it again
                raise _Cancelled
        except BaseException as exc:
            self._undo_delivery(written, committed)
            if isinstance(exc, _Cancelled):
                raise StoreUnavailable("delivery abandoned after a timeout") from None
            raise

    def _undo_delivery(self, written: list[tuple[str, str]], committed: list[tuple[str, str]]) -> None:
        """Best effort after a failed delivery: committed copies get a tombstone (so a marker that
        lingers on some replica stays hidden), bodies go. The sender retries after its 4xx."""
        try:
            for box, sid in committed:
                self.fs.write_file(os.path.join(box, "dead", sid), b"", False, self.settings.fsync)
            for box, sid in written:
                self.fs.unlink(os.path.join(box, "body", sid), missing_ok=True)
        except OSError:
            log.warning("could not undo a failed delivery completely; tombstones and bodies may be left over")

    # ================================================================= flags and deletion

    async def store_flags(
        self, user: str, mailbox: str, ids: Iterable[uuid.UUID], flags: Iterable[str], mode: FlagMode = "set",
        unchanged_since: int | None = None, modseqs: dict[uuid.UUID, int] | None = None,
        known: tuple[Mapping[uuid.UUID, MessageSummary], int] | None = None,
    ) -> set[uuid.UUID]:
        """One MODSEQ claim holds the change: taken empty, then decided against every claim below
        it (all read by then, and no later claim can change them), then written with the messages
        whose flags it changes. A message whose MODSEQ is above `unchanged_since` is left alone.
        Nothing is claimed when, as far as this node can tell, nothing would change."""
        mode = check_flag_mode(mode)
        values = flag_set(flags)
        wanted = list(dict.fromkeys(ids))
        key, name = address_key(user), mailbox_name(mailbox)

        def change() -> set[uuid.UUID]:
            user_file, mailbox_id, box = self._where(key, name)
            cache = self._cache(mailbox_id)
            live = self._messages(box, cache)
            targets = [(sid, live[sid]) for sid in map(sid_of, wanted) if sid in live]
            if not targets:
                return set()  # gone: a flag change never brings a message back
            with cache.lock:
                chains = self._sync(user_file, mailbox_id, cache)
                modified, changing = self._flag_decision(chains, targets, mode, values, unchanged_since)
                while changing:
                    claim = self._open_modseq_claim(user_file, mailbox_id, cache)
                    try:
                        self._walk_claims(user_file, mailbox_id, cache)  # numberings sequenced below it
                        modified, changing = self._flag_decision(chains, targets, mode, values, unchanged_since)
                        done = {"k": "f", "mode": mode, "flags": sorted(values), "ids": changing}
                    except BaseException:
                        self._close_quietly(claim, None)
                        raise
                    if self._finish_claim(claim, modseq_claim(done), modseq_claim(None)):
                        chains.take_change(claim.n, done, time.time())
                        break
                    chains.take_change(claim.n, None, time.time())  # given up: decide again higher up
                return modified

        return await self._call(change)

    @staticmethod
    def _flag_decision(
        chains: Chains, targets: list[tuple[str, _Message]], mode: str, values: frozenset[str], unchanged_since: int | None
    ) -> tuple[set[uuid.UUID], list[str]]:
        """(ids left alone by UNCHANGEDSINCE, sids whose flags the change alters) given the claims read."""
        modified: set[uuid.UUID] = set()
        changing: list[str] = []
        for sid, message in targets:
            if unchanged_since is not None and (chains.modseq_of(message.id, sid) or 1) > unchanged_since:
                modified.add(message.id)
                continue
            current = chains.flags_of(sid, message.flags)
            if changed_flags(current, mode, values) != current:
                changing.append(sid)
        return modified, changing

    async def delete_messages(
        self, user: str, mailbox: str, ids: Iterable[uuid.UUID], modseqs: dict[uuid.UUID, int] | None = None,
        *, only_deleted: bool = False,
    ) -> set[uuid.UUID]:
        """With `only_deleted`, on the flags as this node reads them just before."""
        wanted = list(ids)
        key, name = address_key(user), mailbox_name(mailbox)

        def delete() -> set[uuid.UUID]:
            user_file, mailbox_id, box = self._where(key, name)
            cache = self._cache(mailbox_id)
            live = self._messages(box, cache)
            doomed = [(sid, live[sid].id) for sid in dict.fromkeys(map(sid_of, wanted)) if sid in live]
            if doomed and only_deleted:
                with cache.lock:
                    chains = self._sync(user_file, mailbox_id, cache)
                    doomed = [(sid, i) for sid, i in doomed if "\\Deleted" in chains.flags_of(sid, live[sid].flags)]
            if not doomed:
                return set()
            with cache.lock:
                self._bury(user_file, mailbox_id, box, cache, doomed)
            doomed_set = {sid for sid, _ in doomed}
            self._remove_entries(box, "msg", self._entries(box, "msg", doomed_set))
            self._remove_entries(box, "body", self._entries(box, "body", doomed_set))
            self._remove_entries(box, "flags", self._entries(box, "flags", doomed_set))
            if self.settings.tombstone_grace:
                self._collect_tombstones(box, cache)
            return {message_id for _, message_id in doomed}

        return await self._call(delete)

    def _bury(self, user_file: str, mailbox_id: str, box: str, cache: _MailboxCache, doomed: list[tuple[str, uuid.UUID]]) -> None:
        """Tombstones for `doomed`, durable before anything else goes: from then on no replica can
        bring the messages back. Those that have UIDs are buried under a MODSEQ claim taken before
        their tombstones and written after them with the UIDs that vanish (a batch per claim, so
        none stays open long). Caller holds cache.lock."""
        chains = self._walk_claims(user_file, mailbox_id, cache)
        dead_dir = os.path.join(box, "dead")
        at = 0
        while at < len(doomed):
            claim = self._open_modseq_claim(user_file, mailbox_id, cache) if any(
                m in chains.uid_of for _, m in doomed[at:]) else None
            batch: list[str] = []
            uids: list[int] = []
            try:
                while at < len(doomed) and (claim is None or time.monotonic() - claim.started < self._bracket_seconds()):
                    sid, message_id = doomed[at]
                    self.fs.write_file(os.path.join(dead_dir, sid), b"", False, False)
                    at += 1
                    batch.append(sid)
                    if message_id in chains.uid_of:
                        uids.append(chains.uid_of[message_id])
                if self.settings.fsync:
                    self.fs.fsync_dir(dead_dir)
            except BaseException:
                if claim is not None:  # say what vanished so far; if even that fails, a listing repairs it
                    self._close_quietly(claim, chains.expunge(uids, time.time(), self.vanished_keep) if uids else None)
                raise
            cache.dead.update(batch)
            if claim is not None:
                gone = chains.expunge(uids, time.time(), self.vanished_keep)
                if self._finish_claim(claim, modseq_claim(gone), modseq_claim(None)):
                    chains.take_change(claim.n, gone, time.time())
                else:  # held too long: claimed again, above any HIGHESTMODSEQ read since (the messages are gone)
                    chains.take_change(claim.n, None, time.time())
                    self._sequence(user_file, mailbox_id, cache, gone)
        # A UID given meanwhile to one of them (another node numbering or renumbering it) vanishes too.
        self._walk_claims(user_file, mailbox_id, cache)
        self._vanish_lost(user_file, mailbox_id, cache, [m for _, m in doomed])

    def _collect_tombstones(self, box: str, cache: _MailboxCache) -> None:
        """Remove tombstones older than `tombstone_grace` (a few per deletion), so a mailbox's
        deletions do not make every listing longer for ever. A replica that stays apart longer
        than the grace could bring such a message back: the grace must outlast any partition."""
        now, grace = time.time(), self.settings.tombstone_grace
        dead_dir = os.path.join(box, "dead")
        old = []
        for name in self.fs.listdir(dead_dir):
            sid = leading_sid(name)
            # deleted after it arrived: a message younger than the grace was deleted within it
            if sid and message_id_time(parse_sortable_id(sid)).timestamp() < now - grace and cache.young.get(name, 0) < now:
                old.append((name, sid))
        stale = []
        for name, sid in old[:TOMBSTONES_PER_DELETE]:
            deleted = self.fs.stat(os.path.join(dead_dir, name)).st_mtime
            if deleted < now - grace:
                stale.append((name, sid))
            else:
                cache.young[name] = deleted + grace
        if not stale:
            return
        sids = {sid for _, sid in stale}
        markers = self._entries(box, "msg", sids)
        bodies = self._entries(box, "body", sids)
        self._remove_entries(box, "msg", markers)
        self._remove_entries(box, "body", bodies)
        for name, sid in stale:
            if sid not in markers:  # else a replica brought it back: removed again, the tombstone kept
                self.fs.unlink(os.path.join(dead_dir, name), missing_ok=True)

    def _entries(self, box: str, part: str, sids: set[str]) -> dict[str, list[str]]:
        """Every name in a mailbox directory (body, msg or flags) that belongs to one of `sids`,
        by its leading id. A replica merge may have listed an entry under a second name or renamed
        it (`<sid>#conflict-1`): a deletion that removed only the name it wrote would leave those
        on disk for ever, unseen by any listing but taking space."""
        found: dict[str, list[str]] = {}
        for name in self.fs.listdir(os.path.join(box, part)):
            sid = leading_sid(name)
            if sid in sids:
                found.setdefault(sid, []).append(name)
        return found

    def _remove_entries(self, box: str, part: str, entries: Mapping[str, list[str]]) -> None:
        for names in entries.values():
            for name in names:
                self.fs.unlink(os.path.join(box, part, name), missing_ok=True)

    # ================================================================= claim chains

    def _settled_claim(
        self, path: str, parse: Callable[[bytes], object], what: str, read: Callable[[str], bytes] | None = None
    ) -> object:
        """A claim's content as `parse` reads it (False: not completely written), once its claimer
        has written it; None for a claim given up, ABANDONED for one still not written after
        claim_timeout (its claimer died). FileNotFoundError when nobody made that claim."""
        waited_since: float | None = None
        while True:
            claimed = parse(read(path) if read else self.fs.read_bytes(path, 64))
            if claimed is not False:
                return claimed
            if time.time() - self.fs.stat(path).st_mtime >= self.settings.claim_timeout:
                return ABANDONED
            waited_since = waited_since or time.monotonic()
            if time.monotonic() - waited_since > CLAIM_WAIT:
                raise StoreUnavailable(f"another node is {what} in this mailbox; try again")
            time.sleep(0.02)

    def _walk_chain(
        self, directory: str, start: int, parse: Callable[[bytes], object], what: str,
        take: Callable[[int, object], int], read: Callable[[str], bytes] | None = None,
    ) -> None:
        """Read a chain of claims (UIDs, MODSEQs, \\Recent) from name `start` on, each once its
        claimer wrote it, to the first name nobody created: claims are made in order and never
        removed, so that is the end. `take(n, content)` records claim n and returns the next name."""
        n = start
        while True:
            try:
                claimed = self._settled_claim(os.path.join(directory, str(n)), parse, what, read)
            except FileNotFoundError:
                return
            n = take(n, claimed)

    def _create_claim(self, path: str) -> _OpenClaim | None:
        """Make a claim by exclusive create; None if the name was taken."""
        started = time.monotonic()
        try:
            fd = self.fs.open_write(path, exclusive=True)
        except FileExistsError:
            return None
        return _OpenClaim(path, fd, started)

    def _finish_claim(self, claim: _OpenClaim, content: bytes, given_up: bytes) -> bool:
        """Write a claim made by _create_claim. Readers count a claim still empty after
        claim_timeout as abandoned: a claimer that got here too slowly writes `given_up` instead
        of racing them, and gets False."""
        in_time = time.monotonic() - claim.started < self.settings.claim_timeout / 2
        try:
            self.fs.write_all(claim.fd, claim.path, content if in_time else given_up)
            self.fs.fsync(claim.fd, claim.path)
        finally:
            self.fs.close(claim.fd, claim.path)
        return in_time

    def _claim(self, path: str, content: bytes, given_up: bytes) -> bool:
        """Try to make a claim holding `content`. False if the name was taken (or if this claim
        took so long that readers may have counted it as abandoned: it then holds `given_up`)."""
        claim = self._create_claim(path)
        return claim is not None and self._finish_claim(claim, content, given_up)

    def _close_quietly(self, claim: _OpenClaim, change: dict[str, Any] | None) -> None:
        """Write an open MODSEQ claim on the way out of a failure (what was done, or `-`); if that
        fails too, the claim stays empty and readers count it as abandoned after claim_timeout."""
        try:
            self._finish_claim(claim, modseq_claim(change), modseq_claim(None))
        except OSError:
            pass

    def _bracket_seconds(self) -> float:
        """How long a change keeps a MODSEQ claim open (readers wait for it) before taking another."""
        return min(CLAIM_WAIT, self.settings.claim_timeout) / 4

    def _chains(self, user_file: str, mailbox_id: str, cache: _MailboxCache) -> Chains:
        """The claims this process read, starting from the mailbox's checkpoint if it has not
        read any yet. Caller holds cache.lock."""
        chains = cache.chains
        if not chains.loaded:
            path = self.layout.checkpoint(user_file, mailbox_id)
            try:
                chains.load(self.fs.read_whole(path))
            except FileNotFoundError:
                pass
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                log.warning("ignoring the unreadable checkpoint %s: %s", path, exc)
            chains.loaded = True  # not when the read failed: the next call tries again
        return chains

    def _sync(self, user_file: str, mailbox_id: str, cache: _MailboxCache) -> Chains:
        """Read the UID claims, then the MODSEQ claims, made since this process last looked: a
        numbering's UID claims are written before its MODSEQ claim, so every MODSEQ a listing
        shows is at or below the HIGHESTMODSEQ read with it. Caller holds cache.lock."""
        self._walk_claims(user_file, mailbox_id, cache)
        return self._walk_modseqs(user_file, mailbox_id, cache)

    def _checkpoint(self, user_file: str, mailbox_id: str, cache: _MailboxCache) -> None:
        """After enough claims were read, sum them up in the mailbox's checkpoint (replaced
        atomically; any checkpoint is a valid start, so nodes writing one at once do no harm).
        Best effort: a failure only means later readers read more claims. Caller holds cache.lock."""
        chains = cache.chains
        if not chains.checkpoint_due():
            return
        chains.prune(cache.dead)
        data, entries = chains.checkpoint(cache.dead)
        path = self.layout.checkpoint(user_file, mailbox_id)
        try:
            try:
                self.fs.replace_file(path, data, self.settings.fsync)
            except FileNotFoundError:
                self.fs.makedirs(os.path.dirname(path))
                self.fs.replace_file(path, data, self.settings.fsync)
        except OSError as exc:
            log.warning("could not write the checkpoint %s: %s", path, exc)
        chains.checkpointed, chains.checkpoint_size = chains.next_uid + chains.next_modseq, entries

    # ================================================================= IMAP UIDs

    def _walk_claims(self, user_file: str, mailbox_id: str, cache: _MailboxCache) -> Chains:
        """Read the UID claims after the last one this process knows. A message renumbered
        (Store.assign_uids) holds several claims; its UID is the highest, the last one walked.
        Caller holds cache.lock."""
        chains = self._chains(user_file, mailbox_id, cache)
        now = time.time()
        self._walk_chain(
            self.layout.uids(user_file, mailbox_id), chains.next_uid, parse_uid_claim, "assigning UIDs",
            lambda n, claimed: chains.take_uid(n, claimed, now),  # given up, or its claimer died: the UID is burnt
        )
        return chains

    async def assign_uids(
        self,
        user: str,
        mailbox: str,
        ids: Sequence[uuid.UUID],
        renumber: Mapping[uuid.UUID, int] | None = None,
        modseqs: dict[uuid.UUID, int] | None = None,
        listed_at: int | None = None,
    ) -> dict[uuid.UUID, int]:
        wanted = uid_work(ids, renumber)
        again = dict(renumber or {})
        key, name = address_key(user), mailbox_name(mailbox)

        def assign() -> dict[uuid.UUID, int]:
            user_file, mailbox_id, box = self._where(key, name)
            if not wanted:
                return {}
            cache = self._cache(mailbox_id)
            live = {m.id for m in self._messages(box, cache).values()}
            with cache.lock:
                chains = self._walk_claims(user_file, mailbox_id, cache)
                todo = [i for i in wanted if i in live and needs_uid(chains.uid_of.get(i), i, again)]
                if todo:
                    self._number(user_file, mailbox_id, box, cache, todo, again)
                return {i: chains.uid_of[i] for i in wanted if i in live and i in chains.uid_of}

        return await self._call(assign)

    def _number(
        self, user_file: str, mailbox_id: str, box: str, cache: _MailboxCache, todo: list[uuid.UUID], again: dict[uuid.UUID, int]
    ) -> None:
        """Claim a UID for each of `todo` in order, under a MODSEQ claim taken first (empty) and
        written after the UID claims that name it; a claim is kept open a fraction of CLAIM_WAIT,
        then the next batch takes another. Caller holds cache.lock."""
        chains = cache.chains
        directory = self.layout.uids(user_file, mailbox_id)
        claim: _OpenClaim | None = None
        uids: list[int] = []
        numbered: list[uuid.UUID] = []
        try:
            for message_id in todo:
                # Renumbering claims a new UID for the same id. A lost exclusive create means
                # someone claimed that UID first; the walk reads it, and if it was this very
                # message (another node renumbering it too), the UID moved: nothing more to do.
                while needs_uid(chains.uid_of.get(message_id), message_id, again):
                    if claim is not None and time.monotonic() - claim.started > self._bracket_seconds():
                        self._close_numbering(cache, claim, uids)
                        claim, uids = None, []
                    if claim is None:
                        claim = self._open_modseq_claim(user_file, mailbox_id, cache)
                        continue  # it read the UID claims again: this one may have got a UID meanwhile
                    if chains.next_uid == 1:
                        self.fs.makedirs(directory)
                    uid = chains.next_uid
                    if self._claim(os.path.join(directory, str(uid)), uid_claim(message_id, claim.n), uid_claim(None)):
                        chains.take_uid(uid, (message_id, claim.n), time.time())
                        uids.append(uid)
                        numbered.append(message_id)
                    else:
                        self._walk_claims(user_file, mailbox_id, cache)  # someone else's: read it, go on
        except BaseException:
            if claim is not None:
                self._close_quietly(claim, {"k": "n", "uids": uids})
            raise
        if claim is not None:
            self._close_numbering(cache, claim, uids)
        # A message deleted while it was numbered here (its deleter saw no UID to make vanish).
        dead = {leading_sid(n) for n in self.fs.listdir(os.path.join(box, "dead"))}
        cache.dead.update(sid for sid in dead if sid)
        self._vanish_lost(user_file, mailbox_id, cache, [m for m in numbered if sid_of(m) in dead])

    def _close_numbering(self, cache: _MailboxCache, claim: _OpenClaim, uids: list[int]) -> None:
        numbering = {"k": "n", "uids": uids}
        done = self._finish_claim(claim, modseq_claim(numbering), modseq_claim(None))
        cache.chains.take_change(claim.n, numbering if done else None, time.time())  # `-`: its UID claims still name it

    async def changes_token(self, user: str, mailbox: str) -> Hashable | None:
        """The modification times of the directories every change adds an entry to or removes one
        from (markers, tombstones, flag records, UID and MODSEQ claims): a few stats, no listing.
        None while one of them changed within TOKEN_SETTLE seconds: two changes in one tick of
        the file system's clock leave one time, so a recent time does not prove nothing followed."""
        key, name = address_key(user), mailbox_name(mailbox)

        def token() -> Hashable | None:
            user_file, mailbox_id, box = self._where(key, name)
            paths = (os.path.join(box, "msg"), os.path.join(box, "dead"), os.path.join(box, "flags"),
                     self.layout.uids(user_file, mailbox_id), self.layout.modseqs(user_file, mailbox_id))
            stamps: list[int | None] = []
            for path in paths:
                try:
                    stamps.append(self.fs.stat(path).st_mtime_ns)
                except FileNotFoundError:
                    stamps.append(None)
            newest = max((t for t in stamps if t is not None), default=0)
            if time.time_ns() - newest < TOKEN_SETTLE * 1e9:
                return None
            return (mailbox_id, *stamps)

        return await self._call(token)

    async def uid_next(self, user: str, mailbox: str) -> int:
        key, name = address_key(user), mailbox_name(mailbox)

        def next_uid() -> int:
            user_file, mailbox_id, _ = self._where(key, name)
            cache = self._cache(mailbox_id)
            with cache.lock:
                return self._walk_claims(user_file, mailbox_id, cache).next_uid

        return await self._call(next_uid)

    # ================================================================= MODSEQs (RFC 7162)

    def _walk_modseqs(self, user_file: str, mailbox_id: str, cache: _MailboxCache) -> Chains:
        """Read the MODSEQ claims after the last one this process knows, waiting for any still
        being written (its change is under way). Caller holds cache.lock."""
        chains = self._chains(user_file, mailbox_id, cache)
        now = time.time()
        self._walk_chain(
            self.layout.modseqs(user_file, mailbox_id), chains.next_modseq, parse_modseq_claim, "changing messages",
            lambda n, change: chains.take_change(n, change, now), self.fs.read_whole,
        )
        return chains

    def _open_modseq_claim(self, user_file: str, mailbox_id: str, cache: _MailboxCache) -> _OpenClaim:
        """Take the next MODSEQ claim, still empty, after reading every claim below it. The caller
        makes its change, then writes the claim (or `-`) soon: readers wait for it meanwhile.
        Caller holds cache.lock."""
        directory = self.layout.modseqs(user_file, mailbox_id)
        while True:
            chains = self._sync(user_file, mailbox_id, cache)
            try:
                claim = self._create_claim(os.path.join(directory, str(chains.next_modseq)))
            except FileNotFoundError:
                self.fs.makedirs(directory)  # the mailbox's first change (or one from before MODSEQs)
                continue
            if claim is not None:
                claim.n = chains.next_modseq
                return claim

    def _sequence(
        self, user_file: str, mailbox_id: str, cache: _MailboxCache, change: dict[str, Any] | Callable[[], dict[str, Any]]
    ) -> int:
        """Claim a MODSEQ for a change already made (and visible): `change` is what the claim
        says, or makes it once every claim below is read. Caller holds cache.lock."""
        while True:
            claim = self._open_modseq_claim(user_file, mailbox_id, cache)
            try:
                made = change() if callable(change) else change
            except BaseException:
                self._close_quietly(claim, None)
                raise
            done = self._finish_claim(claim, modseq_claim(made), modseq_claim(None))
            cache.chains.take_change(claim.n, made if done else None, time.time())
            if done:
                return claim.n

    def _vanish_lost(self, user_file: str, mailbox_id: str, cache: _MailboxCache, dead: Iterable[uuid.UUID]) -> None:
        """Give a MODSEQ to the UIDs of deleted messages that no claim says vanished. Caller holds cache.lock."""
        chains = cache.chains
        lost = sorted({chains.uid_of[m] for m in dead if m in chains.uid_of} - chains.vanished_uids)
        if lost:
            self._sequence(user_file, mailbox_id, cache, lambda: chains.expunge(lost, time.time(), self.vanished_keep))

    def _repair(self, user_file: str, mailbox_id: str, cache: _MailboxCache) -> None:
        """A MODSEQ claim was abandoned: if it was a deletion's, its messages are buried but their
        UIDs were never said to vanish. Every deleted message whose UID no claim names gets a
        MODSEQ for it now. Caller holds cache.lock, after reading the tombstones and the claims."""
        chains = cache.chains
        chains.repair = False
        self._vanish_lost(user_file, mailbox_id, cache, [m for m in chains.uid_of if sid_of(m) in cache.dead])

    async def highest_modseq(self, user: str, mailbox: str) -> int:
        key, name = address_key(user), mailbox_name(mailbox)

        def highest() -> int:
            user_file, mailbox_id, _ = self._where(key, name)
            cache = self._cache(mailbox_id)
            with cache.lock:
                return self._walk_modseqs(user_file, mailbox_id, cache).highest

        return await self._call(highest)

    async def vanished_since(self, user: str, mailbox: str, modseq: int) -> list[int] | None:
        key, name = address_key(user), mailbox_name(mailbox)

        def vanished() -> list[int] | None:
            user_file, mailbox_id, _ = self._where(key, name)
            cache = self._cache(mailbox_id)
            with cache.lock:
                return self._sync(user_file, mailbox_id, cache).vanished_since(modseq)

        return await self._call(vanished)

    # ================================================================= IMAP \Recent

    def _walk_recent(self, user_file: str, mailbox_id: str, cache: _MailboxCache) -> None:
        """Follow the \\Recent claim chain from the last mark this process knows to its end (the
        first name nobody created). A claim given up, or abandoned by a claimer that died, moves
        the chain on by one: nobody owns \\Recent for that UID. Caller holds cache.recent_lock."""

        def take(mark: int, raised: object) -> int:
            cache.recent = max(raised, mark + 1) if isinstance(raised, int) else mark + 1
            return cache.recent

        self._walk_chain(self.layout.recent(user_file, mailbox_id), cache.recent, parse_recent_claim, "claiming \\Recent", take)

    async def recent_mark(self, user: str, mailbox: str) -> int:
        key, name = address_key(user), mailbox_name(mailbox)

        def mark() -> int:
            user_file, mailbox_id, _ = self._where(key, name)
            cache = self._cache(mailbox_id)
            with cache.recent_lock:
                self._walk_recent(user_file, mailbox_id, cache)
                return cache.recent

        return await self._call(mark)

    async def claim_recent(self, user: str, mailbox: str, below: int, known: int | None = None) -> int:
        """Claim [mark, below) by creating the claim named by the mark; a lost create means
        another node claimed from there first: walk on and claim what lies above, if anything."""
        below = check_recent_below(below)
        key, name = address_key(user), mailbox_name(mailbox)

        def claim() -> int:
            user_file, mailbox_id, _ = self._where(key, name)
            cache = self._cache(mailbox_id)
            directory = self.layout.recent(user_file, mailbox_id)
            with cache.recent_lock:
                self._walk_recent(user_file, mailbox_id, cache)
                while cache.recent < below:
                    mark = cache.recent
                    if mark == 1:
                        self.fs.makedirs(directory)
                    if self._claim(os.path.join(directory, str(mark)), recent_claim(below), recent_claim(None)):
                        cache.recent = below
                        return mark
                    self._walk_recent(user_file, mailbox_id, cache)
                return cache.recent

        return await self._call(claim)


__all__ = ["WheelFSStore"]
