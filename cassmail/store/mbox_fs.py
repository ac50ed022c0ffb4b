"""Operating-system primitives of the mbox store: locks, fallocate, extent maps, atomic files.

Kept apart from the store logic so that each primitive is small, named for
what it does, and testable alone. Everything here is Linux-specific where it
has to be (OFD locks, FALLOC_FL_COLLAPSE_RANGE, FIEMAP, EXT4_IOC_MOVE_EXT) and
says what happens elsewhere: callers ask `supports_*` and fall back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import json
import os
import random
import signal
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cassmail.processes import pid_alive

# --------------------------------------------------------------------------- fault injection

#: Fault injection for the crash tests: with CASSMAIL_MBOX_CRASH_AT=N the process kills itself
#: (SIGKILL, exactly what `kill -9` does) at the N-th crash point it passes. Unset, a crash point
#: costs one comparison. Crash points sit between the steps of delivery, flag updates, deletion,
#: compaction and index checkpoints, so a test can stop a writer at every one of them in turn.
_crash_countdown: int | None = int(os.environ["CASSMAIL_MBOX_CRASH_AT"]) if os.environ.get("CASSMAIL_MBOX_CRASH_AT") else None


def crash_point(label: str) -> None:
    """Die here if this is the crash point the environment asked for (see `_crash_countdown`)."""
    global _crash_countdown
    if _crash_countdown is None:
        return
    _crash_countdown -= 1
    if _crash_countdown <= 0:
        os.write(2, f"cassmail: crash point {label}\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)


def pwrite_all(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    """Write all of `data` at `offset` (pwrite may write less than asked).

    Every write is also a crash point of its own, where the process dies after writing only
    the first half: a process killed in the middle of a large write (the kernel may stop a
    write to a regular file between pages when a fatal signal arrives).
    """
    view = memoryview(data).cast("B")
    if _crash_countdown is not None and _crash_countdown <= 1 and len(view) > 1:
        os.pwrite(fd, view[: len(view) // 2], offset)
    crash_point("torn write")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def pread_exact(fd: int, length: int, offset: int) -> bytes:
    """Exactly `length` bytes at `offset`, or OSError(EIO) if the file is shorter."""
    out = bytearray()
    while len(out) < length:
        chunk = os.pread(fd, length - len(out), offset + len(out))
        if not chunk:
            raise OSError(errno.EIO, f"short read at {offset + len(out)} (wanted {length} bytes at {offset})")
        out += chunk
    return bytes(out)


def pread_cached(fd: int, length: int, offset: int) -> bytes | None:
    """Exactly `length` bytes at `offset` if the page cache holds them all (a read that cannot
    wait for the disk: RWF_NOWAIT), else None; OSError(EIO) if the file is shorter."""
    out = bytearray(length)
    got = 0
    view = memoryview(out)
    while got < length:
        try:
            n = os.preadv(fd, [view[got:]], offset + got, os.RWF_NOWAIT)
        except BlockingIOError:
            return None
        if not n:
            raise OSError(errno.EIO, f"short read at {offset + got} (wanted {length} bytes at {offset})")
        got += n
    return bytes(out)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename or a new file in `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike[str], data: bytes, durable: bool = True) -> None:
    """Replace a file so that readers see the old or the new content, never a mix or nothing.

    Write a temporary file beside it, fsync it, rename it over, fsync the directory.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{random.getrandbits(32):08x}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        pwrite_all(fd, data, 0)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def write_json(path: str | os.PathLike[str], value: Any, durable: bool = True) -> None:
    atomic_write(path, json.dumps(value, indent=1, sort_keys=True).encode() + b"\n", durable)


def read_json(path: str | os.PathLike[str]) -> Any:
    with open(path, "rb") as fh:
        return json.loads(fh.read())


# --------------------------------------------------------------------------- locks

