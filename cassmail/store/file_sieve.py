"""Sieve scripts and vacation records of the file-based stores (mbox, WheelFS), beside the user's
account in the user's own directory, so deleting the user removes them::

    sieve/scripts/<name>    a script, UTF-8 (names encoded by base.encode_name)
    sieve/scripts/%23<hash> a script whose encoded name is too long for a file name (RFC 5804
                            allows 128 characters: up to 512 bytes of UTF-8), its name in the
                            file beside it, `%23<hash>.name` (encode_name never makes `%23`)
    sieve/active            the active script's name; absent when none is
    sieve/vacation/<key>    a vacation reply sent: the time (seconds since 1970) until which
                            the same reply is not sent again

Every file is replaced atomically (write, fsync, rename); a vacation record is first created
with O_EXCL, so two nodes answering the same sender at once send one reply.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable

from cassmail.store.base import (
    NoSuchSieveScript,
    NoSuchUser,
    SieveScriptActive,
    SieveScriptExists,
    SieveScriptInfo,
    check_sieve_content,
    check_sieve_name,
    check_vacation_key,
    decode_name,
    encode_name,
)
from cassmail.store.wheelfs_fs import FileSystem

#: Expired vacation records are swept when a user has more than this many.
VACATION_SWEEP = 512
#: Encoded names longer than this (bytes of UTF-8) are kept under their hash: file systems stop at 255.
MAX_FILE_NAME = 200
_HASHED = "%23"
_NAME_SUFFIX = ".name"


def _file(name: str) -> str:
    """The file name of a script."""
    encoded = encode_name(name)
    if len(encoded.encode("utf-8")) <= MAX_FILE_NAME:
        return encoded
    return _HASHED + hashlib.sha256(name.encode("utf-8")).hexdigest()


class FileSieve:
    def __init__(self, fs: FileSystem, fsync: bool, user_dir: Callable[[str], str]) -> None:
        """`user_dir(key)` is the user's directory, or NoSuchUser."""
        self.fs, self.fsync, self.user_dir = fs, fsync, user_dir

    def _dirs(self, key: str) -> tuple[str, str]:
        base = os.path.join(self.user_dir(key), "sieve")
        scripts = os.path.join(base, "scripts")
        if not self.fs.exists(scripts):
            self.fs.makedirs(scripts)
        return base, scripts

    def _active(self, base: str) -> str | None:
        try:
            return self.fs.read_bytes(os.path.join(base, "active")).decode("utf-8") or None
        except FileNotFoundError:
            return None

    def _name_beside(self, scripts: str, file: str, name: str) -> None:
        """The name of a hashed script, written before the script so a listing never meets a
        script without its name."""
        if file.startswith(_HASHED):
            self.fs.replace_file(os.path.join(scripts, file + _NAME_SUFFIX), name.encode("utf-8"), self.fsync)

    def _unlink(self, scripts: str, file: str, missing_ok: bool = False) -> None:
        self.fs.unlink(os.path.join(scripts, file), missing_ok=missing_ok)
        if file.startswith(_HASHED):
            self.fs.unlink(os.path.join(scripts, file + _NAME_SUFFIX), missing_ok=True)

    def put(self, key: str, name: str, content: str) -> None:
        name, content = check_sieve_name(name), check_sieve_content(content)
        _, scripts = self._dirs(key)
        file = _file(name)
        self._name_beside(scripts, file, name)
        self.fs.replace_file(os.path.join(scripts, file), content.encode("utf-8"), self.fsync)

    def get(self, key: str, name: str) -> str:
        name = check_sieve_name(name)
        _, scripts = self._dirs(key)
        try:
            return self.fs.read_bytes(os.path.join(scripts, _file(name)), 2 << 20).decode("utf-8")
        except FileNotFoundError:
            raise NoSuchSieveScript(key, name) from None

    def list(self, key: str) -> list[SieveScriptInfo]:
        base, scripts = self._dirs(key)
        active = self._active(base)
        names = []
        for file in self.fs.listdir(scripts):
            if file.startswith("."):
                continue
            if not file.startswith(_HASHED):
                names.append(decode_name(file))
            elif not file.endswith(_NAME_SUFFIX):
                try:
                    names.append(self.fs.read_bytes(os.path.join(scripts, file + _NAME_SUFFIX)).decode("utf-8"))
                except FileNotFoundError:
                    continue  # not left so: its name is written before the script and removed after it
        return [SieveScriptInfo(n, n == active) for n in sorted(names)]

    def set_active(self, key: str, name: str | None) -> None:
        base, scripts = self._dirs(key)
        if name is None:
            self.fs.unlink(os.path.join(base, "active"), missing_ok=True)
            return
        name = check_sieve_name(name)
        if not self.fs.exists(os.path.join(scripts, _file(name))):
            raise NoSuchSieveScript(key, name)
        self.fs.replace_file(os.path.join(base, "active"), name.encode("utf-8"), self.fsync)

    def delete(self, key: str, name: str) -> None:
        name = check_sieve_name(name)
        base, scripts = self._dirs(key)
        if self._active(base) == name:
            raise SieveScriptActive(key, name)
        try:
            self._unlink(scripts, _file(name))
        except FileNotFoundError:
            raise NoSuchSieveScript(key, name) from None

    def rename(self, key: str, old: str, new: str) -> None:
        old, new = check_sieve_name(old), check_sieve_name(new)
        base, scripts = self._dirs(key)
        content = self.get(key, old)
        if old == new:
            raise SieveScriptExists(key, new)
        file = _file(new)
        if self.fs.exists(os.path.join(scripts, file)):
            raise SieveScriptExists(key, new)
        self._name_beside(scripts, file, new)
        try:
            self.fs.write_file(os.path.join(scripts, file), content.encode("utf-8"), True, self.fsync)
        except FileExistsError:
            raise SieveScriptExists(key, new) from None
        if self._active(base) == old:
            self.fs.replace_file(os.path.join(base, "active"), new.encode("utf-8"), self.fsync)
        self._unlink(scripts, _file(old), missing_ok=True)

    def active_script(self, key: str) -> tuple[str, str] | None:
        try:
            base, _ = self._dirs(key)
        except NoSuchUser:  # a user that does not exist has no script
            return None
        name = self._active(base)
        if name is None:
            return None
        try:
            return name, self.get(key, name)
        except NoSuchSieveScript:
            return None

    def note_vacation(self, key: str, vacation_key: str, seconds: float) -> bool:
        vacation_key, seconds = check_vacation_key(vacation_key, seconds)
        base, _ = self._dirs(key)
        directory = os.path.join(base, "vacation")
        if not self.fs.exists(directory):
            self.fs.makedirs(directory)
        path = os.path.join(directory, vacation_key)
        now = time.time()
        until = f"{now + seconds:.3f}".encode()
        try:
            self.fs.write_file(path, until, True, self.fsync)
        except FileExistsError:
            try:
                previous = float(self.fs.read_bytes(path, 64).decode("ascii"))
            except FileNotFoundError:
                return self.note_vacation(key, vacation_key, seconds)  # it expired and went away meanwhile
            except (ValueError, UnicodeDecodeError):
                return False  # being written by whoever created it a moment ago: theirs is the reply
            if previous > now:
                return False
            # Expired: take it over by moving it away, then create it afresh (one creator wins).
            grave = os.path.join(directory, f".old-{vacation_key}-{os.getpid()}-{time.monotonic_ns()}")
            try:
                self.fs.rename(path, grave)
            except FileNotFoundError:
                pass
            else:
                self.fs.unlink(grave, missing_ok=True)
            try:
                self.fs.write_file(path, until, True, self.fsync)
            except FileExistsError:
                return False
            return True
        self._sweep(directory, now)
        return True

    def _sweep(self, directory: str, now: float) -> None:
        names = self.fs.listdir(directory)
        if len(names) <= VACATION_SWEEP:
            return
        for name in names:
            if name.startswith("."):
                continue
            path = os.path.join(directory, name)
            try:
                if float(self.fs.read_bytes(path, 64).decode("ascii") or 0) <= now:
                    self.fs.unlink(path, missing_ok=True)
            except (FileNotFoundError, ValueError, UnicodeDecodeError):
                continue
