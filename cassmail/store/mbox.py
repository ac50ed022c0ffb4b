"""The local mbox backend of the Store contract: every mailbox one mbox file on local disk.

Layout under `store.mbox.path`::

    domains.json                          local domains (written atomically)
    aliases.json                          aliases: {"aliases": {alias: [user, ...]}} (written atomically)
    lock                                  OFD lock: domains, aliases, user creation and deletion
    users/<user>/account.json             address and password hash
    users/<user>/uidvalidity              the user's next UIDVALIDITY (never repeats)
    users/<user>/lock                     OFD lock: the user's mailbox list and counter
    users/<user>/rename.json              only while a rename with children is under way
    users/<user>/mail/<mailbox>/mbox      the mailbox, mboxrd (`mutt -f .../mail/INBOX/mbox`)
    users/<user>/mail/<mailbox>/index     its side index (see mbox_index)
    users/<user>/mail/<mailbox>/meta.json special-use and subscription
    users/<user>/sieve/...                Sieve scripts and vacation records (file_sieve)

Names map to file names reversibly: `%` becomes `%25`, `/` (the hierarchy
delimiter) `%2F` and a leading `.` `%2E`; everything else, Unicode included, is
kept, so `Entwürfe/日本` lives in `mail/Entwürfe%2F日本/`. A name whose file
name would pass the file system's 255-byte limit is refused.

The mailbox list *is* the directory listing: one directory per mailbox, created
under a temporary name and renamed into place, deleted by renaming it away, so
each change is one atomic rename and the list can never disagree with the files.
A rename with children is several renames; it is written down first
(`rename.json`) and whoever takes the user's lock next finishes it. Every small
file is replaced atomically (write, fsync, rename, fsync the directory).

Lock order, which rules out deadlocks: the store lock, then a user's lock, then a
mailbox's lock; a mailbox operation only ever takes the user lock last (an
index rebuild needs a new UIDVALIDITY), and nothing holding a user lock waits
for a mailbox.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Collection, Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from cassmail.config import MboxSettings
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
    new_message_id,
    normalize_domain,
)
from cassmail.processes import pid_alive
from cassmail.store import mbox_fs
from cassmail.store.file_queue import FileKeys, FileQueue, FileQueueStore
from cassmail.store.file_sieve import FileSieve
from cassmail.store.wheelfs_fs import FileSystem
from cassmail.store.base import (
    Alias,
    AliasExists,
    Body,
    DomainInUse,
    FlagMode,
    MailboxExists,
    MailboxNotAllowed,
    MailboxStatus,
    NoSuchAlias,
    NoSuchDomain,
    NoSuchMailbox,
    NoSuchMessage,
    NoSuchUser,
    RecentClaim,
    StoreUnavailable,
    Target,
    UserExists,
    appended_date,
    check_alias,
    check_flag_mode,
    check_recent_below,
    check_rename,
    checked_password_hash,
    decode_name,
    encode_name,
    internal_date_micros,
    numbered_summary,
    prepare_delivery,
)
from cassmail.store.mbox_watch import DirectoryWatch
from cassmail.store.mbox_index import CompactReport, MailboxFile, MailboxGone, MessageGone, NeedsRecovery, ReadState, WouldWait
from cassmail.store.mbox_quota import MboxQuota
from cassmail.threads import THREADS

T = TypeVar("T")

#: Open mailboxes kept per process (two descriptors each); the least recently used are closed.
OPEN_MAILBOXES = 256
#: Longest file name most Linux file systems take.
MAX_FILE_NAME = 255

#: What a storage failure raises in file work (a lock not had in time is an OSError too).
_STORAGE_ERRORS = (OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError)


@contextmanager
def _storage_errors() -> Iterator[None]:
    """Storage failures (a lock not had in time, an OS error, an unreadable record) as StoreUnavailable."""
    try:
        yield
    except mbox_fs.LockTimeout as exc:
        raise StoreUnavailable(f"mailbox busy: {exc}") from exc
    except OSError as exc:
        raise StoreUnavailable(f"mbox store: {exc}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError) as exc:
        raise StoreUnavailable(f"mbox store: unreadable record: {exc}") from exc


class MboxStore(MboxQuota, FileQueueStore):
    def __init__(self, settings: MboxSettings, max_message_size: int = 0) -> None:
        self.settings = settings
        self.max_message_size = max_message_size
        self.root = Path(settings.path)
        self._open_files: OrderedDict[Path, MailboxFile] = OrderedDict()
        #: (user key, mailbox name) -> its directory, for reads on the event loop (`_reading`).
        self._boxes: dict[tuple[str, str], Path] = {}
        self._cache_lock = threading.Lock()
        self._thread_locks: dict[Path, threading.Lock] = {}
        self._collapse = False
        self.queue = FileQueue(FileSystem(), str(self.root / "queue"), settings.fsync)
        self.keys = FileKeys(FileSystem(), str(self.root / "dkim"), settings.fsync)
        self.sieve = FileSieve(FileSystem(), settings.fsync, lambda key: str(self._existing_user(key)))

    # ================================================================= lifecycle

    async def open(self) -> None:
        await self._call(self._open_sync)

    def _open_sync(self) -> None:
        for sub in ("users", "trash"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.queue.open()
        self.keys.open()
        (self.root / "lock").touch(exist_ok=True)
        self._collapse = mbox_fs.supports_collapse(self.root)
        if self.settings.method == "collapse" and not self._collapse:
            raise StoreUnavailable(f"store.mbox.method is collapse, but the file system of {self.root} cannot collapse ranges")
        with self._store_lock():
            for leftover in (self.root / "trash").iterdir():
                shutil.rmtree(leftover, ignore_errors=True)
            for leftover in (self.root / "users").glob(".new-*"):
                if not _pid_alive(leftover.name):
                    shutil.rmtree(leftover, ignore_errors=True)
            mbox_fs.remove_dotlock_sources(str(self.root))

    async def close(self) -> None:
        if getattr(self, "_watch", None) is not None:
            self._watch.close()
            self._watch = None
        with self._cache_lock:
            files, self._open_files = list(self._open_files.values()), OrderedDict()
        for mf in files:
            mf.close()

    @property
    def collapse_supported(self) -> bool:
        return self._collapse

    # ================================================================= plumbing

    async def _call(self, fn: Callable[..., T], *args: Any, cancel: threading.Event | None = None) -> T:
        """Run blocking file work off the event loop; storage failures become StoreUnavailable.
        (`cancel` is for callers that may time out; a local disk call is never abandoned.)"""
        with _storage_errors():
            return await THREADS.run(fn, *args)

    @contextmanager
    def _file_lock(self, path: Path) -> Iterator[None]:
        """An exclusive OFD lock on a small lock file, plus a thread lock for this process's threads."""
        with self._cache_lock:
            thread_lock = self._thread_locks.setdefault(path, threading.Lock())
        with thread_lock:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                with mbox_fs.locked(fd, True, self.settings.lock_timeout):
                    yield
            finally:
                os.close(fd)

    def _store_lock(self) -> Any:
        return self._file_lock(self.root / "lock")

    def _user_dir(self, key: str) -> Path:
        name = encode_name(key)
        if len(name.encode()) > MAX_FILE_NAME:
            raise InvalidAddress(f"address too long for a file name of the mbox store: {key!r}")
        return self.root / "users" / name

    def _user_lock(self, key: str) -> Any:
        user_dir = self._existing_user(key)
        return self._file_lock(user_dir / "lock")

    def _existing_user(self, key: str) -> Path:
        user_dir = self._user_dir(key)
        if not (user_dir / "account.json").exists():
            raise NoSuchUser(key)
        return user_dir

    def _mailbox_dir(self, user_dir: Path, name: str) -> Path:
        enc = encode_name(name)
        if len(enc.encode()) > MAX_FILE_NAME:
            raise InvalidMailboxName(f"mailbox name too long for a file name of the mbox store: {name!r}")
        return user_dir / "mail" / enc

    # ================================================================= domains

    async def add_domain(self, domain: str) -> None:
        domain = normalize_domain(domain)
        await self._call(self._change_domains, lambda ds: ds | {domain})

    async def remove_domain(self, domain: str) -> None:
        domain = normalize_domain(domain)

        def remove(domains: set[str]) -> set[str]:
            if domain not in domains:
                raise NoSuchDomain(domain)
            users = self._users_sync(domain)
            aliases = [a for a in self._aliases_sync() if a.rpartition("@")[2] == domain]
            if users or aliases:
                raise DomainInUse(domain, len(users), len(aliases))
            return domains - {domain}

        await self._call(self._change_domains, remove)

    def _change_domains(self, change: Callable[[set[str]], set[str]]) -> None:
        with self._store_lock():
            before = self._domains_sync()
            after = change(set(before))
            if after != set(before):
                mbox_fs.write_json(self.root / "domains.json", {"domains": sorted(after)}, self.settings.fsync)

    def _domains_sync(self) -> list[str]:
        try:
            return sorted(mbox_fs.read_json(self.root / "domains.json")["domains"])
        except FileNotFoundError:
            return []

    async def list_domains(self) -> list[str]:
        return await self._call(self._domains_sync)

    # ================================================================= users

    async def create_user(self, user: str, password_hash: str) -> None:
        key = address_key(user)
        await self._call(self._create_user_sync, key, checked_password_hash(password_hash))

    def _create_user_sync(self, key: str, password_hash: str) -> None:
        domain = key.rpartition("@")[2]
        final = self._user_dir(key)
        with self._store_lock():
            if domain not in self._domains_sync():
                raise NoSuchDomain(domain)
            if (final / "account.json").exists():
                raise UserExists(key)
            if key in self._aliases_sync():
                raise AliasExists(key)
            # Built aside and renamed into place: a user exists with all six mailboxes or not at all.
            staging = self.root / "users" / f".new-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            (staging / "mail").mkdir(parents=True)
            try:
                base = int(time.time())
                for i, (name, special) in enumerate(DEFAULT_MAILBOXES.items()):
                    self._make_mailbox(staging, name, special, base + i)
                mbox_fs.atomic_write(staging / "uidvalidity", b"%d\n" % (base + len(DEFAULT_MAILBOXES)), self.settings.fsync)
                mbox_fs.write_json(
                    staging / "account.json",
                    {"user": key, "password_hash": password_hash, "created": int(time.time())},
                    self.settings.fsync,
                )
                if final.exists():  # a leftover without account.json (crash during deletion)
                    self._discard(final)
                os.rename(staging, final)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            mbox_fs.fsync_dir(final.parent)

    def _make_mailbox(self, user_dir: Path, name: str, special_use: str | None, uidvalidity: int) -> None:
        """Create a mailbox directory aside and rename it into place (MailboxExists if taken)."""
        target = self._mailbox_dir(user_dir, name)
        staging = user_dir / "mail" / f".new-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        staging.mkdir()
        try:
            MailboxFile.create(staging / "mbox", staging / "index", uidvalidity, self.settings.fsync)
            mbox_fs.write_json(staging / "meta.json", {"special_use": special_use, "subscribed": True}, self.settings.fsync)
            try:
                os.rename(staging, target)
            except OSError as exc:
                if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                    raise MailboxExists(self._key_of(user_dir), name) from None
                raise
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        if self.settings.fsync:
            mbox_fs.fsync_dir(target.parent)

    def _key_of(self, user_dir: Path) -> str:
        return decode_name(user_dir.name)

    def _discard(self, path: Path) -> None:
        """Remove a directory atomically (renamed into trash first), then its files."""
        grave = self.root / "trash" / f"{path.name[:100]}-{uuid.uuid4().hex[:8]}"
        os.rename(path, grave)
        if self.settings.fsync:
            mbox_fs.fsync_dir(path.parent)
        shutil.rmtree(grave, ignore_errors=True)

    async def delete_user(self, user: str) -> None:
        key = address_key(user)
        await self._call(self._delete_user_sync, key)

    def _delete_user_sync(self, key: str) -> None:
        with self._store_lock():
            user_dir = self._existing_user(key)
            # Out of every alias first: a failure after it leaves the user, and deleting again finishes.
            aliases = self._aliases_sync()
            kept = {a: [u for u in users if u != key] for a, users in aliases.items()}
            self._write_aliases(aliases, {a: users for a, users in kept.items() if users})
            self._forget_under(user_dir)
            self._discard(user_dir)

    def _account(self, key: str) -> dict[str, Any]:
        try:
            return mbox_fs.read_json(self._user_dir(key) / "account.json")  # type: ignore[no-any-return]
        except FileNotFoundError:
            raise NoSuchUser(key) from None

    async def get_password_hash(self, user: str) -> str:
        key = address_key(user)
        return str((await self._call(self._account, key))["password_hash"])

    async def set_password_hash(self, user: str, password_hash: str) -> None:
        key = address_key(user)
        password_hash = checked_password_hash(password_hash)

        def change() -> None:
            with self._user_lock(key):
                account = self._account(key)
                account["password_hash"] = password_hash
                mbox_fs.write_json(self._user_dir(key) / "account.json", account, self.settings.fsync)

        await self._call(change)

    async def list_users(self, domain: str | None = None) -> list[str]:
        wanted = normalize_domain(domain) if domain is not None else None
        return await self._call(self._users_sync, wanted)

    def _users_sync(self, domain: str | None = None) -> list[str]:
        keys = []
        for entry in os.scandir(self.root / "users"):
            if entry.name.startswith(".") or not os.path.exists(os.path.join(entry.path, "account.json")):
                continue
            key = decode_name(entry.name)
            if domain is None or key.rpartition("@")[2] == domain:
                keys.append(key)
        return sorted(keys)

    # ================================================================= aliases

    def _aliases_sync(self) -> dict[str, list[str]]:
        """alias -> its users, as the file has them (replaced atomically: no lock needed to read)."""
        try:
            return dict(mbox_fs.read_json(self.root / "aliases.json")["aliases"])
        except FileNotFoundError:
            return {}

    def _write_aliases(self, before: dict[str, list[str]], after: dict[str, list[str]]) -> None:
        """Replace aliases.json when something changed; the caller holds the store lock."""
        if after != before:
            mbox_fs.write_json(self.root / "aliases.json", {"aliases": after}, self.settings.fsync)

    def _is_user(self, key: str) -> bool:
        return (self._user_dir(key) / "account.json").exists()

    async def set_alias(self, alias: str, users: Iterable[str]) -> None:
        key, targets = check_alias(alias, users)

        def change() -> None:
            # Under the store lock, like user creation and deletion: an alias and a user can never
            # take one address, and an alias never names a user being deleted.
            with self._store_lock():
                domain = key.rpartition("@")[2]
                if domain not in self._domains_sync():
                    raise NoSuchDomain(domain)
                if self._is_user(key):
                    raise UserExists(key, "an alias cannot have a user's address")
                for target in targets:
                    if not self._is_user(target):
                        raise NoSuchUser(target)
                aliases = self._aliases_sync()
                self._write_aliases(aliases, {**aliases, key: list(targets)})

        await self._call(change)

    async def delete_alias(self, alias: str) -> None:
        key = address_key(alias)

        def delete() -> None:
            with self._store_lock():
                aliases = self._aliases_sync()
                if key not in aliases:
                    raise NoSuchAlias(key)
                self._write_aliases(aliases, {a: u for a, u in aliases.items() if a != key})

        await self._call(delete)

    async def get_alias(self, alias: str) -> list[str] | None:
        key = address_key(alias)
        users = (await self._call(self._aliases_sync)).get(key)
        return sorted(users) if users else None

    async def list_aliases(self, domain: str | None = None) -> list[Alias]:
        wanted = normalize_domain(domain) if domain is not None else None
        aliases = await self._call(self._aliases_sync)
        return [
            Alias(a, tuple(sorted(users)))
            for a, users in sorted(aliases.items())
            if users and (wanted is None or a.rpartition("@")[2] == wanted)
        ]

    def _next_uidvalidity(self, user_dir: Path, count: int = 1) -> int:
        """Reserve `count` UIDVALIDITY values; the caller holds the user's lock."""
        path = user_dir / "uidvalidity"
        try:
            current = int(path.read_text().strip() or 0)
        except FileNotFoundError:
            current = 0
        first = max(current, int(time.time()))
        mbox_fs.atomic_write(path, b"%d\n" % (first + count), self.settings.fsync)
        return first

    def _uidvalidity_source(self, user_dir: Path) -> Callable[[], int]:
        """What an index rebuild calls for a fresh UIDVALIDITY (the user lock is a leaf lock here)."""

        def fresh() -> int:
            with self._file_lock(user_dir / "lock"):
                return self._next_uidvalidity(user_dir)

        return fresh

    # ================================================================= mailboxes

    def _finish_rename(self, user_dir: Path) -> None:
        """Complete a rename a crashed process left half done; the caller holds the user lock."""
        intent = user_dir / "rename.json"
        try:
            plan = mbox_fs.read_json(intent)
        except FileNotFoundError:
            return
        for source, target in plan["moves"]:
            src, dst = user_dir / "mail" / source, user_dir / "mail" / target
            if src.exists() and not dst.exists():
                os.rename(src, dst)
        if self.settings.fsync:
            mbox_fs.fsync_dir(user_dir / "mail")
        if plan.get("new_inbox") and not self._mailbox_dir(user_dir, INBOX).exists():
            self._make_mailbox(user_dir, INBOX, None, self._next_uidvalidity(user_dir))
        intent.unlink()
        if self.settings.fsync:
            mbox_fs.fsync_dir(user_dir)

    def _names(self, user_dir: Path) -> list[str]:
        if (user_dir / "rename.json").exists():
            with self._file_lock(user_dir / "lock"):
                self._finish_rename(user_dir)
        try:
            entries = [e.name for e in os.scandir(user_dir / "mail") if not e.name.startswith(".")]
        except FileNotFoundError:
            raise NoSuchUser(self._key_of(user_dir)) from None
        return sorted((decode_name(e) for e in entries), key=lambda n: (n != INBOX, n))

    async def list_mailboxes(self, user: str) -> list[MailboxInfo]:
        key = address_key(user)

        def listing() -> list[MailboxInfo]:
            user_dir = self._existing_user(key)
            out = []
            for name in self._names(user_dir):
                try:
                    out.append(self._info(key, name))
                except NoSuchMailbox:
                    continue  # deleted meanwhile
            return out

        return await self._call(listing)

    def _info(self, key: str, name: str) -> MailboxInfo:
        return self._with_mailbox(key, name, lambda mf: self._info_of(mf, name))

    async def mailbox_info(self, user: str, name: str) -> MailboxInfo:
        key, name = address_key(user), mailbox_name(name)

        def in_a_thread() -> MailboxInfo:
            self._existing_user(key)  # NoSuchUser before NoSuchMailbox
            return self._info(key, name)

        return await self._reading(user, name, lambda mf: self._info_of(mf, name), in_a_thread)

    @staticmethod
    def _info_of(mf: MailboxFile, name: str) -> MailboxInfo:
        meta = _meta(mf.mbox_path.parent)
        return MailboxInfo(name, mf.info(), meta.get("special_use"), bool(meta.get("subscribed", True)))

    @contextmanager
    def _locked_mailbox(self, key: str, name: str) -> Iterator[Path]:
        """A mailbox's directory, under the user's lock, with any half-done rename finished."""
        user_dir = self._existing_user(key)
        with self._user_lock(key):
            self._finish_rename(user_dir)
            box = self._mailbox_dir(user_dir, name)
            if not box.exists():
                raise NoSuchMailbox(key, name)
            yield box

    async def set_subscribed(self, user: str, name: str, subscribed: bool) -> None:
        key, name = address_key(user), mailbox_name(name)

        def update() -> None:
            with self._locked_mailbox(key, name) as box:
                meta = _meta(box)
                meta["subscribed"] = subscribed
                mbox_fs.write_json(box / "meta.json", meta, self.settings.fsync)

        await self._call(update)

    async def create_mailbox(self, user: str, name: str, special_use: str | None = None) -> MailboxInfo:
        key, name = address_key(user), mailbox_name(name)

        def create() -> MailboxInfo:
            user_dir = self._existing_user(key)
            with self._user_lock(key):
                self._finish_rename(user_dir)
                if self._mailbox_dir(user_dir, name).exists():
                    raise MailboxExists(key, name)
                uidvalidity = self._next_uidvalidity(user_dir)
                self._make_mailbox(user_dir, name, special_use, uidvalidity)
            return MailboxInfo(name, uidvalidity, special_use, True)

        return await self._call(create)

    async def rename_mailbox(self, user: str, old: str, new: str) -> None:
        key = address_key(user)
        old, new = check_rename(key, old, new)

        def rename() -> None:
            user_dir = self._existing_user(key)
            with self._user_lock(key):
                self._finish_rename(user_dir)
                names = set(self._names(user_dir))
                if old not in names:
                    raise NoSuchMailbox(key, old)
                moves = [(old, new)] + [
                    (n, new + n[len(old) :]) for n in sorted(names) if n.startswith(old + HIERARCHY_DELIMITER)
                ]
                for _, target in moves:
                    if target in names:
                        raise MailboxExists(key, target)
                    self._mailbox_dir(user_dir, target)  # refuses names too long for a file name
                encoded = [[encode_name(s), encode_name(t)] for s, t in moves]
                mbox_fs.write_json(user_dir / "rename.json", {"moves": encoded, "new_inbox": old == INBOX},
                                   self.settings.fsync)
                self._finish_rename(user_dir)
            for source, _ in moves:
                self._forget(self._mailbox_dir(user_dir, source))

        await self._call(rename)

    async def delete_mailbox(self, user: str, name: str) -> None:
        key, name = address_key(user), mailbox_name(name)
        if name == INBOX:
            raise MailboxNotAllowed("INBOX cannot be deleted")

        def delete() -> None:
            with self._locked_mailbox(key, name) as box:
                self._forget(box)
                self._discard(box)

        await self._call(delete)

    # ================================================================= open mailbox files

    def _mailbox_file(self, key: str, name: str) -> MailboxFile:
        """The open mailbox (cached), or NoSuchUser / NoSuchMailbox."""
        user_dir = self._user_dir(key)
        box = self._mailbox_dir(user_dir, name)
        with self._cache_lock:
            mf = self._open_files.get(box)
            if mf is not None:
                self._open_files.move_to_end(box)
                return mf
        if not (user_dir / "account.json").exists():
            raise NoSuchUser(key)
        if (user_dir / "rename.json").exists():
            self._names(user_dir)
        if name == INBOX and not box.exists():  # a crash between moving INBOX away and making the new one
            with self._file_lock(user_dir / "lock"):
                self._finish_rename(user_dir)
                if not box.exists():
                    self._make_mailbox(user_dir, INBOX, None, self._next_uidvalidity(user_dir))
        try:
            mf = MailboxFile(box / "mbox", box / "index", self.settings, self._uidvalidity_source(user_dir),
                             self._collapse, lambda: self.vanished_keep, str(self.root))
        except FileNotFoundError:
            raise NoSuchMailbox(key, name) from None
        evicted = []
        with self._cache_lock:
            other = self._open_files.get(box)
            if other is not None:
                evicted.append(mf)
                mf = other
            else:
                self._open_files[box] = mf
                while len(self._open_files) > OPEN_MAILBOXES:
                    evicted.append(self._open_files.popitem(last=False)[1])
        for old in evicted:
            old.close()
        return mf

    def _forget(self, box: Path) -> None:
        with self._cache_lock:
            mf = self._open_files.pop(box, None)
        if mf is not None:
            mf.close()

    def _forget_under(self, user_dir: Path) -> None:
        with self._cache_lock:
            doomed = [p for p in self._open_files if user_dir in p.parents]
        for box in doomed:
            self._forget(box)

    def _with_mailbox(self, key: str, name: str, work: Callable[[MailboxFile], T]) -> T:
        """Run `work` on a mailbox, reopening it if it was renamed or replaced under us."""
        for _ in range(4):
            mf = self._mailbox_file(key, name)
            try:
                return work(mf)
            except MailboxGone:
                self._forget(mf.mbox_path.parent)
            except NeedsRecovery:
                continue
        raise NoSuchMailbox(key, name)

    async def _on_mailbox(self, user: str, mailbox: str, work: Callable[[MailboxFile], T]) -> T:
        key, name = address_key(user), mailbox_name(mailbox)
        return await self._call(self._with_mailbox, key, name, work)

    async def _reading(self, user: str, mailbox: str, work: Callable[[MailboxFile], T],
                       elsewise: Callable[[], T] | None = None) -> T:
        """`_on_mailbox` for work that reads: on the event loop when the mailbox is open here
        and nothing has to be waited for (the index is in memory, the bytes in the page cache),
        which is most of the time and saves a hand-over to a thread and back (on a small VM that
        costs more than the read); else in a thread (MailboxFile.without_waiting), `elsewise`
        when given."""
        key, name = address_key(user), mailbox_name(mailbox)
        box = self._boxes.get((key, name))
        if box is None:
            box = self._mailbox_dir(self._user_dir(key), name)
            if len(self._boxes) >= OPEN_MAILBOXES:
                self._boxes.clear()
            self._boxes[(key, name)] = box
        with self._cache_lock:
            mf = self._open_files.get(box)
        if mf is not None:
            try:
                with _storage_errors(), mf.without_waiting():
                    return work(mf)
            except (WouldWait, MailboxGone, NeedsRecovery):
                pass  # in a thread, which waits, reopens or recovers
        if elsewise is not None:
            return await self._call(elsewise)
        return await self._call(self._with_mailbox, key, name, work)

    # ================================================================= delivery

    async def deliver(
        self, body: Body, targets: Sequence[Target], internal_date: datetime | None = None
    ) -> list[uuid.UUID]:
        view, targets, unique = prepare_delivery(body, targets, self.max_message_size)
        when_us = internal_date_micros(internal_date)
        ids = {k: new_message_id() for k in unique}
        await self._call(self._deliver_sync, view, unique, ids, when_us)  # (one hand-over to a thread)
        return [ids[(t.user, t.mailbox)] for t in targets]

    async def append(
        self, body: Body, target: Target, internal_date: datetime | None = None,
        modseqs: dict[uuid.UUID, int] | None = None, recent: RecentClaim | None = None,
    ) -> MessageSummary:
        """The UID comes in the delivery's own index append (MailboxFile.deliver with `number`),
        without a MODSEQ (`modseqs` is left as it is); \\Recent is claimed as for any other
        message (`recent` is left unclaimed)."""
        view, _, unique = prepare_delivery(body, [target], self.max_message_size)
        [key] = unique
        ids, uids = {key: new_message_id()}, {}
        when = appended_date(internal_date)
        await self._call(self._deliver_sync, view, unique, ids, internal_date_micros(when), uids)
        return numbered_summary(MessageSummary(ids[key], view.nbytes, unique[key].flags, when), uids.get(key), None)

    def _deliver_sync(self, view: memoryview, unique: Mapping[tuple[str, str], Target],
                      ids: Mapping[tuple[str, str], uuid.UUID], when_us: int,
                      uids: dict[tuple[str, str], int | None] | None = None) -> None:
        """Every copy of a delivery; with `uids`, each is numbered as it is written and its UID
        goes there."""
        number = uids is not None

        def write(mf: MailboxFile, k: tuple[str, str]) -> None:
            uid = mf.deliver(view, ids[k], when_us, unique[k].flags, number)
            if uids is not None:
                uids[k] = uid

        # Resolve every target first: an unknown user or mailbox fails before anything is written.
        for user, mailbox in unique:
            self._mailbox_file(user, mailbox)
        limits = self._limits({user for user, _ in unique})
        if limits:  # checked and written under those users' quota locks (mbox_quota)
            self._deliver_within_quota(
                view.nbytes, unique, limits,
                lambda k: self._with_mailbox(k[0], k[1], lambda mf: write(mf, k)),
                lambda k: self._with_mailbox(k[0], k[1], lambda mf: mf.delete([ids[k]])),
            )
            return
        done: list[tuple[str, str]] = []
        try:
            for k in unique:
                self._with_mailbox(k[0], k[1], lambda mf, k=k: write(mf, k))
                done.append(k)
        except _STORAGE_ERRORS:
            for k in done:  # best effort: a failed delivery shows no copy (the sender will retry)
                try:
                    self._with_mailbox(k[0], k[1], lambda mf, k=k: mf.delete([ids[k]]))
                except (*_STORAGE_ERRORS, NoSuchMailbox):
                    pass
            raise

    # ================================================================= listing and reading

    async def list_page(self, user: str, mailbox: str, after: uuid.UUID | None = None, limit: int = 500) -> Page:
        if not 1 <= limit <= 10_000:
            raise InvalidInput(f"page limit must be 1..10000, got {limit}")
        items, cursor = await self._reading(user, mailbox, lambda mf: mf.page(after, limit))
        return Page(items, cursor)

    async def get_summaries(self, user: str, mailbox: str, ids: Iterable[uuid.UUID]) -> dict[uuid.UUID, MessageSummary]:
        wanted = list(ids)
        return await self._reading(user, mailbox, lambda mf: mf.summaries(wanted))

    async def read_chunks(
        self, user: str, mailbox: str, message_id: uuid.UUID, start: int = 0, end: int | None = None
    ) -> AsyncIterator[bytes]:
        """Each step looks the message up again under the shared lock (a compaction may have moved
        it), so one deleted meanwhile stops the stream with NoSuchMessage at the next chunk. The
        first step also finds the size, and the range is checked against it before any byte
        goes out."""
        if start < 0 or (end is not None and start > end):
            raise InvalidInput(f"invalid byte range {start}..{end}")
        state = ReadState(message_id, start, end)
        while not state.done:
            try:
                chunk = await self._reading(user, mailbox, lambda mf: mf.read_step(state))
            except MessageGone:
                raise NoSuchMessage(mailbox_name(mailbox), message_id) from None
            if state.size is not None and start > state.size:
                raise InvalidInput(f"invalid byte range {start}..{end} of a {state.size}-byte message")
            if chunk is None:
                return
            yield chunk

    # ================================================================= flags, deletion, UIDs

    async def store_flags(
        self, user: str, mailbox: str, ids: Iterable[uuid.UUID], flags: Iterable[str], mode: FlagMode = "set",
        unchanged_since: int | None = None, modseqs: dict[uuid.UUID, int] | None = None,
        known: tuple[Mapping[uuid.UUID, MessageSummary], int] | None = None,
    ) -> set[uuid.UUID]:
        mode = check_flag_mode(mode)
        values = flag_set(flags)
        wanted = list(ids)
        changes: dict[str, Callable[[frozenset[str]], frozenset[str]]] = {
            "set": lambda _: values,
            "add": lambda current: current | values,
            "remove": lambda current: current - values,
        }
        return await self._on_mailbox(user, mailbox, lambda mf: mf.store_flags(wanted, changes[mode], unchanged_since))

    async def delete_messages(
        self, user: str, mailbox: str, ids: Iterable[uuid.UUID], modseqs: dict[uuid.UUID, int] | None = None,
        *, only_deleted: bool = False,
    ) -> set[uuid.UUID]:
        wanted = list(ids)
        deleted: set[uuid.UUID] = set()
        await self._on_mailbox(user, mailbox, lambda mf: mf.delete(wanted, only_deleted, deleted))
        return deleted

    async def assign_uids(
        self,
        user: str,
        mailbox: str,
        ids: Sequence[uuid.UUID],
        renumber: Mapping[uuid.UUID, int] | None = None,
        modseqs: dict[uuid.UUID, int] | None = None,
        listed_at: int | None = None,
    ) -> dict[uuid.UUID, int]:
        wanted, again = list(ids), dict(renumber or {})
        return await self._on_mailbox(user, mailbox, lambda mf: mf.assign_uids(wanted, again))

    async def uid_next(self, user: str, mailbox: str) -> int:
        return await self._reading(user, mailbox, lambda mf: mf.uid_next())

    async def changed_mailboxes(
        self, watched: Collection[tuple[str, str]], since: Any
    ) -> tuple[set[tuple[str, str]], Any]:
        """From inotify watches on the watched mailboxes' directories (mbox_watch.py): one read
        per call however many are watched; the changes tokens where inotify cannot be had."""
        watch: DirectoryWatch | None = getattr(self, "_watch", None)
        if watch is None:
            watch = self._watch = DirectoryWatch()
        if not watch.available:
            return await super().changed_mailboxes(watched, since)
        # the directory of each watched pair, worked out once while it stays watched (every poll
        # asks about every watched mailbox)
        known: dict[tuple[str, str], Path] = getattr(self, "_watch_dirs", {})
        dirs = {pair: known.get(pair) or self._mailbox_dir(self._user_dir(address_key(pair[0])), mailbox_name(pair[1]))
                for pair in watched}
        self._watch_dirs = dirs
        for directory in watch.watched() - set(dirs.values()):
            watch.unwatch(directory)
        unwatchable = {pair for pair, directory in dirs.items() if not watch.watch(directory)}
        written, overflow = watch.changed()
        if since is None:
            return set(), True
        if overflow:
            return set(dirs), True
        return {pair for pair, directory in dirs.items() if directory in written} | unwatchable, True

    async def mailbox_status(self, user: str, mailbox: str, recent: bool = False) -> MailboxStatus:
        return await self._reading(user, mailbox, lambda mf: mf.status(recent))

    async def changes_token(self, user: str, mailbox: str) -> Hashable | None:
        return await self._reading(user, mailbox, lambda mf: mf.changes_token())

    async def highest_modseq(self, user: str, mailbox: str) -> int:
        return await self._reading(user, mailbox, lambda mf: mf.highest_modseq())

    async def changes_state(self, user: str, mailbox: str) -> tuple[Hashable | None, int | None]:
        return await self._reading(user, mailbox, lambda mf: (mf.changes_token(), mf.highest_modseq()))

    async def changed_since(self, user: str, mailbox: str, modseq: int) -> list[MessageSummary]:
        return await self._reading(user, mailbox, lambda mf: mf.changed_since(modseq))

    async def vanished_since(self, user: str, mailbox: str, modseq: int) -> list[int] | None:
        return await self._reading(user, mailbox, lambda mf: mf.vanished_since(modseq))

    async def changes_since(self, user: str, mailbox: str, modseq: int) -> tuple[list[MessageSummary], list[int] | None]:
        return await self._reading(user, mailbox, lambda mf: mf.changes_since(modseq))

    def arrivals_mark(self, summaries: Iterable[MessageSummary], started: float | None = None) -> Hashable | None:
        # The highest MODSEQ the listing showed: a message delivered since is unnumbered still
        # or was numbered since, above it (numbering gives it its first MODSEQ).
        return max((s.modseq or 0 for s in summaries if s.uid is not None), default=0)

    async def arrivals(self, user: str, mailbox: str, mark: Hashable) -> tuple[list[MessageSummary], Hashable]:
        assert isinstance(mark, int)
        return await self._reading(user, mailbox, lambda mf: mf.arrivals(mark))

    async def recent_mark(self, user: str, mailbox: str) -> int:
        return await self._reading(user, mailbox, lambda mf: mf.recent_mark())

    async def claim_recent(self, user: str, mailbox: str, below: int, known: int | None = None) -> int:
        below = check_recent_below(below)
        return await self._reading(user, mailbox, lambda mf: mf.claim_recent(below))

    # ================================================================= maintenance

    async def compact(
        self, user: str | None = None, mailbox: str | None = None, budget: int | None = None, defrag: bool = True
    ) -> list[tuple[str, str, CompactReport]]:
        """Compact (and defragment) every mailbox, a user's, or one; `cassmail store compact`."""
        users = [address_key(user)] if user else await self.list_users()
        out = []
        for key in users:
            names = [mailbox_name(mailbox)] if mailbox else [m.name for m in await self.list_mailboxes(key)]
            for name in names:

                def work(mf: MailboxFile) -> CompactReport:
                    before = mf.extents() if self._collapse else None
                    report = mf.compact(budget, None, defrag)
                    report.extents_before, report.extents_after = before, mf.extents() if self._collapse else None
                    return report

                out.append((key, name, await self._call(self._with_mailbox, key, name, work)))
        return out

    def mailbox_file(self, user: str, mailbox: str) -> MailboxFile:
        """The open mailbox itself (blocking methods), for tools and the benchmark."""
        return self._mailbox_file(address_key(user), mailbox_name(mailbox))

    def mailbox_paths(self, user: str, mailbox: str) -> tuple[Path, Path]:
        """(mbox, index) file paths of a mailbox, for tests, tools and the benchmark."""
        box = self._mailbox_dir(self._user_dir(address_key(user)), mailbox_name(mailbox))
        return box / "mbox", box / "index"


# ===================================================================== helpers


def _pid_alive(staging_name: str) -> bool:
    """Whether the process that made a `.new-<pid>-...` staging directory still runs."""
    try:
        pid = int(staging_name.split("-")[1])
    except (ValueError, IndexError):
        return False
    return pid_alive(pid)


__all__ = ["MboxStore", "decode_name", "encode_name"]


def _meta(box: Path) -> dict[str, Any]:
    """A mailbox's meta.json (special-use, subscription); empty when it has none."""
    try:
        return mbox_fs.read_json(box / "meta.json")
    except FileNotFoundError:
        return {}