# struct flock on Linux/x86_64 and aarch64: short l_type, short l_whence, off_t l_start, off_t l_len,
# pid_t l_pid (padded to 32 bytes). OFD locks need l_pid = 0.
_FLOCK = "hhxxxxqqixxxx"


class LockTimeout(OSError):
    """A lock could not be had in time (another process holds it)."""


def _ofd(fd: int, kind: int, blocking: bool) -> bool:
    cmd = fcntl.F_OFD_SETLKW if blocking else fcntl.F_OFD_SETLK
    try:
        fcntl.fcntl(fd, cmd, struct.pack(_FLOCK, kind, os.SEEK_SET, 0, 0, 0))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def lock_file(fd: int, exclusive: bool, timeout: float) -> None:
    """Take a whole-file open-file-description lock (shared or exclusive), waiting up to `timeout`.

    OFD locks (not classic POSIX locks) because they belong to the open file, not to the
    process: two sessions of one process exclude each other, and closing some other
    descriptor of the file does not drop them. They conflict with the classic fcntl locks
    mutt, procmail and Dovecot take, which is what makes them shared with other mbox tools.
    """
    kind = fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK
    if _ofd(fd, kind, blocking=False):
        return
    deadline = time.monotonic() + timeout
    pause = 0.0005
    while True:
        time.sleep(pause * random.uniform(0.5, 1.5))
        if _ofd(fd, kind, blocking=False):
            return
        if time.monotonic() > deadline:
            raise LockTimeout(errno.EAGAIN, f"lock held by another process for more than {timeout:g} s")
        pause = min(pause * 2, 0.02)


def try_lock_file(fd: int, exclusive: bool) -> bool:
    """`lock_file` without waiting: whether the lock was had."""
    return _ofd(fd, fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK, blocking=False)


def unlock_file(fd: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack(_FLOCK, fcntl.F_UNLCK, os.SEEK_SET, 0, 0, 0))


@contextmanager
def locked(fd: int, exclusive: bool, timeout: float) -> Iterator[None]:
    lock_file(fd, exclusive, timeout)
    try:
        yield
    finally:
        unlock_file(fd)


#: A dot-lock older than this whose owner we cannot check is taken to be stale (the convention of
#: liblockfile and procmail is a few minutes).
DOTLOCK_STALE = 300.0


def dotlock(path: str, timeout: float, source: str | None = None) -> None:
    """Create `path` (conventionally `<mbox>.lock`) exclusively, the lock older mbox tools know.

    Our own writers take it after the fcntl lock, so when one finds a dot-lock naming a
    process that no longer exists (a writer killed with -9), it breaks it.
    The lock is made whole before it appears: it is a hard link to a file that already holds
    the pid, so a writer killed at any moment leaves either no lock or one naming it (an empty
    lock of our own would otherwise wait out DOTLOCK_STALE). That file is `source` when given
    (`dotlock_source`: one per process, so a lock costs its touch, a link and an unlink), else
    one made for this lock beside it and removed after (also when `source` is on another file
    system). The touch gives the lock the age other tools judge it by (procmail breaks a lock
    whose file is older than its LOCKTIMEOUT).
    """
    if source is not None:
        try:
            os.utime(source)  # a lock's age is its file's: other tools break old ones
            _link_lock(source, path, timeout)
            return
        except OSError as exc:  # (gone meanwhile, or another file system: the private way)
            if exc.errno not in (errno.ENOENT, errno.EXDEV, errno.EPERM, errno.EMLINK):
                raise
            _forget_source(source)
    private = f"{path}.{os.getpid()}.{threading.get_ident()}"
    _write_pid(private)
    try:
        _link_lock(private, path, timeout)
    finally:
        with _ignore_missing():
            os.unlink(private)


