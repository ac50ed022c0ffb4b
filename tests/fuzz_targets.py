"""Coverage-guided fuzz targets (atheris, libFuzzer's engine) for every parser that sees bytes
from a client or from disk: SMTP command addresses and DATA, POP3 command lines, IMAP command
framing with literals and the command/search/fetch-spec grammar, MIME structure as FETCH
BODYSTRUCTURE/ENVELOPE/BODY[section] sees it, Sieve scripts and ManageSieve command lines, the
mbox store's index and mbox readers, and the configuration file.

A target takes one input and lets through only the exceptions its parser declares for bad
input (a syntax error, a refused value); anything else escaping is a crash, which libFuzzer
saves as a file (artifact) and reports. Seeds are in tests/fuzz_corpus/<target>/.

    python -m tests.fuzz_targets imap_command --seconds 600      # one target, ten minutes
    python -m tests.fuzz_targets all --seconds 60                # each target in turn
    python -m tests.fuzz_targets smtp_address --replay crash-…   # one input, with its traceback

tests/test_fuzz_targets.py runs each target for a few seconds in the suite.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

CORPUS = Path(__file__).resolve().parent / "fuzz_corpus"
TARGETS: dict[str, Callable[[bytes], None]] = {}
#: The modules whose coverage guides each target's fuzzing (instrumenting all of cassmail at
#: every start costs seconds).
INSTRUMENTED: dict[str, tuple[str, ...]] = {}


def target(*modules: str) -> Callable[[Callable[[bytes], None]], Callable[[bytes], None]]:
    def register(function: Callable[[bytes], None]) -> Callable[[bytes], None]:
        TARGETS[function.__name__] = function
        INSTRUMENTED[function.__name__] = modules
        return function

    return register


class _ErrorLog(logging.Handler):
    """An error logged by the code under test (a protocol's last-resort handler) is a crash too."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR:
            raise AssertionError(f"logged an error: {record.getMessage()}")


_loop: asyncio.AbstractEventLoop | None = None


def _run(coro: Any) -> Any:
    global _loop
    if _loop is None:
        _loop = asyncio.new_event_loop()
        asyncio.set_event_loop(_loop)
    return _loop.run_until_complete(coro)


# ----------------------------------------------------------------------------- SMTP


@target("cassmail.smtp.protocol", "cassmail.smtp.handler", "cassmail.model")
def smtp_address(data: bytes) -> None:
    """A MAIL/RCPT/VRFY argument as the engine parses it, then as the handler checks it."""
    from aiosmtpd.smtp import Envelope

    from cassmail.model import Address, InvalidInput
    from cassmail.smtp.handler import _path
    from cassmail.smtp.protocol import CassmailSMTP

    arg = data.decode("utf-8", "surrogateescape")
    address, rest = CassmailSMTP._getaddr(SimpleNamespace(local_part_limit=0), arg)  # type: ignore[arg-type]
    if address is None:
        return
    assert isinstance(rest, str)
    for utf8 in (False, True):
        envelope = Envelope()
        envelope.smtp_utf8 = utf8
        _path(address, envelope, "501 5.1.3 Bad recipient address syntax")
    try:
        parsed = Address.parse(address)
    except InvalidInput:
        return
    assert Address.parse(str(parsed)).key == parsed.key


class _Trickle(asyncio.StreamReader):
    """A StreamReader whose reads return at most `step` bytes (blocks cut anywhere)."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step

    async def read(self, n: int = -1) -> bytes:
        return await super().read(self.step if n < 0 else min(n, self.step))


@target("cassmail.smtp.protocol")
def smtp_data(data: bytes) -> None:
    """DATA's reader: any message, dot-stuffed as a client sends it and followed by the marker
    and a pipelined command, comes back as it was; the command stays in the reader. Read in one
    block into memory, and in blocks of 7 bytes through a spool file (cassmail.smtp.spool)."""
    from cassmail.smtp.protocol import read_data
    from cassmail.smtp.spool import SpoolPolicy

    body = data if not data or data.endswith(b"\r\n") else data + b"\r\n"
    stuffed = (b"\r\n" + body).replace(b"\r\n.", b"\r\n..")[2:]

    async def read(step: int, spool: SpoolPolicy | None) -> None:
        reader = _Trickle(step)
        reader.feed_data(stuffed + b".\r\nQUIT\r\n")
        reader.feed_eof()
        assert bytes(await read_data(reader, 1 << 20, spool=spool)) == body
        assert await reader.read() == b"QUIT\r\n"

    _run(read(1 << 20, None))
    _run(read(7, SpoolPolicy(above=1)))


@target("cassmail.smtp.protocol")
def smtp_reply(data: bytes) -> None:
    """Every reply line gets an enhanced code at most once, and stays one line."""
    from cassmail.smtp.protocol import with_enhanced_code

    line = data.decode("utf-8", "replace").replace("\r", "").replace("\n", "")
    once = with_enhanced_code(line)
    assert with_enhanced_code(once) == once


# ----------------------------------------------------------------------------- POP3


@target("cassmail.pop3.server")
def pop3_command(data: bytes) -> None:
    """Command lines cut from a byte stream and run before login (logins go to the socket
    fuzzer: they need the store); an answer must be +OK or -ERR, never the internal error."""
    from twisted.internet.testing import StringTransport

    from cassmail.config import Pop3Settings
    from cassmail.pop3.server import INTERNAL_ERROR, Pop3Factory

    if re.search(rb"(?i)(pass|auth|apop|user)", data):
        return
    factory = Pop3Factory(None, Pop3Settings(), None)  # type: ignore[arg-type]
    session = factory.buildProtocol(None)
    transport = StringTransport()
    session.makeConnection(transport)
    try:
        for piece in (data[: len(data) // 2], data[len(data) // 2 :], b"\r\n"):
            session.dataReceived(piece)
    finally:
        session.setTimeout(None)
        session.connectionLost(None)
    assert INTERNAL_ERROR not in transport.value()


# ----------------------------------------------------------------------------- IMAP


@target("cassmail.imap.connection", "cassmail.imap.parse", "cassmail.imap.wire")
def imap_command(data: bytes) -> None:
    """A byte stream cut into commands with their literals (connection.py), each parsed into a
    typed command (parse.py): BAD, NO [LIMIT] or an unknown command, nothing else."""
    from cassmail.imap import parse
    from cassmail.imap.connection import Closed, Connection, LineTooLong, LiteralTooLarge
    from cassmail.imap.wire import ParseError

    class Transport:
        def pause_reading(self) -> None: ...
        def resume_reading(self) -> None: ...
        def write(self, data: bytes) -> None: ...
        def abort(self) -> None: ...
        def close(self) -> None: ...

    async def read_all() -> None:
        connection = Connection(max_line=4096, max_pipelined=1 << 16, write_timeout=1)
        connection.connection_made(Transport())
        connection.data_received(data)
        connection.eof_received()
        limit = parse.message_limit(1 << 20)
        while True:
            try:
                frame = await connection.read_command(limit, 1024, 4096, lambda: None)
            except (LineTooLong, LiteralTooLarge):
                continue
            except Closed:
                return
            tag, name, cursor = parse.parse_tag(frame)
            if tag is None:
                continue
            try:
                parse.parse_command(tag, name, cursor)
            except (ParseError, KeyError):
                pass

    _run(read_all())


@target("cassmail.imap.parse", "cassmail.imap.wire")
def imap_search(data: bytes) -> None:
    """SEARCH and UID SEARCH programs (and FETCH attribute lists) straight to the grammar."""
    from cassmail.imap import parse
    from cassmail.imap.connection import Frame
    from cassmail.imap.wire import ParseError

    for prefix in (b"t SEARCH ", b"t UID SEARCH CHARSET UTF-8 ", b"t FETCH 1:* ", b"t STORE 1 +FLAGS "):
        tag, name, cursor = parse.parse_tag(Frame((prefix + data,)))
        assert tag == b"t"
        try:
            parse.parse_command(tag, name, cursor)
        except ParseError:
            pass


@target("cassmail.imap.mime", "cassmail.imap.wire")
def mime_structure(data: bytes) -> None:
    """A message as FETCH sees it: BODYSTRUCTURE, BODY, ENVELOPE and a few sections."""
    from cassmail.imap import mime, wire

    entity = mime.parse(data)
    wire.encode(mime.bodystructure(entity, True))
    wire.encode(mime.bodystructure(entity, False))
    wire.encode(mime.envelope(entity.headers))
    for path, text in (((), "HEADER"), ((1,), None), ((1,), "MIME"), ((2, 1), "TEXT"), ((1,), "HEADER")):
        try:
            mime.section(entity, path, text, ("Subject", "From"))
        except mime.NoSuchPart:
            pass
    mime.header_fields(entity.header_bytes(), ["Subject", "To"], True)


# ----------------------------------------------------------------------------- Sieve and ManageSieve


#: A message with what Sieve tests look at: addresses with details, encoded words, a date,
#: list headers, a multipart body with a text and a base64 part.
SIEVE_MESSAGE = (
    b"Return-Path: <b+list@x.test>\r\nFrom: =?utf-8?q?B=C3=A9a?= <b+list@x.test>\r\nTo: anne+work@y.test, c@y.test\r\n"
    b"Cc: \"D\" <d@z.test>\r\nSubject: =?iso-8859-1?b?cOlyZQ==?= report 42\r\nDate: Tue, 24 Nov 2026 10:00:00 +0100\r\n"
    b"List-Id: <l.x.test>\r\nX-Spam-Score: 7\r\nMessage-ID: <m@x.test>\r\n"
    b"Content-Type: multipart/mixed; boundary=b\r\n\r\n--b\r\nContent-Type: text/plain; charset=utf-8\r\n\r\n"
    b"caf\xc3\xa9 body text\r\n--b\r\nContent-Type: text/html\r\nContent-Transfer-Encoding: base64\r\n\r\n"
    b"PGI+aGk8L2I+\r\n--b--\r\n"
)


@target("cassmail.sieve.parse", "cassmail.sieve.script")
def sieve_script(data: bytes) -> None:
    """A script as PUTSCRIPT and CHECKSCRIPT get it: checked (SieveError or nothing), and one
    that passes run on a message as delivery runs it (at most the errors that leave the message
    in INBOX: SieveRuntimeError, SieveError, InvalidInput)."""
    from datetime import datetime, timezone

    from cassmail.model import InvalidInput
    from cassmail.sieve.script import (Envelope, Limits, Message, SieveError, SieveRuntimeError, compile_script,
                                       run)

    limits = Limits(regex_timeout=0.05)
    try:
        script = compile_script(data.decode("utf-8", "replace"), limits)
    except SieveError:
        return
    message = Message(SIEVE_MESSAGE, limits.max_body_bytes)
    try:
        run(script, message, Envelope("b+list@x.test", "anne+work@y.test"), ("INBOX", "Junk", "a/b"), limits,
            datetime(2026, 11, 24, 9, 30, tzinfo=timezone.utc))
    except (SieveRuntimeError, SieveError, InvalidInput):
        pass


class _StreamWriter:
    """What a ManageSieve session writes to: the bytes, kept (asyncio.StreamWriter's interface)."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.transport = None

    def write(self, data: bytes) -> None:
        self.data += data

    async def drain(self) -> None: ...

    def get_extra_info(self, name: str) -> Any:
        return ("127.0.0.1", 4190) if name == "peername" else None

    def close(self) -> None: ...

    async def wait_closed(self) -> None: ...


_sieve_listener: Any = None
SIEVE_USER = "anne@fuzz.test"


async def _managesieve_listener() -> Any:
    """One listener over an mbox store in a temporary directory, with one user (password
    "anne"); small limits, so that long lines and literals past them are reached."""
    global _sieve_listener
    if _sieve_listener is None:
        from cassmail import auth
        from cassmail.config import ManageSieveSettings, MboxSettings, SieveSettings
        from cassmail.managesieve import Listener
        from cassmail.store.mbox import MboxStore

        fast = auth.HashParams(log2_n=10, r=1, p=1)  # the least the checker takes
        auth._dummy_hash = auth.hash_password("unknown", fast)  # an unknown user's check costs no more
        store = MboxStore(MboxSettings(path=tempfile.mkdtemp(prefix="cassmail-fuzz-sieve-"), fsync=False))
        await store.open()
        await store.add_domain("fuzz.test")
        await store.create_user(SIEVE_USER, auth.hash_password("anne", fast))
        settings = ManageSieveSettings(allow_plaintext_auth=True, auth_failure_delay=0.0, max_auth_failures=3,
                                       max_line_length=1024)
        _sieve_listener = Listener(store, settings, SieveSettings(max_script_size=2048, max_scripts=8))
    return _sieve_listener


@target("cassmail.managesieve")
def managesieve_command(data: bytes) -> None:
    """A byte stream as a ManageSieve session reads it: command lines with quoted strings,
    numbers and literals, AUTHENTICATE's continuation, every command before login or (when the
    first byte is odd) logged in, on a real store. Answers are OK, NO or BYE: never the
    internal error (BYE (TRYLATER) "Internal error..."), never an error in the log."""
    from cassmail.managesieve import Session

    async def session() -> bytes:
        listener = await _managesieve_listener()
        reader = asyncio.StreamReader(limit=listener.settings.max_line_length + 2)
        reader.feed_data(data[1:])
        reader.feed_eof()
        writer = _StreamWriter()
        running = Session(listener, reader, writer)  # type: ignore[arg-type]
        if data[:1] and data[0] & 1:
            running.user = SIEVE_USER
        await running.run()
        return bytes(writer.data)

    answers = _run(session())
    assert b"Internal error" not in answers, answers[-300:]


# ----------------------------------------------------------------------------- the mbox store


#: Splits a mailbox input into its index file and its mbox file.
MBOX_SPLIT = b"\n--cassmail-fuzz-mbox--\n"
_mbox_dir: Path | None = None


@target("cassmail.store.mbox_index", "cassmail.store.mbox_format")
def mbox_files(data: bytes) -> None:
    """A mailbox's two files as anything may have left them (a crash, another mbox tool, a
    disk): opened, listed and every message read, after a rebuild where the index is wrong."""
    from cassmail.config import MboxSettings
    from cassmail.store.mbox_index import MailboxFile, MessageGone, NeedsRecovery, ReadState

    global _mbox_dir
    if _mbox_dir is None:
        _mbox_dir = Path(tempfile.mkdtemp(prefix="cassmail-fuzz-mbox-"))
    index, _, mbox = data.partition(MBOX_SPLIT)
    (_mbox_dir / "mbox").write_bytes(mbox)
    (_mbox_dir / "index").write_bytes(index)
    settings = MboxSettings(path=str(_mbox_dir), fsync=False)
    box = MailboxFile(_mbox_dir / "mbox", _mbox_dir / "index", settings, lambda: 7, False)
    try:
        summaries, _ = box.page(None, 1000)
        for summary in summaries:
            # As the store does: a message not where the index says makes the next reader
            # rebuild the index, and the read starts again (three times at most here).
            for _ in range(3):
                state = ReadState(summary.id, 0, None)
                try:
                    while box.read_step(state) is not None:
                        pass
                    break
                except MessageGone:
                    break
                except NeedsRecovery:
                    continue
            else:
                raise AssertionError(f"message {summary.id} still needs recovery after two rebuilds")
    finally:
        box.close()


@target("cassmail.store.mbox_format")
def mbox_format(data: bytes) -> None:
    """The mbox readers on their own: scan an image, unquote From_ lines in pieces, flags."""
    from cassmail.store import mbox_format as fmt

    for record in fmt.scan(data, 0):
        assert record.length > 0
    unquoter = fmt.Unquoter()
    streamed = b"".join(unquoter.feed(data[i : i + 7]) for i in range(0, len(data), 7)) + unquoter.finish()
    assert streamed == fmt.unquote(data)
    assert fmt.unquote(bytes(fmt.quote(data))) == data
    third = len(data) // 3
    fmt.decode_flags(data[:third], data[third : 2 * third], data[2 * third :])


# ----------------------------------------------------------------------------- configuration


_config_file: Path | None = None


@target("cassmail.config", "tomllib")
def config(data: bytes) -> None:
    """A configuration file: settings, or ConfigError naming what is wrong."""
    from cassmail.config import ConfigError, load

    global _config_file
    if _config_file is None:
        _config_file = Path(tempfile.mkdtemp(prefix="cassmail-fuzz-config-")) / "cassmail.toml"
    _config_file.write_bytes(data)
    try:
        load(_config_file, env={})
    except ConfigError:
        pass


# ----------------------------------------------------------------------------- running


def _cassmail_modules() -> set[str]:
    """The names of every module and package of cassmail, found from its files (none imported)."""
    root = Path(__file__).resolve().parent.parent / "cassmail"
    names = set()
    for path in root.rglob("*.py"):
        parts = ("cassmail", *path.relative_to(root).with_suffix("").parts)
        names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _fuzz(name: str, seconds: int, runs: int, work: Path, artifacts: Path) -> None:
    """Run one target in this process (libFuzzer exits the process at the end)."""
    import atheris

    logging.getLogger().addHandler(_ErrorLog())
    logging.getLogger().setLevel(logging.ERROR)
    modules = INSTRUMENTED[name]
    # atheris instruments the whole top-level package of each name it includes: every other
    # cassmail module is named in `exclude` (exact names), or importing the target would
    # instrument most of cassmail, seconds at every start and coverage that guides nothing.
    others = sorted(_cassmail_modules() - set(modules))
    with atheris.instrument_imports(include=list(modules), exclude=others):
        for module in modules:
            importlib.import_module(module)
    seeds = CORPUS / name
    argv = [sys.argv[0], f"-max_total_time={seconds}", "-timeout=10", "-rss_limit_mb=2048", "-print_final_stats=1",
            f"-artifact_prefix={artifacts}/", str(work), str(seeds)]
    if runs:
        argv.insert(1, f"-runs={runs}")
    atheris.Setup(argv, TARGETS[name])
    atheris.Fuzz()


def main() -> None:
    parser = argparse.ArgumentParser(description="Coverage-guided fuzzing of cassmail's parsers (atheris).")
    parser.add_argument("target", choices=[*TARGETS, "all"])
    parser.add_argument("--seconds", type=int, default=60, help="how long per target (default 60)")
    parser.add_argument("--runs", type=int, default=0, help="stop after this many inputs (0: no limit)")
    parser.add_argument("--work", type=Path, help="where new inputs go (default: a temporary directory)")
    parser.add_argument("--artifacts", type=Path, default=Path("."), help="where crashing inputs are saved")
    parser.add_argument("--replay", type=Path, help="run the target once on this input and show what it raises")
    args = parser.parse_args()
    if args.replay is not None:
        logging.getLogger().addHandler(_ErrorLog())
        TARGETS[args.target](args.replay.read_bytes())
        print("no crash")
        return
    if args.target == "all":
        failed = []
        for name in TARGETS:
            print(f"== {name}", flush=True)
            command = [sys.executable, "-m", "tests.fuzz_targets", name, "--seconds", str(args.seconds),
                       "--artifacts", str(args.artifacts)]
            if subprocess.run(command, check=False).returncode != 0:
                failed.append(name)
        print("crashed:", " ".join(failed) if failed else "none")
        raise SystemExit(1 if failed else 0)
    work = args.work or Path(tempfile.mkdtemp(prefix=f"cassmail-fuzz-{args.target}-"))
    work.mkdir(parents=True, exist_ok=True)
    args.artifacts.mkdir(parents=True, exist_ok=True)
    _fuzz(args.target, args.seconds, args.runs, work, args.artifacts.resolve())


if __name__ == "__main__":
    main()
