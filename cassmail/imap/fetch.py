"""FETCH (RFC 3501 6.4.5): byte-exact sections from `mime`, BODY[] and partial bodies streamed
from the store with flow control, \\Seen set once per command for all the messages it reads.

Every store read that can fail for a message comes before the first byte of its response (a
streamed item's first chunk included), so a failure then is a clean NO. A message expunged by
another session meanwhile is left out and the command answers NO [EXPUNGEISSUED] for those only
(RFC 2180 4.1.2); the others are sent.

Once a literal's length is announced it cannot be taken back. If the rest of a streamed body
vanishes (another session expunged it: on Cassandra its chunks go with it), the literal is
completed with spaces, its FETCH response closed, and the command still answers NO
[EXPUNGEISSUED]: the data of a message that is gone is fake from there on (RFC 2180 4.1.3 lets a
server send fake data for an expunged message), the client's EXPUNGE comes at its next NOOP, and
the connection goes on. A read that fails while the message is still there (the store
unavailable for a moment) is resumed where it stopped; only when the store stays unavailable is
the connection cut (logged), since padding a live message would hand the client a corrupt copy
it may keep for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cassmail.imap import commands as c
from cassmail.imap import condstore, mime, wire
from cassmail.imap.connection import Closed
from cassmail.imap.errors import Bad, No
from cassmail.logs import kv
from cassmail.model import MessageSummary
from cassmail.store.base import NoSuchMessage, StoreError, StoreUnavailable

if TYPE_CHECKING:
    from cassmail.imap.session import Session

#: A command that reads the headers of many messages (FETCH of ENVELOPE or header fields, SEARCH
#: on them, SORT, THREAD) reads those the worker does not keep this many at a time, in one store
#: call (Store.read_heads).
HEADS_AHEAD = 64
#: A streamed literal whose store read fails while the message is still there is resumed where
#: it stopped, this many times (after RESUME_PAUSE, doubling), before the connection is cut.
RESUME_ATTEMPTS = 3
RESUME_PAUSE = 0.2
#: What completes a literal whose message vanished after its length was announced.
PAD = b" "

log = logging.getLogger("cassmail.imap")

_PARSED = frozenset({"ENVELOPE", "BODYSTRUCTURE", "RFC822.HEADER", "RFC822.TEXT"})


def _streamed(att: c.FetchAtt) -> bool:
    """BODY[] (maybe partial) and RFC822 need no parsing: they are streamed."""
    return att.name == "RFC822" or (att.name == "BODY" and att.section is not None and att.section == c.Section())


def _header_only(att: c.FetchAtt) -> bool:
    """Answered from the top-level header alone (ENVELOPE, BODY[HEADER...], RFC822.HEADER)."""
    if att.name in ("ENVELOPE", "RFC822.HEADER"):
        return True
    section = att.section
    return section is not None and not section.part and (section.text or "").startswith("HEADER")


def _needs_entity(att: c.FetchAtt) -> bool:
    return att.name in _PARSED or (att.name == "BODY" and not _streamed(att)) or att.name.startswith("BINARY")


async def fetch(session: Session, args: c.Fetch) -> str:
    view = session.selected()
    atts = list(args.atts)
    modseqs = any(a.name == "MODSEQ" for a in atts)  # CHANGEDSINCE added it (parse)
    if args.vanished and not session.qresync:
        raise Bad("VANISHED needs ENABLE QRESYNC first")
    if modseqs:
        condstore.enable(session)  # RFC 7162 3.1: FETCH MODSEQ, CHANGEDSINCE
    uids = session.uids(args.messages, args.uid)
    if args.vanished and args.changedsince is not None:
        await condstore.vanished_earlier(session, args.messages, args.changedsince)
    if modseqs:
        await condstore.fill(session, uids)
    if args.changedsince is not None:
        uids = [u for u in uids if view.changed_since(u, args.changedsince)]
    if not view.readonly and any(a.sets_seen for a in atts):
        unseen = [u for u in uids if "\\Seen" not in view.messages[u].flags]
        if unseen:
            modseqs: dict[uuid.UUID, int] = {}
            await session.store.store_flags(view.user, view.name, [view.messages[u].id for u in unseen], ["\\Seen"],
                                            "add", modseqs=modseqs, known=view.known(unseen))
            for u in unseen:
                view.set_flags(u, view.messages[u].flags | {"\\Seen"})
            view.took(modseqs, flagged={view.messages[u].id: u for u in unseen})
            if not any(a.name == "FLAGS" for a in atts):
                atts.append(c.FetchAtt("FLAGS"))
            if session.condstore:  # RFC 7162 3.1: the \\Seen it set is told with UID and MODSEQ
                await condstore.learn(session, unseen, flags=True)
                atts += [c.FetchAtt(name) for name in ("UID", "MODSEQ") if not any(a.name == name for a in atts)]
    if any(a.name == "FLAGS" for a in atts):
        session.announce_flags(uids)  # every keyword the FETCH shows, before its first line
    if all(a.name in FROM_THE_VIEW for a in atts):
        await _fetch_from_the_view(session, uids, atts)
        return ("UID " if args.uid else "") + "FETCH completed"
    missing = 0
    parsed = [a for a in atts if _needs_entity(a)]
    heads = Heads(session, uids) if _heads_answer(parsed) else None
    for message_uid in uids:
        summary = view.messages.get(message_uid)
        if summary is None:
            continue
        try:
            header = await heads.get(summary) if heads is not None else None
            await _fetch_one(session, message_uid, summary, atts, parsed, heads is not None, header)
        except NoSuchMessage:
            missing += 1
        await session.conn.drain()
    if missing:
        raise No("Some messages were expunged meanwhile", "EXPUNGEISSUED")
    return ("UID " if args.uid else "") + "FETCH completed"


#: Items a FETCH answers from the selected view alone, with no read of the message.
FROM_THE_VIEW = frozenset({"FLAGS", "UID", "MODSEQ", "INTERNALDATE", "RFC822.SIZE"})
#: Response lines written between two waits for the client to read (`drain`).
VIEW_LINES_PER_DRAIN = 256


async def _fetch_from_the_view(session: Session, uids: list[int], atts: list[c.FetchAtt]) -> None:
    """A FETCH of FROM_THE_VIEW items only (a client listing its mailbox's flags): each message's
    line made at once, without the per-message steps of messages that are read; the client is
    waited for every VIEW_LINES_PER_DRAIN lines, as for every message read."""
    view = session.selected()
    conn, messages = session.conn, view.messages
    for n, uid in enumerate(uids, 1):
        summary = messages.get(uid)
        if summary is None:
            continue
        conn.write(b"* %d FETCH (%s)\r\n" % (view.seq(uid), b" ".join([_item(session, uid, summary, a, None) for a in atts])))
        if n % VIEW_LINES_PER_DRAIN == 0:
            await conn.drain()
    await conn.drain()


def _heads_answer(parsed: list[c.FetchAtt]) -> bool:
    """Whether the header answers the items of a FETCH that need the message parsed (`parsed`):
    what mail clients ask for when they list a mailbox."""
    return bool(parsed) and all(_header_only(a) for a in parsed)


async def _fetch_one(session: Session, uid: int, summary: MessageSummary, atts: list[c.FetchAtt],
                     parsed: list[c.FetchAtt], by_head: bool, header: mime.Entity | None = None) -> None:
    """One message's FETCH response. The FETCH decided once for all its messages which items
    need the message parsed (`parsed`) and whether its header answers them (`by_head`, see
    `_heads_answer`); `header`: the parsed header when the caller read it (Heads)."""
    view = session.selected()
    streamed = [a for a in atts if _streamed(a)]
    entity = None
    if by_head:
        entity = header or await headers_only(session, summary)
        if entity is None:
            raise NoSuchMessage(view.name, summary.id)
    elif parsed:
        entity = mime.parse(await session.store.read_message(view.user, view.name, summary.id))
        for att in parsed:
            if att.name.startswith("BINARY"):
                assert att.section is not None
                try:
                    mime.binary(entity, att.section.part)
                except mime.UnknownEncoding as exc:
                    raise No(f"Cannot decode Content-Transfer-Encoding {exc}", "UNKNOWN-CTE") from None
    # A stalled or vanished client leaves streams unread: their files and reads are given back.
    async with contextlib.AsyncExitStack() as unread:
        streams = {}
        for att in streamed:
            streams[id(att)] = stream = await _open_stream(session, summary, att)
            unread.push_async_callback(stream.close)
        out: list[bytes] = []
        write = session.conn.write
        head = b"* %d FETCH (" % view.seq(uid)
        vanished = False
        for n, att in enumerate(atts):
            if att in streamed:
                write(head + b" ".join(out) + (b" " if out else b""))
                head, out = b"", []
                vanished = not await _send_stream(session, streams[id(att)]) or vanished
                if n + 1 < len(atts):
                    write(b" ")
                continue
            out.append(_item(session, uid, summary, att, entity))
        write(head + b" ".join(out) + b")\r\n")
    if vanished:  # its response is complete and the connection in step; the command says NO
        raise NoSuchMessage(view.name, summary.id)


def _item(session: Session, uid: int, summary: MessageSummary, att: c.FetchAtt, entity: mime.Entity | None) -> bytes:
    name = att.name
    if name == "FLAGS":
        return b"FLAGS " + session.selected().flag_list(uid)
    if name == "UID":
        return b"UID %d" % uid
    if name == "MODSEQ":
        return b"MODSEQ (%d)" % session.selected().modseq(uid)
    if name == "INTERNALDATE":
        return b"INTERNALDATE " + wire.format_datetime(summary.internal_date)
    if name == "RFC822.SIZE":
        return b"RFC822.SIZE %d" % summary.size
    assert entity is not None
    if name == "ENVELOPE":
        return b"ENVELOPE " + wire.encode(mime.envelope(entity.headers))
    if name == "BODYSTRUCTURE":
        return b"BODYSTRUCTURE " + wire.encode(mime.bodystructure(entity, True))
    if name == "RFC822.HEADER":
        return b"RFC822.HEADER " + wire.literal(entity.header_bytes())
    if name == "RFC822.TEXT":
        return b"RFC822.TEXT " + wire.literal(entity.body_bytes())
    if att.section is None:  # BODY: the structure, without extension data
        return b"BODY " + wire.encode(mime.bodystructure(entity, False))
    if name.startswith("BINARY"):
        data = mime.binary(entity, att.section.part)
        if name == "BINARY.SIZE":
            return att.response_name() + b" %d" % len(data)
        if att.partial is not None:
            data = data[att.partial[0] : att.partial[0] + att.partial[1]]
        return att.response_name() + b" ~" + wire.literal(data)  # literal8: the data may hold NUL
    section = att.section
    data = mime.section(entity, section.part, section.text, section.fields)
    if att.partial is not None:
        start, length = att.partial
        data = data[start : start + length]
    return att.response_name() + b" " + wire.literal(data)


async def headers_only(session: Session, summary: MessageSummary) -> mime.Entity | None:
    """The message's header, parsed; None when the message is gone."""
    return (await headers_of(session, [summary])).get(summary.id.int)


async def headers_of(session: Session, summaries: list[MessageSummary]) -> dict[int, mime.Entity]:
    """The parsed headers of these messages of the selected mailbox by their id's integer, those
    gone left out. A message's bytes never change, so parsed headers are kept by id (the
    listener's `headers`): a client listing a mailbox and SEARCH on header fields read each header
    from the store once, and those not kept yet in one store call."""
    out: dict[int, mime.Entity] = {}
    missing: list[MessageSummary] = []
    for summary in summaries:
        entity = kept_header(session, summary)
        if entity is None:
            missing.append(summary)
        else:
            out[summary.id.int] = entity
    if not missing:
        return out
    view = session.selected()
    heads = await session.store.read_heads(view.user, view.name, [m.id for m in missing])
    for summary in missing:
        data = heads.get(summary.id)
        if data is None:
            continue
        # (the store's head ends where mime sees the header end: the blank line, or all of it)
        entity = out[summary.id.int] = mime.parse(data)
        session.listener.headers.put(summary.id.int, entity, 3 * len(data) + 256)  # about three times its bytes
    return out


def kept_header(session: Session, summary: MessageSummary) -> mime.Entity | None:
    """The message's parsed header if the worker keeps it (no store read, no coroutine). Kept by
    the id's integer: an int hashes in C, a UUID in Python."""
    return session.listener.headers.get(summary.id.int)


class Heads:
    """The parsed headers of the messages a command goes through in order (`uids`), read
    HEADS_AHEAD at a time (`headers_of`) as it reaches them."""

    def __init__(self, session: Session, uids: list[int]) -> None:
        self.session = session
        self.uids = uids
        self.pos = 0  # where in `uids` the next read starts
        self.read: dict[int, mime.Entity | None] = {}

    async def get(self, summary: MessageSummary) -> mime.Entity | None:
        """`summary`'s header (a message of `uids` at or after the last one asked for), None when
        it is gone."""
        key = summary.id.int
        if key not in self.read:
            entity = kept_header(self.session, summary)
            if entity is not None:
                return entity
            messages = self.session.selected().messages
            window: list[MessageSummary] = []
            while self.pos < len(self.uids) and len(window) < HEADS_AHEAD:
                found = messages.get(self.uids[self.pos])
                self.pos += 1
                if found is not None and kept_header(self.session, found) is None:
                    window.append(found)
            if all(m.id.int != key for m in window):
                window.append(summary)  # (asked for out of order)
            got = await headers_of(self.session, window)
            self.read = {m.id.int: got.get(m.id.int) for m in window}
        return self.read[key]


@dataclass(slots=True)
class Stream:
    """A BODY[] / BODY[]<a.b> / RFC822 item to be streamed: the bytes `start` to `end` of a
    message, whose first piece was read before the literal is announced."""

    name: bytes
    message_id: uuid.UUID
    start: int
    end: int
    first: bytes
    rest: AsyncIterator[bytes] | None

    async def close(self) -> None:
        if self.rest is not None:
            await self.rest.aclose()  # type: ignore[attr-defined]


async def _open_stream(session: Session, summary: MessageSummary, att: c.FetchAtt) -> Stream:
    """The item's first piece read (a failure here is still a clean NO), the rest to come."""
    view = session.selected()
    start, end = 0, summary.size
    if att.partial is not None:
        start = min(att.partial[0], summary.size)
        end = min(start + att.partial[1], summary.size)
    stream = Stream(att.response_name(), summary.id, start, max(start, end), b"", None)
    if end > start:
        rest = session.store.read_chunks(view.user, view.name, summary.id, start, end).__aiter__()
        stream.rest = rest
        try:
            stream.first = await rest.__anext__()
        except StopAsyncIteration:
            stream.rest = None
    return stream


async def _send_stream(session: Session, stream: Stream) -> bool:
    """The item straight from the store to the socket, a piece at a time, with flow control.
    True when all of it was the message's; False when the message vanished after the literal
    was announced and the rest of it is padding."""
    conn = session.conn
    length = stream.end - stream.start
    conn.write(stream.name + b" {%d}\r\n" % length)
    conn.write(stream.first)
    sent = len(stream.first)
    failures = 0
    while stream.rest is not None:
        try:
            async for chunk in stream.rest:
                await conn.drain()
                if sent + len(chunk) > length:
                    _cut(session, "message changed while it was sent")
                conn.write(chunk)
                sent += len(chunk)
            break
        except NoSuchMessage:
            log.info(kv("imap-fetch-vanished", peer=session.peer, user=session.user, message=stream.message_id,
                        sent=sent, padded=length - sent))
            await _pad(session, length - sent)
            return False
        except StoreUnavailable as exc:
            failures += 1
            if failures > RESUME_ATTEMPTS:
                _cut(session, f"store failed in the middle of a literal: {exc}")
            log.info(kv("imap-fetch-resume", peer=session.peer, user=session.user, message=stream.message_id,
                        sent=sent, error=exc))
            await asyncio.sleep(RESUME_PAUSE * 2 ** (failures - 1))
            await stream.close()
            view = session.selected()
            stream.rest = session.store.read_chunks(view.user, view.name, stream.message_id, stream.start + sent,
                                                    stream.end).__aiter__()
        except StoreError as exc:
            _cut(session, f"store failed in the middle of a literal: {exc}")
    if sent != length:  # the store changed under us: the literal's length cannot be kept
        _cut(session, "message changed while it was sent")
    return True


async def _pad(session: Session, size: int) -> None:
    """`size` bytes of padding, a chunk at a time, with flow control."""
    piece = PAD * min(size, 64 * 1024)
    while size > 0:
        await session.conn.drain()
        session.conn.write(piece[:size])
        size -= len(piece)


def _cut(session: Session, reason: str) -> None:
    log.warning(kv("imap-closed", peer=session.peer, user=session.user, reason=reason))
    session.conn.abort()
    raise Closed(reason)
