"""The thin file-system layer under the WheelFS store: every system call it makes, counted.

The store never touches `os` directly for its data: each call goes through
one `FileSystem` object, which counts it (so a delivery or an IMAP check can be
priced in file-system operations, the paper's measure) and is the one place a
test can inject the faults a wide-area file system shows: timeouts, entries
missing from a listing, deleted files coming back, an entry under a new name.
A subclass overrides three hooks: `before` (called before every operation: a
stall, an error), `listed` (every directory listing passes through it: names
left out, names a stale replica or a merge adds) and `where` (every path an
operation touches passes through it: the copy a stale replica holds, the entry
a name made by a merge duplicates).

Counted operations are system calls: open, read, write, fsync, close,
readdir (one per listing), stat, mkdir, rmdir, unlink, rename.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

#: Bytes per write() when a body is stored.
WRITE_BLOCK = 1024 * 1024


class FileSystem:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    # ----------------------------------------------------------------- accounting and faults

    def before(self, op: str, path: str) -> None:
        """Called before every operation; counts it. Fault injection overrides this."""
        with self._lock:
            self.counts[op] += 1

    def listed(self, path: str, names: list[str]) -> list[str]:
        """Every directory listing passes through here (fault injection overrides this)."""
        return names

    def where(self, path: str) -> str:
        """The file a name reaches: the name itself here. Fault injection overrides this so that
        a name a listing shows (a stale replica's entry, a merge's duplicate) can be opened,
        stat'ed and removed like any other, and one the merge renamed away cannot."""
        return path

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self.counts.values())

    @contextmanager
    def counting(self) -> Iterator[Counter[str]]:
        """The operations made inside the block (this object, all threads)."""
        with self._lock:
            start = Counter(self.counts)
        out: Counter[str] = Counter()
        try:
            yield out
        finally:
            with self._lock:
                out.update(self.counts - start)

    # ----------------------------------------------------------------- directories

    def listdir(self, path: str) -> list[str]:
        self.before("readdir", path)
        return self.listed(path, os.listdir(self.where(path)))

    def mkdir(self, path: str, exist_ok: bool = False) -> None:
        self.before("mkdir", path)
        try:
            os.mkdir(self.where(path), 0o700)
        except FileExistsError:
            if not exist_ok:
                raise

    def makedirs(self, path: str) -> None:
        """mkdir of each missing level (counted one mkdir per level tried)."""
        parent = os.path.dirname(path)
        if parent and parent != path and not self.exists(parent):
            self.makedirs(parent)
        self.mkdir(path, exist_ok=True)

    def rmtree(self, path: str) -> None:
        """Remove a tree, ignoring what is already gone (another node may be removing it too)."""
        try:
            names = self.listdir(path)
        except FileNotFoundError:
            return
        except NotADirectoryError:
            self.unlink(path, missing_ok=True)
            return
        for name in names:
            child = os.path.join(path, name)
            if self.is_dir(child):
                self.rmtree(child)
            else:
                self.unlink(child, missing_ok=True)
        self.before("rmdir", path)
        try:
            os.rmdir(self.where(path))
        except (FileNotFoundError, OSError) as exc:
            if not isinstance(exc, FileNotFoundError) and exc.errno != errno.ENOTEMPTY:
                raise

    def fsync_dir(self, path: str) -> None:
        self.before("open", path)
        fd = os.open(self.where(path), os.O_RDONLY | os.O_DIRECTORY)
        try:
            self.before("fsync", path)
            os.fsync(fd)
        finally:
            self.before("close", path)
            os.close(fd)

    # ----------------------------------------------------------------- metadata

    def stat(self, path: str) -> os.stat_result:
        self.before("stat", path)
        return os.stat(self.where(path))

    def exists(self, path: str) -> bool:
        try:
            self.stat(path)
        except FileNotFoundError:
            return False
        return True

    def is_dir(self, path: str) -> bool:
        try:
            return stat.S_ISDIR(self.stat(path).st_mode)
        except FileNotFoundError:
            return False

    def unlink(self, path: str, missing_ok: bool = False) -> None:
        self.before("unlink", path)
        try:
            os.unlink(self.where(path))
        except FileNotFoundError:
            if not missing_ok:
                raise

    def rename(self, source: str, target: str) -> None:
        """POSIX rename: atomic, replaces a file, fails on a non-empty directory."""
        self.before("rename", source)
        os.rename(self.where(source), self.where(target))

    # ----------------------------------------------------------------- files

    def read_bytes(self, path: str, limit: int = 1 << 20) -> bytes:
        """A small file whole (at most `limit` bytes)."""
        fd = self.open_read(path)
        try:
            return self.pread(fd, path, limit, 0)
        finally:
            self.close(fd, path)

    def read_whole(self, path: str, block: int = 64 * 1024) -> bytes:
        """A file whole, however large: reads of `block` bytes until one comes back short."""
        fd = self.open_read(path)
        try:
            parts, offset = [], 0
            while True:
                data = self.pread(fd, path, block, offset)
                parts.append(data)
                offset += len(data)
                if len(data) < block:
                    return b"".join(parts)
        finally:
            self.close(fd, path)

    def open_read(self, path: str) -> int:
        self.before("open", path)
        return os.open(self.where(path), os.O_RDONLY)

    def pread(self, fd: int, path: str, size: int, offset: int) -> bytes:
        self.before("read", path)
        return os.pread(fd, size, offset)

    def close(self, fd: int, path: str) -> None:
        self.before("close", path)
        os.close(fd)

    def open_write(self, path: str, exclusive: bool) -> int:
        """Create (O_EXCL when `exclusive`: FileExistsError if the name is taken) or truncate."""
        self.before("open", path)
        return os.open(self.where(path), os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC), 0o600)

    def write_all(self, fd: int, path: str, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        pos = 0
        while pos < len(view):
            self.before("write", path)
            pos += os.write(fd, view[pos : pos + WRITE_BLOCK])

    def fsync(self, fd: int, path: str) -> None:
        self.before("fsync", path)
        os.fsync(fd)

    def write_file(self, path: str, data: bytes | memoryview, exclusive: bool, fsync: bool) -> None:
        """Create `path`, write `data`, fsync, close: done only when close() succeeded.

        `exclusive` makes the create an O_EXCL one, the store's compare-and-set. On a
        failure the partial file is removed.
        """
        fd = self.open_write(path, exclusive)
        try:
            self.write_all(fd, path, data)
            if fsync:
                self.fsync(fd, path)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(self.where(path))
            except OSError:
                pass
            raise
        self.close(fd, path)

    def replace_file(self, path: str, data: bytes, fsync: bool) -> None:
        """Replace a small file atomically: a temporary beside it, then rename over it."""
        head, tail = os.path.split(path)
        tmp = os.path.join(head, f".tmp-{tail}-{os.getpid()}-{threading.get_ident()}")
        self.write_file(tmp, data, exclusive=False, fsync=fsync)
        try:
            self.rename(tmp, path)
        except BaseException:
            self.unlink(tmp, missing_ok=True)
            raise
        if fsync:
            self.fsync_dir(os.path.dirname(path))


__all__ = ["FileSystem"]
