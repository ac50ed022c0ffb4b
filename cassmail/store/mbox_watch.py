"""Which mailboxes of the mbox store changed, from Linux inotify (Store.changed_mailboxes).

Every change of a mailbox writes into its directory (the index log, a checkpoint renamed into
place, the mbox), in whichever process makes it, so one inotify watch per watched mailbox
directory tells a worker of any change at the cost of one read of the inotify descriptor per
poll, however many mailboxes are watched and whatever their size. Where inotify cannot be had
(another system, the per-user watch limit reached) the store falls back on comparing changes
tokens (Store.changed_mailboxes' default).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import struct
from pathlib import Path

log = logging.getLogger(__name__)

IN_MODIFY, IN_ATTRIB, IN_MOVED_FROM, IN_MOVED_TO = 0x2, 0x4, 0x40, 0x80
IN_CREATE, IN_DELETE, IN_DELETE_SELF, IN_MOVE_SELF, IN_Q_OVERFLOW, IN_IGNORED = 0x100, 0x200, 0x400, 0x800, 0x4000, 0x8000
IN_ONLYDIR, IN_NONBLOCK, IN_CLOEXEC = 0x01000000, 0o4000, 0o2000000
#: Not IN_CLOSE_WRITE: a write fires IN_MODIFY already, and the store closes mailbox files it
#: opened for writing without writing to them (its open-file cache evicting one), which is no change.
_MASK = (IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
         | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR)
_EVENT = struct.Struct("iIII")


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6", use_errno=True)
        libc.inotify_init1  # noqa: B018 - present on Linux only
    except (OSError, AttributeError):
        return None
    return libc


class DirectoryWatch:
    """Directories watched through one inotify descriptor; `changed()` says which of them had
    anything written in them since the last call."""

    def __init__(self) -> None:
        self._libc = _libc()
        self.fd = -1
        if self._libc is not None:
            self.fd = self._libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        self._by_wd: dict[int, Path] = {}
        self._by_path: dict[Path, int] = {}

    @property
    def available(self) -> bool:
        return self.fd >= 0

    def watch(self, directory: Path) -> bool:
        """Watch a directory (again, if it was replaced); False when it cannot be watched."""
        if directory in self._by_path:
            return True
        assert self._libc is not None
        wd = self._libc.inotify_add_watch(self.fd, os.fsencode(directory), _MASK)
        if wd < 0:
            err = ctypes.get_errno()
            if err not in (errno.ENOENT, errno.ENOTDIR):
                log.info("cannot watch %s: %s", directory, os.strerror(err))
            return False
        self._by_wd[wd] = directory
        self._by_path[directory] = wd
        return True

    def unwatch(self, directory: Path) -> None:
        wd = self._by_path.pop(directory, None)
        if wd is not None:
            self._by_wd.pop(wd, None)
            assert self._libc is not None
            self._libc.inotify_rm_watch(self.fd, wd)

    def watched(self) -> set[Path]:
        return set(self._by_path)

    def changed(self) -> tuple[set[Path], bool]:
        """Directories written in since the last call, and whether events were lost (the queue
        overflowed: then anything may have changed)."""
        out: set[Path] = set()
        overflow = False
        while True:
            try:
                data = os.read(self.fd, 64 * 1024)
            except BlockingIOError:
                break
            if not data:
                break
            offset = 0
            while offset + _EVENT.size <= len(data):
                wd, mask, _, length = _EVENT.unpack_from(data, offset)
                offset += _EVENT.size + length
                if mask & IN_Q_OVERFLOW:
                    overflow = True
                    continue
                directory = self._by_wd.get(wd)
                if directory is None:
                    continue
                out.add(directory)
                if mask & (IN_IGNORED | IN_DELETE_SELF | IN_MOVE_SELF):
                    # the directory is gone (mailbox deleted or renamed): watch it afresh next time
                    self._by_wd.pop(wd, None)
                    self._by_path.pop(directory, None)
        return out, overflow

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