def _link_lock(source: str, path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pause = 0.001
    while True:
        try:
            os.link(source, path)
            return
        except FileExistsError:
            if _dotlock_stale(path):
                with _ignore_missing():
                    os.unlink(path)
                continue
            if time.monotonic() > deadline:
                raise LockTimeout(errno.EAGAIN, f"{path} held for more than {timeout:g} s") from None
            time.sleep(pause)
            pause = min(pause * 2, 0.05)


def _write_pid(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, f"{os.getpid()}\n".encode())
    finally:
        os.close(fd)


#: (directory, pid) -> this process's dot-lock source file there (see dotlock_source)
_sources: dict[tuple[str, int], str] = {}
_sources_lock = threading.Lock()
#: The name of a process's dot-lock source file: this prefix and its pid.
SOURCE_PREFIX = ".dotlock."


def dotlock_source(directory: str) -> str:
    """This process's file in `directory` holding its pid, that its dot-locks on that file system
    are hard links to (made the first time it is asked for; a new one after a fork)."""
    key = (directory, os.getpid())
    with _sources_lock:
        found = _sources.get(key)
        if found is None:
            found = os.path.join(directory, f"{SOURCE_PREFIX}{key[1]}")
            _write_pid(found)
            _sources[key] = found
        return found


def _forget_source(source: str) -> None:
    with _sources_lock:
        for key, path in list(_sources.items()):
            if path == source:
                del _sources[key]


def remove_dotlock_sources(directory: str) -> None:
    """Remove the dot-lock source files in `directory` of processes that no longer run."""
    for name in os.listdir(directory):
        if not name.startswith(SOURCE_PREFIX):
            continue
        pid = name[len(SOURCE_PREFIX):]
        if pid.isdigit() and pid_alive(int(pid)):
            continue
        with _ignore_missing():
            os.unlink(os.path.join(directory, name))


def _dotlock_stale(path: str) -> bool:
    try:
        with open(path, "rb") as fh:
            text = fh.read(32).strip()
        age = time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return False
    if text.isdigit():
        pid = int(text)
        return pid != os.getpid() and not pid_alive(pid)
    return age > DOTLOCK_STALE


def dotunlock(path: str) -> None:
    with _ignore_missing():
        os.unlink(path)


@contextmanager
def _ignore_missing() -> Iterator[None]:
    try:
        yield
    except FileNotFoundError:
        pass


# --------------------------------------------------------------------------- fallocate

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_libc.fallocate.restype = ctypes.c_int

FALLOC_FL_COLLAPSE_RANGE = 0x08


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    if _libc.fallocate(fd, mode, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fallocate(mode={mode:#x}, {offset}, {length}): {os.strerror(err)}")


def collapse_range(fd: int, offset: int, length: int) -> None:
    """Remove [offset, offset+length) from the file, shifting the rest down: a metadata operation
    (extents are re-pointed, no data is copied). Both numbers must be multiples of the block size
    and the range must end before end of file."""
    fallocate(fd, FALLOC_FL_COLLAPSE_RANGE, offset, length)


def block_size(path: str | os.PathLike[str]) -> int:
    return os.statvfs(path).f_bsize


def supports_collapse(directory: str | os.PathLike[str]) -> bool:
    """Whether the file system under `directory` can collapse ranges (ext4 and XFS can)."""
    probe = Path(directory) / f".collapse-probe.{os.getpid()}.{random.getrandbits(32):08x}"
    bs = block_size(directory)
    fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        pwrite_all(fd, b"\0" * (3 * bs), 0)
        collapse_range(fd, bs, bs)
        return os.fstat(fd).st_size == 2 * bs
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


# --------------------------------------------------------------------------- extent maps (FIEMAP)

FS_IOC_FIEMAP = 0xC020660B
FIEMAP_FLAG_SYNC = 0x1
FIEMAP_EXTENT_LAST = 0x1
_FIEMAP_HEAD = "=QQIIII"  # fm_start fm_length fm_flags fm_mapped_extents fm_extent_count fm_reserved
_FIEMAP_EXTENT = "=QQQQQIIII"  # fe_logical fe_physical fe_length 2 x reserved64 fe_flags 3 x reserved
_HEAD_SIZE = struct.calcsize(_FIEMAP_HEAD)
_EXTENT_SIZE = struct.calcsize(_FIEMAP_EXTENT)


@dataclass(frozen=True, slots=True)
class Extent:
    logical: int
    physical: int
    length: int


def fiemap(fd: int, start: int = 0, length: int | None = None, sync: bool = True) -> list[Extent]:
    """The file's extents overlapping [start, start+length), physically contiguous ones merged
    (so the count is what `filefrag` calls extents: the places a sequential read must seek)."""
    if length is None:
        length = max(os.fstat(fd).st_size - start, 0)
    out: list[Extent] = []
    batch = 512
    pos, end = start, start + length
    flags = FIEMAP_FLAG_SYNC if sync else 0
    while pos < end:
        buf = bytearray(_HEAD_SIZE + batch * _EXTENT_SIZE)
        struct.pack_into(_FIEMAP_HEAD, buf, 0, pos, end - pos, flags, 0, batch, 0)
        fcntl.ioctl(fd, FS_IOC_FIEMAP, buf, True)
        mapped = struct.unpack_from(_FIEMAP_HEAD, buf, 0)[3]
        if mapped == 0:
            break
        last = False
        for i in range(mapped):
            logical, physical, ext_len, _, _, ext_flags, _, _, _ = struct.unpack_from(
                _FIEMAP_EXTENT, buf, _HEAD_SIZE + i * _EXTENT_SIZE
            )
            prev = out[-1] if out else None
            if prev and prev.logical + prev.length == logical and prev.physical + prev.length == physical:
                out[-1] = Extent(prev.logical, prev.physical, prev.length + ext_len)
            else:
                out.append(Extent(logical, physical, ext_len))
            pos = logical + ext_len
            last = bool(ext_flags & FIEMAP_EXTENT_LAST)
        if last:
            break
        flags = 0
    return out


# --------------------------------------------------------------------------- moving data (ext4)

#: _IOWR('f', 15, struct move_extent): struct move_extent { u32 reserved; u32 donor_fd;
#: u64 orig_start; u64 donor_start; u64 len; u64 moved_len; } (block units).
EXT4_IOC_MOVE_EXT = 0xC028660F
_MOVE_EXT = "=IIQQQQ"


def move_to_fresh_blocks(fd: int, directory: str | os.PathLike[str], offset: int, length: int, bs: int) -> int:
    """Give [offset, offset+length) of the file new, contiguous disk blocks; the data is unchanged.

    The range's data goes into blocks preallocated in a donor file and the file's old blocks go
    to the donor, which is then removed (what e4defrag does, one range at a time). The kernel
    swaps page by page under the inode lock, so a process killed in the middle leaves the file's
    content exactly as it was. Returns the number of extents the donor got (1 is the aim: the
    caller skips ranges the allocator could not give contiguous space for), or raises OSError
    where the file system cannot (EOPNOTSUPP / ENOTTY outside ext4).
    """
    donor_path = Path(directory) / f".defrag.{os.getpid()}.{random.getrandbits(32):08x}"
    donor = os.open(donor_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        donor_path.unlink()
        fallocate(donor, 0, offset, length)
        got = len(fiemap(donor, offset, length, sync=False))
        if got > 1:
            return got
        # The kernel refuses (EBUSY) to swap blocks under page-cache folios it cannot release
        # (large folios on recent kernels): write the range back and drop it from the cache first.
        os.fdatasync(fd)
        for attempt in range(3):
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
            buf = bytearray(struct.pack(_MOVE_EXT, 0, donor, offset // bs, offset // bs, length // bs, 0))
            try:
                fcntl.ioctl(fd, EXT4_IOC_MOVE_EXT, buf, True)
                return got
            except OSError as exc:
                if exc.errno != errno.EBUSY or attempt == 2:
                    raise
                moved = struct.unpack(_MOVE_EXT, buf)[5]
                offset, length = offset + moved * bs, length - moved * bs
        return got
    finally:
        os.close(donor)
