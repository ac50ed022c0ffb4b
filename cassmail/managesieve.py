"""ManageSieve (RFC 5804): where mail clients (Thunderbird's and Roundcube's filter editors, sieve-connect)
list, upload, check and activate their Sieve scripts.

One asyncio server per worker on `[managesieve] listen`. Passwords are checked by the same
`auth.Logins` as IMAP and POP3 (SASL PLAIN, throttled per peer and user), only over TLS
(STARTTLS) unless the listener allows plain text. Scripts go to the store, so every node runs
what a user uploaded to any of them; PUTSCRIPT and CHECKSCRIPT compile the script with the
interpreter that runs it at delivery. Every client error is a `NO` (or `BYE` when the session
cannot go on), never a traceback.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from typing import Any

from cassmail import auth
from cassmail.config import ManageSieveSettings, Settings, SieveSettings, host_port
from cassmail.logs import kv
from cassmail.sessions import Sessions
from cassmail.model import InvalidInput
from cassmail.sieve.delivery import limits_of
from cassmail.sieve.script import EXTENSIONS, Limits, check
from cassmail.store.base import (
    NoSuchSieveScript,
    NoSuchUser,
    SieveScriptActive,
    SieveScriptExists,
    Store,
    StoreError,
    check_sieve_name,
)
from cassmail.tls import server_context

log = logging.getLogger("cassmail.managesieve")

#: Arguments a command may have (RENAMESCRIPT has the most: two).
MAX_ARGUMENTS = 4
#: Bytes of a literal too large to keep that are read and dropped before answering NO; a
#: larger one ends the session (the client would be sending it for a long time).
MAX_DISCARD = 16 << 20


class ProtocolError(Exception):
    """A line that is not a ManageSieve command; the session answers NO and goes on."""


class Fatal(Exception):
    """The session cannot go on (a literal too large to skip, a line past the limit that cannot
    be resynchronised): answer BYE and close."""


class _TooLarge:
    """Stands for a literal that was read and dropped: larger than any script may be."""

    def __init__(self, size: int) -> None:
        self.size = size


Arg = str | int | _TooLarge


class Listener(Sessions):
    """Shared by every session of one listener in one worker."""

    def __init__(self, store: Store, settings: ManageSieveSettings, sieve: SieveSettings) -> None:
        self.store, self.settings, self.sieve = store, settings, sieve
        self.limits: Limits = limits_of(sieve)
        self.tls = server_context(settings)
        self.logins = auth.Logins("managesieve", settings)
        Sessions.__init__(self, settings.max_connections)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        session = Session(self, reader, writer)
        if not self.opened(session):
            self.closed(session)
            writer.write(b'BYE (TRYLATER) "Too many connections, try again later"\r\n')
            await _close(writer)
            return
        try:
            await session.run()
        finally:
            self.closed(session)
            log.info(kv("session", listener="managesieve", peer=session.peer, user=session.user, tls=session.secure,
                        commands=session.commands, ms=int((time.monotonic() - session.opened_at) * 1000)))


class Session:
    def __init__(self, listener: Listener, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.listener, self.reader, self.writer = listener, reader, writer
        self.store = listener.store
        peer = writer.get_extra_info("peername")
        self.peer = peer[0] if isinstance(peer, tuple) else str(peer)
        self.secure = writer.get_extra_info("ssl_object") is not None
        self.user: str | None = None
        self.failures = listener.logins.failures()
        self.commands = 0
        self.opened_at = time.monotonic()

    @property
    def transport(self) -> Any:
        """For a stopping worker, which cuts sessions still open after its grace period."""
        return self.writer.transport

    # ----------------------------------------------------------------- output
    def capabilities(self) -> list[str]:
        can_login = self.listener.logins.plaintext_ok(self.secure)
        lines = [
            '"IMPLEMENTATION" "cassmail"',
            f'"SASL" "{"PLAIN" if can_login and self.user is None else ""}"',
            f'"SIEVE" "{" ".join(EXTENSIONS)}"',
            f'"MAXREDIRECTS" "{self.listener.sieve.max_redirects}"',
            '"VERSION" "1.0"',
        ]
        if self.listener.tls is not None and not self.secure:
            lines.append('"STARTTLS"')
        if self.user is not None:
            lines.append('"OWNER" ' + _quoted(self.user))
        lines.append('"UNAUTHENTICATE"')
        return lines

    async def send(self, *lines: str | bytes) -> None:
        data = b"".join((line.encode("utf-8") if isinstance(line, str) else line) + b"\r\n" for line in lines)
        self.writer.write(data)
        await self.writer.drain()

    async def reply(self, status: str, text: str = "", code: str = "") -> None:
        parts = [status]
        if code:
            parts.append(f"({code})")
        if text:
            parts.append(_quoted(text))
        await self.send(" ".join(parts))

    # ----------------------------------------------------------------- input
    async def readline(self) -> bytes:
        limit = self.listener.settings.max_line_length
        try:
            line = await asyncio.wait_for(self.reader.readuntil(b"\n"), self.listener.settings.timeout)
        except asyncio.LimitOverrunError as exc:
            raise Fatal("Line too long") from exc
        except asyncio.IncompleteReadError as exc:
            raise ConnectionResetError("client went away") from exc
        if len(line) > limit:
            raise ProtocolError(f"Line longer than {limit} bytes")
        return line[:-1].rstrip(b"\r")

    async def read_command(self) -> tuple[str, list[Arg]]:
        """One command with its arguments; literals may continue it on further lines."""
        line = await self.readline()
        args: list[Arg] = []
        pos = 0
        name = ""
        while True:
            while pos < len(line) and line[pos:pos + 1] == b" ":
                pos += 1
            if pos >= len(line):
                break
            ch = line[pos:pos + 1]
            if not name:
                end = line.find(b" ", pos)
                end = len(line) if end < 0 else end
                word = line[pos:end]
                if not word.isalpha():
                    raise ProtocolError("Expected a command name")
                name = word.decode("ascii").upper()
                pos = end
            elif ch == b'"':
                value, pos = _read_quoted(line, pos)
                args.append(value)
            elif ch == b"{":
                close = line.find(b"}", pos)
                if close < 0 or close != len(line) - 1:
                    raise ProtocolError("A literal's {size} ends its line")
                args.append(await self.read_literal(_literal_size(line[pos + 1:close])))
                line, pos = await self.readline(), 0
            elif ch.isdigit():
                end = line.find(b" ", pos)
                end = len(line) if end < 0 else end
                word = line[pos:end]
                if not word.isdigit() or len(word) > 12:
                    raise ProtocolError("Bad number")
                args.append(int(word))
                pos = end
            else:
                raise ProtocolError("Expected a string or a number")
            if len(args) > MAX_ARGUMENTS:
                raise ProtocolError("Too many arguments")
        if not name:
            raise ProtocolError("Empty command")
        return name, args

    async def read_literal(self, size: int) -> Arg:
        limit = self.listener.limits.max_script_size
        timeout = self.listener.settings.timeout
        try:
            if size <= limit:
                data = await asyncio.wait_for(self.reader.readexactly(size), timeout)
                try:
                    return data.decode("utf-8")
                except UnicodeDecodeError:
                    raise ProtocolError("Strings are UTF-8") from None
            if size > MAX_DISCARD:
                raise Fatal(f"Literal of {size} bytes is too large")
            left = size
            while left:
                chunk = await asyncio.wait_for(self.reader.read(min(left, 65536)), timeout)
                if not chunk:
                    raise ConnectionResetError("client went away")
                left -= len(chunk)
            return _TooLarge(size)
        except asyncio.IncompleteReadError as exc:
            raise ConnectionResetError("client went away") from exc

    # ----------------------------------------------------------------- the session
    async def run(self) -> None:
        try:
            await self.send(*self.capabilities(), 'OK "cassmail ManageSieve ready"')
            while True:
                try:
                    name, args = await self.read_command()
                except ProtocolError as exc:
                    self.commands += 1
                    await self.reply("NO", str(exc))
                    continue
                self.commands += 1
                if not await self.dispatch(name, args):
                    return
        except Fatal as exc:
            await self._bye(str(exc))
        except asyncio.TimeoutError:
            await self._bye("Idle for too long", "")
        except (ConnectionError, ssl.SSLError, OSError):
            pass
        except Exception as exc:  # a bug must reach the log, not the client: end the session cleanly
            log.error(kv("session-error", listener="managesieve", error=type(exc).__name__), exc_info=exc)
            await self._bye("Internal error, try again later", "TRYLATER")
        finally:
            await _close(self.writer)

    async def _bye(self, text: str, code: str = "") -> None:
        try:
            await self.reply("BYE", text, code)
        except (ConnectionError, OSError):
            pass

    async def dispatch(self, name: str, args: list[Arg]) -> bool:
        """Run one command; False when the session ends."""
        handler = _COMMANDS.get(name)
        if handler is None:
            await self.reply("NO", f"Unknown command {name[:40]}")
            return True
        wanted, needs_user = handler[1], handler[2]
        if needs_user and self.user is None:
            await self.reply("NO", "Authenticate first")
            return True
        if not needs_user and self.user is not None and name in ("AUTHENTICATE", "STARTTLS"):
            await self.reply("NO", "Already authenticated")
            return True
        if isinstance(wanted, tuple):
            low, high = wanted
        else:
            low = high = wanted
        if not low <= len(args) <= high:
            await self.reply("NO", f"{name} takes {low}{'' if low == high else f'..{high}'} argument(s)")
            return True
        try:
            return await handler[0](self, args)
        except ProtocolError as exc:  # a bad SASL response line
            await self.reply("NO", str(exc))
            return True
        except StoreError as exc:
            log.warning(kv("managesieve", user=self.user, command=name, result="tempfail", error=exc))
            await self.reply("NO", "Storage is temporarily unavailable, try again later", "TRYLATER")
            return True

    # ----------------------------------------------------------------- commands
    async def cmd_capability(self, args: list[Arg]) -> bool:
        await self.send(*self.capabilities(), "OK")
        return True

    async def cmd_noop(self, args: list[Arg]) -> bool:
        if args:
            if not isinstance(args[0], str):
                await self.reply("NO", "NOOP takes a string")
                return True
            await self.reply("OK", "Done", "TAG " + _quoted(args[0]))
        else:
            await self.reply("OK", "Done")
        return True

    async def cmd_logout(self, args: list[Arg]) -> bool:
        await self.reply("OK", "Logout completed")
        return False

    async def cmd_starttls(self, args: list[Arg]) -> bool:
        if self.listener.tls is None or self.secure:
            await self.reply("NO", "STARTTLS is not available" if self.listener.tls is None else "TLS is already on")
            return True
        await self.reply("OK", "Begin TLS negotiation now")
        # What came behind STARTTLS came in clear text (asyncio keeps it in the reader's buffer,
        # as the SMTP engine's borrowing in smtp/protocol.py notes): never run it as if over TLS.
        auth.drop_clear_text(self.reader._buffer, "managesieve", self.peer)  # type: ignore[attr-defined]
        try:
            await asyncio.wait_for(self.writer.start_tls(self.listener.tls), self.listener.settings.timeout)
        except (ssl.SSLError, asyncio.TimeoutError, ConnectionError, OSError) as exc:
            log.info(kv("managesieve", peer=self.peer, command="STARTTLS", result="fail", error=type(exc).__name__))
            return False
        self.secure = True
        await self.send(*self.capabilities(), "OK")  # RFC 5804 2.2: capabilities again after TLS
        return True

    async def cmd_authenticate(self, args: list[Arg]) -> bool:
        mechanism = args[0]
        if not isinstance(mechanism, str) or mechanism.upper() != "PLAIN":
            await self.reply("NO", "Only the PLAIN mechanism is offered")
            return True
        if not self.listener.logins.plaintext_ok(self.secure):
            await self.reply("NO", "Use STARTTLS before authenticating", "ENCRYPT-NEEDED")
            return True
        if len(args) > 1:
            response = args[1]
        else:
            await self.send('""')  # the empty challenge: the client sends its response as a string
            line = await self.readline()
            response = await self._string_line(line)
        if not isinstance(response, str):
            await self.reply("NO", "Bad SASL response")
            return True
        if response == "*":
            await self.reply("NO", "Authentication cancelled")
            return True
        decoded = auth.decode_plain(response.encode("ascii", "replace"))
        user = None
        if decoded is not None:
            login, password = decoded
            try:
                user = await self.listener.logins.check(self.store, self.peer, login, password)
            except StoreError:
                await self.reply("NO", "Temporary authentication failure", "TRYLATER")
                return True
        if user is None:
            if self.failures.add():
                await self.reply("BYE", "Too many failed authentications")
                return False
            await self.reply("NO", "Authentication failed")
            return True
        self.user = user
        await self.reply("OK", "Authenticated")
        return True

    async def _string_line(self, line: bytes) -> Arg:
        """A SASL response line: a quoted string or a literal (whose content may follow)."""
        if line.startswith(b"{") and line.endswith(b"}"):
            value = await self.read_literal(_literal_size(line[1:-1]))
            await self.readline()
            return value
        if line.startswith(b'"'):
            value, pos = _read_quoted(line, 0)
            return value if pos == len(line) else _TooLarge(0)
        return _TooLarge(0)

    async def cmd_unauthenticate(self, args: list[Arg]) -> bool:
        self.user = None
        await self.reply("OK", "Unauthenticated")
        return True

    def _name(self, arg: Arg) -> str:
        if not isinstance(arg, str):
            raise InvalidInput("A script name is a string")
        return check_sieve_name(arg)

    async def cmd_havespace(self, args: list[Arg]) -> bool:
        try:
            name = self._name(args[0])
        except InvalidInput as exc:
            await self.reply("NO", str(exc))
            return True
        size = args[1]
        if not isinstance(size, int):
            await self.reply("NO", "HAVESPACE takes a name and a size")
            return True
        quota = await self._quota(name, size)
        if quota:
            await self.reply("NO", quota[1], quota[0])
        else:
            await self.reply("OK", "Putscript would succeed")
        return True

    async def _quota(self, name: str, size: int) -> tuple[str, str] | None:
        assert self.user is not None
        if size > self.listener.limits.max_script_size:
            return "QUOTA/MAXSIZE", f"Scripts are at most {self.listener.limits.max_script_size} bytes"
        names = [s.name for s in await self.store.list_sieve_scripts(self.user)]
        if name not in names and len(names) >= self.listener.sieve.max_scripts:
            return "QUOTA/MAXSCRIPTS", f"At most {self.listener.sieve.max_scripts} scripts"
        return None

    async def cmd_putscript(self, args: list[Arg]) -> bool:
        assert self.user is not None
        try:
            name = self._name(args[0])
        except InvalidInput as exc:
            await self.reply("NO", str(exc))
            return True
        content = args[1]
        if isinstance(content, _TooLarge):
            await self.reply("NO", f"Scripts are at most {self.listener.limits.max_script_size} bytes", "QUOTA/MAXSIZE")
            return True
        if not isinstance(content, str):
            await self.reply("NO", "PUTSCRIPT takes a name and a script")
            return True
        quota = await self._quota(name, len(content.encode("utf-8")))
        if quota:
            await self.reply("NO", quota[1], quota[0])
            return True
        error = check(content, self.listener.limits)
        if error is not None:
            await self.reply("NO", error)
            return True
        await self.store.put_sieve_script(self.user, name, content)
        log.info(kv("managesieve", user=self.user, command="PUTSCRIPT", script=name, result="ok"))
        await self.reply("OK", "Script stored")
        return True

    async def cmd_checkscript(self, args: list[Arg]) -> bool:
        content = args[0]
        if isinstance(content, _TooLarge):
            await self.reply("NO", f"Scripts are at most {self.listener.limits.max_script_size} bytes", "QUOTA/MAXSIZE")
            return True
        if not isinstance(content, str):
            await self.reply("NO", "CHECKSCRIPT takes a script")
            return True
        error = check(content, self.listener.limits)
        await (self.reply("NO", error) if error is not None else self.reply("OK", "Script is valid"))
        return True

    async def cmd_listscripts(self, args: list[Arg]) -> bool:
        assert self.user is not None
        scripts = await self.store.list_sieve_scripts(self.user)
        await self.send(*[_string(s.name) + (" ACTIVE" if s.active else "") for s in scripts], "OK")
        return True

    async def cmd_setactive(self, args: list[Arg]) -> bool:
        assert self.user is not None
        if args[0] == "":
            await self.store.set_active_sieve_script(self.user, None)
            await self.reply("OK", "No script is active")
            return True
        return await self._named(args[0], "SETACTIVE", lambda n: self.store.set_active_sieve_script(self.user, n),
                                 "Script activated")

    async def cmd_getscript(self, args: list[Arg]) -> bool:
        assert self.user is not None
        try:
            name = self._name(args[0])
            content = await self.store.get_sieve_script(self.user, name)
        except InvalidInput as exc:
            await self.reply("NO", str(exc))
            return True
        except NoSuchSieveScript:
            await self.reply("NO", "There is no script by that name", "NONEXISTENT")
            return True
        data = content.encode("utf-8")
        await self.send(f"{{{len(data)}}}".encode() + b"\r\n" + data, "OK")
        return True

    async def cmd_deletescript(self, args: list[Arg]) -> bool:
        assert self.user is not None
        return await self._named(args[0], "DELETESCRIPT", lambda n: self.store.delete_sieve_script(self.user, n),
                                 "Script deleted")

    async def cmd_renamescript(self, args: list[Arg]) -> bool:
        assert self.user is not None
        try:
            new = self._name(args[1])
        except InvalidInput as exc:
            await self.reply("NO", str(exc))
            return True
        return await self._named(args[0], "RENAMESCRIPT", lambda n: self.store.rename_sieve_script(self.user, n, new),
                                 "Script renamed")

    async def _named(self, arg: Arg, command: str, call: Any, done: str) -> bool:
        try:
            await call(self._name(arg))
        except InvalidInput as exc:
            await self.reply("NO", str(exc))
        except NoSuchSieveScript:
            await self.reply("NO", "There is no script by that name", "NONEXISTENT")
        except SieveScriptActive:
            await self.reply("NO", "The active script cannot be deleted; deactivate it first", "ACTIVE")
        except SieveScriptExists:
            await self.reply("NO", "A script by the new name exists", "ALREADYEXISTS")
        except NoSuchUser:
            await self.reply("BYE", "The account is gone")
            return False
        else:
            log.info(kv("managesieve", user=self.user, command=command, result="ok"))
            await self.reply("OK", done)
        return True


#: Command -> (method, number of arguments or (least, most), needs a logged-in user).
_COMMANDS: dict[str, tuple[Any, int | tuple[int, int], bool]] = {
    "CAPABILITY": (Session.cmd_capability, 0, False),
    "NOOP": (Session.cmd_noop, (0, 1), False),
    "LOGOUT": (Session.cmd_logout, 0, False),
    "STARTTLS": (Session.cmd_starttls, 0, False),
    "AUTHENTICATE": (Session.cmd_authenticate, (1, 2), False),
    "UNAUTHENTICATE": (Session.cmd_unauthenticate, 0, True),
    "HAVESPACE": (Session.cmd_havespace, 2, True),
    "PUTSCRIPT": (Session.cmd_putscript, 2, True),
    "CHECKSCRIPT": (Session.cmd_checkscript, 1, True),
    "LISTSCRIPTS": (Session.cmd_listscripts, 0, True),
    "SETACTIVE": (Session.cmd_setactive, 1, True),
    "GETSCRIPT": (Session.cmd_getscript, 1, True),
    "DELETESCRIPT": (Session.cmd_deletescript, 1, True),
    "RENAMESCRIPT": (Session.cmd_renamescript, 2, True),
}


def _literal_size(spec: bytes) -> int:
    """A literal's size from between its braces: digits and at most one "+" (RFC 5804 4: `{n}`,
    or `{n+}` sent without waiting); `{5++}` is not a literal, so no bytes are read for it."""
    digits = spec[:-1] if spec.endswith(b"+") else spec
    if not digits.isdigit() or len(digits) > 10:
        raise ProtocolError("Bad literal size")
    return int(digits)


def _read_quoted(line: bytes, pos: int) -> tuple[str, int]:
    """A quoted string starting at line[pos] ('"'): its value and the position after it."""
    out = bytearray()
    i = pos + 1
    while i < len(line):
        c = line[i]
        if c == 0x5C:  # backslash: only \" and \\ are escapes
            if i + 1 >= len(line) or line[i + 1] not in (0x22, 0x5C):
                raise ProtocolError("Bad escape in a quoted string")
            out.append(line[i + 1])
            i += 2
            continue
        if c == 0x22:
            try:
                return out.decode("utf-8"), i + 1
            except UnicodeDecodeError:
                raise ProtocolError("Strings are UTF-8") from None
        out.append(c)
        i += 1
    raise ProtocolError("Unterminated quoted string")


def _quoted(text: str) -> str:
    text = text.replace("\r", " ").replace("\n", " ")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _string(text: str) -> str:
    """A string for the client: quoted when it is short and one line, else a literal."""
    if len(text.encode("utf-8")) <= 1024 and "\r" not in text and "\n" not in text:
        return _quoted(text)
    data = text.encode("utf-8")
    return f"{{{len(data)}}}\r\n{text}"


async def _close(writer: asyncio.StreamWriter) -> None:
    try:
        writer.close()
        await asyncio.wait_for(writer.wait_closed(), 5)
    except (ConnectionError, OSError, ssl.SSLError, asyncio.TimeoutError):
        pass


async def start(settings: Settings, store: Store) -> list[tuple[asyncio.AbstractServer, Listener]]:
    """(server, listener) of the ManageSieve listener when it is enabled."""
    listening = settings.managesieve
    if not listening.enabled:
        return []
    listener = Listener(store, listening, settings.sieve)
    host, port = host_port(listening.listen)
    server = await asyncio.start_server(listener.serve, host, port, reuse_port=True, backlog=1024,
                                        limit=max(listening.max_line_length, 1024) + 2)
    return [(server, listener)]


__all__ = ["Listener", "Session", "start"]
