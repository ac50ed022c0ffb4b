"""Sieve scripts: checking one (the commands, tags and extensions it uses) and running it on a message.

`compile_script` is what ManageSieve's PUTSCRIPT and CHECKSCRIPT call: a script
that passes it runs without a syntax surprise at delivery. `run` evaluates a
compiled script against one message for one recipient and returns the actions
it decided, implicit keep included; it does no I/O (the delivery step in
`cassmail.sieve.delivery` reads the script and carries the actions out), so a
script's work is bounded by `Limits` alone.
"""

from __future__ import annotations

import email
import email.message
import email.policy
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from email.header import decode_header, make_header
from email.parser import BytesHeaderParser
from email.utils import getaddresses, parsedate_to_datetime

import regex

from cassmail.sieve.parse import Argument, Command, Number, SieveSyntaxError, Strings, Tag, Test, parse

#: The empty line that ends a message's header section.
_HEADER_END = re.compile(rb"\r\n\r\n")


class SieveError(ValueError):
    """A script that cannot be run: a syntax error, an unknown command or extension, or a limit."""


class SieveRuntimeError(Exception):
    """A script failed while it ran (a limit, a regular expression that took too long, conflicting
    actions); RFC 5228 2.10.6: the message is then kept in INBOX and the error logged."""


@dataclass(frozen=True)
class Limits:
    """Bounds on the work of one script on one message; every one is a setting ([sieve])."""

    max_script_size: int = 64 * 1024
    max_actions: int = 32
    max_redirects: int = 4
    max_regex_length: int = 1024
    regex_timeout: float = 0.1
    max_body_bytes: int = 1024 * 1024
    max_variable_length: int = 4096


#: The extensions this interpreter implements: the SIEVE capability of ManageSieve.
EXTENSIONS = (
    "body", "comparator-i;ascii-numeric", "copy", "date", "envelope", "ereject", "fileinto",
    "imap4flags", "index", "mailbox", "regex", "reject", "relational", "subaddress", "vacation",
    "vacation-seconds", "variables",
)

# --------------------------------------------------------------------------- signatures

S, SL, N = "string", "strings", "number"


@dataclass(frozen=True)
class Signature:
    #: tag -> (kind of the value that follows it or None, extension it needs or None)
    tags: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)
    #: groups of tags of which at most one may be given
    exclusive: tuple[frozenset[str], ...] = ()
    positional: tuple[str, ...] = ()
    #: how many leading positionals may be left out (hasflag's and setflag's variable name)
    optional: int = 0
    tests: str = "none"  # none | one | list
    block: bool = False
    extension: str | None = None


_MATCH = {":is": (None, None), ":contains": (None, None), ":matches": (None, None), ":regex": (None, "regex"),
          ":count": (S, "relational"), ":value": (S, "relational")}
_COMPARATOR = {":comparator": (S, None)}
_PART = {":localpart": (None, None), ":domain": (None, None), ":all": (None, None), ":user": (None, "subaddress"),
         ":detail": (None, "subaddress")}
_INDEX = {":index": (N, "index"), ":last": (None, "index")}
_MATCH_GROUPS = (frozenset(_MATCH), frozenset(_COMPARATOR))
_ZONE = {":zone": (S, None), ":originalzone": (None, None)}
_SET_MODIFIERS = (":lower", ":upper", ":lowerfirst", ":upperfirst", ":quotewildcard", ":quoteregex", ":length",
                  ":encodeurl")

COMMANDS: dict[str, Signature] = {
    "if": Signature(tests="one", block=True),
    "elsif": Signature(tests="one", block=True),
    "else": Signature(block=True),
    "stop": Signature(),
    "keep": Signature(tags={":flags": (SL, "imap4flags")}),
    "discard": Signature(),
    "fileinto": Signature(tags={":copy": (None, "copy"), ":create": (None, "mailbox"), ":flags": (SL, "imap4flags")},
                          positional=(S,), extension="fileinto"),
    "redirect": Signature(tags={":copy": (None, "copy")}, positional=(S,)),
    "reject": Signature(positional=(S,), extension="reject"),
    "ereject": Signature(positional=(S,), extension="ereject"),
    "setflag": Signature(positional=(S, SL), optional=1, extension="imap4flags"),
    "addflag": Signature(positional=(S, SL), optional=1, extension="imap4flags"),
    "removeflag": Signature(positional=(S, SL), optional=1, extension="imap4flags"),
    "vacation": Signature(tags={":days": (N, None), ":seconds": (N, "vacation-seconds"), ":subject": (S, None),
                                ":from": (S, None), ":addresses": (SL, None), ":mime": (None, None),
                                ":handle": (S, None)},
                          exclusive=(frozenset({":days", ":seconds"}),), positional=(S,), extension="vacation"),
    "set": Signature(tags={m: (None, None) for m in _SET_MODIFIERS}, positional=(S, S), extension="variables"),
}

TESTS: dict[str, Signature] = {
    "address": Signature(tags={**_MATCH, **_COMPARATOR, **_PART, **_INDEX},
                         exclusive=(*_MATCH_GROUPS, frozenset(_PART)), positional=(SL, SL)),
    "envelope": Signature(tags={**_MATCH, **_COMPARATOR, **_PART}, exclusive=(*_MATCH_GROUPS, frozenset(_PART)),
                          positional=(SL, SL), extension="envelope"),
    "header": Signature(tags={**_MATCH, **_COMPARATOR, **_INDEX}, exclusive=_MATCH_GROUPS, positional=(SL, SL)),
    "exists": Signature(positional=(SL,)),
    "size": Signature(tags={":over": (None, None), ":under": (None, None)},
                      exclusive=(frozenset({":over", ":under"}),), positional=(N,)),
    "true": Signature(),
    "false": Signature(),
    "not": Signature(tests="one"),
    "allof": Signature(tests="list"),
    "anyof": Signature(tests="list"),
    "body": Signature(tags={**_MATCH, **_COMPARATOR, ":raw": (None, None), ":content": (SL, None), ":text": (None, None)},
                      exclusive=(*_MATCH_GROUPS, frozenset({":raw", ":content", ":text"})), positional=(SL,),
                      extension="body"),
    "hasflag": Signature(tags={**_MATCH, **_COMPARATOR}, exclusive=_MATCH_GROUPS, positional=(SL, SL), optional=1,
                         extension="imap4flags"),
    "string": Signature(tags={**_MATCH, **_COMPARATOR}, exclusive=_MATCH_GROUPS, positional=(SL, SL),
                        extension="variables"),
    "date": Signature(tags={**_MATCH, **_COMPARATOR, **_ZONE, **_INDEX},
                      exclusive=(*_MATCH_GROUPS, frozenset(_ZONE)), positional=(S, S, SL), extension="date"),
    "currentdate": Signature(tags={**_MATCH, **_COMPARATOR, ":zone": (S, None)}, exclusive=_MATCH_GROUPS,
                             positional=(S, SL), extension="date"),
    "mailboxexists": Signature(positional=(SL,), extension="mailbox"),
}

COMPARATORS = {"i;octet": None, "i;ascii-casemap": None, "i;ascii-numeric": "comparator-i;ascii-numeric"}
RELATIONS = ("gt", "ge", "lt", "le", "eq", "ne")
DATE_PARTS = ("year", "month", "day", "date", "julian", "hour", "minute", "second", "time", "iso8601", "std11",
              "zone", "weekday")
_VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
#: A :zone offset (RFC 5260 4.1, RFC 5322 3.3): hours 00..23 and minutes 00..59, the offsets Python's
#: timezone can hold; "+3237" is refused when the script is checked, or at run time when a variable
#: makes it.
_ZONE_TEXT = re.compile(r"[+-]([01][0-9]|2[0-3])([0-5][0-9])\Z")


@dataclass
class Args:
    """A command's or test's arguments sorted out: tag -> value (True for a tag without one),
    and the positional arguments in order (a left-out optional one is None)."""

    tags: dict[str, object]
    positional: list[object]
    tests: list[Test]


@dataclass
class Script:
    """A checked script, ready to run any number of times."""

    commands: list[Command]
    required: frozenset[str]
    text: str


def compile_script(text: str, limits: Limits = Limits()) -> Script:
    """A checked script, or SieveError saying what is wrong and on which line."""
    if len(text.encode("utf-8", "surrogatepass")) > limits.max_script_size:
        raise SieveError(f"script larger than {limits.max_script_size} bytes")
    try:
        commands = parse(text)
    except SieveSyntaxError as exc:
        raise SieveError(str(exc)) from None
    required: set[str] = set()
    body_seen = False
    for command in commands:
        if command.name == "require":
            if body_seen:
                raise SieveError(f"line {command.line}: require must come before any other command")
            if command.tests or command.block is not None or len(command.arguments) != 1 or not isinstance(
                    command.arguments[0], Strings):
                raise SieveError(f"line {command.line}: require takes one string list")
            for name in command.arguments[0].values:
                if name not in EXTENSIONS:
                    raise SieveError(f"line {command.line}: unsupported extension {name!r}")
                required.add(name)
        else:
            body_seen = True
    checker = _Checker(frozenset(required), limits)
    checker.block([c for c in commands if c.name != "require"], top=True)
    return Script([c for c in commands if c.name != "require"], frozenset(required), text)


class _Checker:
    def __init__(self, required: frozenset[str], limits: Limits) -> None:
        self.required, self.limits = required, limits

    def need(self, extension: str | None, what: str, line: int) -> None:
        if extension is not None and extension not in self.required:
            raise SieveError(f'line {line}: {what} needs require "{extension}"')

    def block(self, commands: Sequence[Command], top: bool = False) -> None:
        previous = ""
        for command in commands:
            if command.name == "require":
                raise SieveError(f"line {command.line}: require must come before any other command")
            if command.name in ("elsif", "else") and previous not in ("if", "elsif"):
                raise SieveError(f"line {command.line}: {command.name} without if")
            signature = COMMANDS.get(command.name)
            if signature is None:
                raise SieveError(f"line {command.line}: unknown command {command.name!r}")
            self.need(signature.extension, command.name, command.line)
            if signature.block != (command.block is not None):
                raise SieveError(f"line {command.line}: {command.name} " +
                                 ("needs a block" if signature.block else "takes no block (missing ';'?)"))
            command.compiled = self.arguments(command.name, signature, command.arguments, command.tests, command.line)
            self.extra(command.name, command.compiled, command.line)
            if command.block is not None:
                self.block(command.block)
            previous = command.name

    def test(self, test: Test) -> None:
        signature = TESTS.get(test.name)
        if signature is None:
            raise SieveError(f"line {test.line}: unknown test {test.name!r}")
        self.need(signature.extension, test.name, test.line)
        args = self.arguments(test.name, signature, test.arguments, test.tests, test.line)
        self.extra(test.name, args, test.line)
        test.compiled = args

    def arguments(self, name: str, signature: Signature, arguments: list[Argument], tests: list[Test],
                  line: int) -> Args:
        tags: dict[str, object] = {}
        positional: list[object] = []
        items = list(arguments)
        i = 0
        while i < len(items):
            item = items[i]
            if isinstance(item, Tag):
                if positional:
                    raise SieveError(f"line {item.line}: {name}: tag {item.name} after a positional argument")
                spec = signature.tags.get(item.name)
                if spec is None:
                    raise SieveError(f"line {item.line}: {name} has no tag {item.name}")
                kind, extension = spec
                self.need(extension, f"{name} {item.name}", item.line)
                if item.name in tags:
                    raise SieveError(f"line {item.line}: {name}: tag {item.name} given twice")
                for group in signature.exclusive:
                    if item.name in group and any(t in group for t in tags):
                        raise SieveError(f"line {item.line}: {name}: {item.name} conflicts with another tag")
                if kind is None:
                    tags[item.name] = True
                else:
                    i += 1
                    if i >= len(items):
                        raise SieveError(f"line {item.line}: {name}: {item.name} needs a value")
                    tags[item.name] = _value(items[i], kind, f"{name} {item.name}")
            else:
                positional.append(item)
            i += 1
        wanted = signature.positional
        if not len(wanted) - signature.optional <= len(positional) <= len(wanted):
            raise SieveError(f"line {line}: {name} takes {len(wanted)} argument(s), got {len(positional)}")
        skip = len(wanted) - len(positional)
        values: list[object] = [None] * skip
        for kind, item in zip(wanted[skip:], positional):
            values.append(_value(item, kind, name))
        if signature.tests == "none" and tests:
            raise SieveError(f"line {line}: {name} takes no test")
        if signature.tests == "one" and len(tests) != 1:
            raise SieveError(f"line {line}: {name} needs exactly one test")
        if signature.tests == "list" and not tests:
            raise SieveError(f"line {line}: {name} needs a test list")
        for test in tests:
            self.test(test)
        return Args(tags, values, tests)

    def extra(self, name: str, args: Args, line: int) -> None:
        """Checks of values: comparators, relations, date parts, regular expressions, names."""
        comparator = args.tags.get(":comparator")
        if comparator is not None:
            if comparator not in COMPARATORS:
                raise SieveError(f"line {line}: unknown comparator {comparator!r}")
            self.need(COMPARATORS[str(comparator)], f"comparator {comparator}", line)
        for tag in (":count", ":value"):
            if tag in args.tags and str(args.tags[tag]).lower() not in RELATIONS:
                raise SieveError(f"line {line}: {tag} needs one of {', '.join(RELATIONS)}")
        if ":regex" in args.tags and "variables" not in self.required:
            for key in args.positional[-1] or ():  # type: ignore[union-attr]
                _regex(str(key), False, self.limits)
        if name == "size" and not (":over" in args.tags or ":under" in args.tags):
            raise SieveError(f"line {line}: size needs :over or :under")
        if name in ("date", "currentdate"):
            part = args.positional[-2]
            if str(part).lower() not in DATE_PARTS and "variables" not in self.required:
                raise SieveError(f"line {line}: unknown date part {part!r}")
            zone = args.tags.get(":zone")
            if zone is not None and not _ZONE_TEXT.match(str(zone)) and "variables" not in self.required:
                raise SieveError(f"line {line}: :zone needs a zone like +0100")
        if name == "set" and not _VARIABLE_NAME.match(str(args.positional[0])):
            raise SieveError(f"line {line}: bad variable name {args.positional[0]!r}")
        if name in ("setflag", "addflag", "removeflag", "hasflag") and args.positional[0] is not None:
            if "variables" not in self.required:
                raise SieveError(f'line {line}: a variable name in {name} needs require "variables"')
        if name == "vacation" and ":days" in args.tags and int(args.tags[":days"]) < 0:  # type: ignore[call-overload]
            raise SieveError(f"line {line}: :days must be >= 0")


def _value(item: object, kind: str, what: str) -> object:
    if kind == N:
        if not isinstance(item, Number):
            raise SieveError(f"line {_line(item)}: {what} needs a number")
        return item.value
    if not isinstance(item, Strings):
        raise SieveError(f"line {_line(item)}: {what} needs a {'string' if kind == S else 'string list'}")
    if kind == S:
        if not item.single:
            raise SieveError(f"line {item.line}: {what} needs one string, not a list")
        return item.values[0]
    return list(item.values)


def _line(item: object) -> int:
    return int(getattr(item, "line", 0))


def _regex(pattern: str, casemap: bool, limits: Limits) -> regex.Pattern[str]:
    if len(pattern) > limits.max_regex_length:
        raise SieveError(f"regular expression longer than {limits.max_regex_length} characters")
    try:
        return regex.compile(pattern, regex.IGNORECASE | regex.ASCII if casemap else 0)
    except regex.error as exc:
        raise SieveError(f"bad regular expression {pattern!r}: {exc}") from None


# --------------------------------------------------------------------------- running

@dataclass(frozen=True)
class Keep:
    flags: frozenset[str]


@dataclass(frozen=True)
class FileInto:
    mailbox: str
    flags: frozenset[str]
    create: bool


@dataclass(frozen=True)
class Redirect:
    address: str


@dataclass(frozen=True)
class Reject:
    reason: str
    extended: bool


@dataclass(frozen=True)
class Discard:
    pass


@dataclass(frozen=True)
class Vacation:
    reason: str
    subject: str | None
    sender: str | None
    addresses: tuple[str, ...]
    seconds: int | None
    mime: bool
    handle: str


Action = Keep | FileInto | Redirect | Reject | Discard | Vacation


@dataclass(frozen=True)
class Envelope:
    """What a script sees of the SMTP envelope: the sender ("" for <>) and the recipient as the
    sender wrote it (with a `+detail`, if any)."""

    sender: str
    recipient: str


class Message:
    """The message as a script reads it: headers decoded once, the body walked only when a body
    test asks."""

    def __init__(self, raw: bytes | bytearray | memoryview, max_body_bytes: int) -> None:
        self.raw = raw  # a memoryview for a message in a spool file (cassmail.smtp.spool)
        self.size = len(raw)
        self.max_body_bytes = max_body_bytes
        self._parsed: email.message.Message | None = None
        self._headers: dict[str, list[str]] = {}
        found = _HEADER_END.search(raw)
        head = bytes(raw if found is None else raw[:found.start() + 2])
        #: Where the body starts (the message's end when it has no empty line).
        self._body_at = len(raw) if found is None else found.start() + 4
        for name, value in BytesHeaderParser(policy=email.policy.compat32).parsebytes(head).items():
            self._headers.setdefault(name.lower(), []).append(value)

    @property
    def parsed(self) -> email.message.Message:
        """The whole MIME tree, parsed on first use (only the body test needs it), from at most
        max_body_bytes past the header."""
        if self._parsed is None:
            end = self._body_at + self.max_body_bytes
            self._parsed = email.message_from_bytes(bytes(self.raw[:end]), policy=email.policy.compat32)
        return self._parsed

    def raw_headers(self, name: str) -> list[str]:
        return [str(v) for v in self._headers.get(name.lower(), [])]

    def headers(self, name: str) -> list[str]:
        return [_decoded(v) for v in self.raw_headers(name)]

    def body_raw(self) -> str:
        return bytes(self.raw[self._body_at:self._body_at + self.max_body_bytes]).decode("utf-8", "replace")

    def body_parts(self, types: Sequence[str] | None) -> list[str]:
        """Decoded text of the leaf parts whose type matches (RFC 5173 :content; :text is "text")."""
        out: list[str] = []
        budget = self.max_body_bytes
        for part in self.parsed.walk():
            if part.is_multipart() or budget <= 0:
                continue
            ctype = part.get_content_type().lower()
            main = ctype.split("/")[0]
            if types is not None and not any(t == "" or t.lower() in (ctype, main) for t in types):
                continue
            payload = part.get_payload(decode=True)
            if not isinstance(payload, bytes):
                continue
            payload = payload[:budget]
            budget -= len(payload)
            charset = part.get_content_charset() or "us-ascii"
            try:
                text = payload.decode(charset, "replace")
            except LookupError:
                text = payload.decode("utf-8", "replace")
            out.append(text)
        return out


def _decoded(value: str) -> str:
    """A header value unfolded and with RFC 2047 words decoded; undecodable words are kept raw."""
    unfolded = re.sub(r"\r?\n[ \t]", " ", value)
    if "=?" not in unfolded:
        return unfolded
    try:
        return str(make_header(decode_header(unfolded)))
    except (ValueError, LookupError, UnicodeError, AssertionError):
        return unfolded


class _Stop(Exception):
    pass


class Run:
    """One evaluation of one script on one message."""

    def __init__(self, script: Script, message: Message, envelope: Envelope, mailboxes: Iterable[str],
                 limits: Limits, now: datetime | None = None) -> None:
        self.script, self.message, self.envelope, self.limits = script, message, envelope, limits
        self.mailboxes = {m.lower() if m.upper() == "INBOX" else m for m in mailboxes}
        self.now = now or datetime.now(timezone.utc)
        self.variables: dict[str, str] = {}
        self.matches: list[str] = []
        self.flags: set[str] = set()
        self.actions: list[Action] = []
        self.keep_cancelled = False
        self.variables_on = "variables" in script.required

    # ----------------------------------------------------------------- commands
    def run(self) -> list[Action]:
        try:
            self.block(self.script.commands)
        except _Stop:
            pass
        kinds = {type(a) for a in self.actions}
        if Reject in kinds and (kinds & {Keep, FileInto, Vacation} or any(
                isinstance(a, Redirect) for a in self.actions)):
            raise SieveRuntimeError("reject cannot be combined with keep, fileinto, redirect or vacation")
        if not self.keep_cancelled:
            self.actions.append(Keep(frozenset(self.flags)))
        return self.actions

    def block(self, commands: Sequence[Command]) -> None:
        branch_taken = False
        for command in commands:
            args: Args = command.compiled  # type: ignore[assignment]
            name = command.name
            if name == "if":
                branch_taken = self.test(args.tests[0])
                if branch_taken:
                    self.block(command.block or [])
            elif name == "elsif":
                if not branch_taken:
                    branch_taken = self.test(args.tests[0])
                    if branch_taken:
                        self.block(command.block or [])
            elif name == "else":
                if not branch_taken:
                    self.block(command.block or [])
                branch_taken = True
            else:
                self.action(name, args)

    def act(self, action: Action, cancels_keep: bool) -> None:
        if len(self.actions) >= self.limits.max_actions:
            raise SieveRuntimeError(f"more than {self.limits.max_actions} actions")
        if isinstance(action, Redirect):
            if sum(isinstance(a, Redirect) for a in self.actions) >= self.limits.max_redirects:
                raise SieveRuntimeError(f"more than {self.limits.max_redirects} redirects")
        if isinstance(action, Vacation) and any(isinstance(a, Vacation) for a in self.actions):
            raise SieveRuntimeError("vacation given twice")
        if action not in self.actions:
            self.actions.append(action)
        if cancels_keep:
            self.keep_cancelled = True

    def action(self, name: str, args: Args) -> None:
        tags, pos = args.tags, args.positional
        if name == "stop":
            raise _Stop
        if name == "keep":
            self.act(Keep(self.flag_value(tags)), False)
            self.keep_cancelled = True
        elif name == "discard":
            self.act(Discard(), True)
        elif name == "fileinto":
            mailbox = self.expand(str(pos[0]))
            self.act(FileInto(mailbox, self.flag_value(tags), ":create" in tags), ":copy" not in tags)
        elif name == "redirect":
            self.act(Redirect(self.expand(str(pos[0])).strip()), ":copy" not in tags)
        elif name in ("reject", "ereject"):
            self.act(Reject(self.expand(str(pos[0])), name == "ereject"), True)
        elif name in ("setflag", "addflag", "removeflag"):
            flags = _flag_words(self.expand_all(pos[1]))  # type: ignore[arg-type]
            if pos[0] is None:
                current = self.flags
            else:
                current = set(_flag_words([self.variables.get(self.expand(str(pos[0])).lower(), "")]))
            if name == "setflag":
                current = set(flags)
            elif name == "addflag":
                current = current | set(flags)
            else:
                lowered = {f.lower() for f in flags}
                current = {f for f in current if f.lower() not in lowered}
            if pos[0] is None:
                self.flags = current
            else:
                self.set_variable(self.expand(str(pos[0])), " ".join(sorted(current)))
        elif name == "set":
            value = self.expand(str(pos[1]))
            value = _modify(value, tags)
            self.set_variable(str(pos[0]), value)
        elif name == "vacation":
            seconds: int | None = None
            if ":days" in tags:
                seconds = int(tags[":days"]) * 86400  # type: ignore[call-overload]
            elif ":seconds" in tags:
                seconds = int(tags[":seconds"])  # type: ignore[call-overload]
            reason = self.expand(str(pos[0]))
            subject = self.expand(str(tags[":subject"])) if ":subject" in tags else None
            sender = self.expand(str(tags[":from"])) if ":from" in tags else None
            addresses = tuple(self.expand_all(tags.get(":addresses") or []))  # type: ignore[arg-type]
            handle = self.expand(str(tags[":handle"])) if ":handle" in tags else "\0".join(
                [reason, subject or "", sender or "", "mime" if ":mime" in tags else ""])
            self.act(Vacation(reason, subject, sender, addresses, seconds, ":mime" in tags, handle), False)
        else:  # pragma: no cover - compile_script lets no other name through
            raise SieveRuntimeError(f"unknown command {name}")

    def flag_value(self, tags: dict[str, object]) -> frozenset[str]:
        if ":flags" in tags:
            return frozenset(_flag_words(self.expand_all(tags[":flags"])))  # type: ignore[arg-type]
        return frozenset(self.flags)

    def set_variable(self, name: str, value: str) -> None:
        self.variables[name.lower()] = value[: self.limits.max_variable_length]

    # ----------------------------------------------------------------- variables
    def expand(self, text: str) -> str:
        if not self.variables_on or "${" not in text:
            return text
        out = _VARIABLE_REF.sub(self._lookup, text)
        return out[: self.limits.max_variable_length * 4]

    def _lookup(self, match: re.Match[str]) -> str:
        name = match.group(1)
        if name.isdigit():
            index = int(name)
            return self.matches[index] if index < len(self.matches) else ""
        if "." in name:  # namespaces (e.g. envelope.from) this interpreter does not have: empty
            return ""
        return self.variables.get(name.lower(), "")

    def expand_all(self, values: Iterable[str]) -> list[str]:
        return [self.expand(str(v)) for v in values]

    # ----------------------------------------------------------------- tests
    def test(self, test: Test) -> bool:
        args: Args = test.compiled  # type: ignore[assignment]
        name, tags, pos = test.name, args.tags, args.positional
        if name == "true":
            return True
        if name == "false":
            return False
        if name == "not":
            return not self.test(args.tests[0])
        if name == "allof":
            return all(self.test(t) for t in args.tests)
        if name == "anyof":
            return any(self.test(t) for t in args.tests)
        if name == "size":
            limit = int(pos[0])  # type: ignore[call-overload]
            return self.message.size > limit if ":over" in tags else self.message.size < limit
        if name == "exists":
            return all(self.message.raw_headers(h) for h in self.expand_all(pos[0]))  # type: ignore[arg-type]
        if name == "mailboxexists":
            wanted = self.expand_all(pos[0])  # type: ignore[arg-type]
            return all((m.lower() if m.upper() == "INBOX" else m) in self.mailboxes for m in wanted)
        keys = self.expand_all(pos[-1])  # type: ignore[arg-type]
        values: list[str]
        if name == "header":
            values = self.indexed([v for h in self.expand_all(pos[0]) for v in self.message.headers(h)], tags)  # type: ignore[arg-type]
        elif name == "address":
            values = []
            for h in self.expand_all(pos[0]):  # type: ignore[arg-type]
                found = [a for _, a in getaddresses(self.indexed(self.message.headers(h), tags)) if a]
                values += [p for a in found if (p := _address_part(a, tags)) is not None]
        elif name == "envelope":
            values = []
            for part in self.expand_all(pos[0]):  # type: ignore[arg-type]
                part = part.lower()
                address = self.envelope.sender if part == "from" else self.envelope.recipient if part == "to" else None
                if address is None:
                    continue
                if address == "":
                    values.append("")
                elif (p := _address_part(address, tags)) is not None:
                    values.append(p)
        elif name == "body":
            if ":raw" in tags:
                values = [self.message.body_raw()]
            else:
                types = self.expand_all(tags[":content"]) if ":content" in tags else ["text"]  # type: ignore[arg-type]
                values = self.message.body_parts(types)
            if not any(t in tags for t in _MATCH):  # RFC 5173: the body test matches :contains by default
                tags = {**tags, ":contains": True}
        elif name == "hasflag":
            if pos[0] is None:
                values = sorted(self.flags)
            else:
                values = _flag_words([self.variables.get(v.lower(), "") for v in self.expand_all(pos[0])])  # type: ignore[arg-type]
        elif name == "string":
            values = [v for v in self.expand_all(pos[0]) if v != "" or ":count" not in tags]  # type: ignore[arg-type]
        elif name == "date":
            values = []
            zone = tags.get(":zone")
            for text in self.indexed(self.message.headers(self.expand(str(pos[0]))), tags):
                try:
                    when = parsedate_to_datetime(text.split(";")[-1].strip())
                except (TypeError, ValueError, IndexError):
                    continue
                if when.tzinfo is None:
                    when = when.replace(tzinfo=timezone.utc)
                if ":originalzone" not in tags:
                    when = when.astimezone(_zone(self.expand(str(zone))) if zone else timezone.utc)
                part = _date_part(when, self.expand(str(pos[1])))
                if part is not None:
                    values.append(part)
        elif name == "currentdate":
            zone = tags.get(":zone")
            when = self.now.astimezone(_zone(self.expand(str(zone))) if zone else timezone.utc)
            part = _date_part(when, self.expand(str(pos[0])))
            values = [] if part is None else [part]
        else:  # pragma: no cover - compile_script lets no other name through
            raise SieveRuntimeError(f"unknown test {name}")
        return self.match(values, keys, tags)

    def indexed(self, values: list[str], tags: dict[str, object]) -> list[str]:
        """RFC 5260 :index (1 = first, or last with :last): only that occurrence, if any."""
        if ":index" not in tags:
            return values
        index = int(tags[":index"])  # type: ignore[call-overload]
        if index < 1 or index > len(values):
            return []
        return [values[-index] if ":last" in tags else values[index - 1]]

    def match(self, values: list[str], keys: list[str], tags: dict[str, object]) -> bool:
        comparator = str(tags.get(":comparator", "i;ascii-casemap"))
        if ":count" in tags:
            relation = str(tags[":count"]).lower()
            return any(_relate(_compare(str(len(values)), key, "i;ascii-numeric"), relation) for key in keys)
        if ":value" in tags:
            relation = str(tags[":value"]).lower()
            return any(_relate(_compare(v, key, comparator), relation) for v in values for key in keys)
        for value in values:
            for key in keys:
                if ":contains" in tags:
                    hit = (key.lower() in value.lower()) if comparator == "i;ascii-casemap" else key in value
                    if comparator == "i;ascii-numeric":
                        raise SieveRuntimeError("i;ascii-numeric does not do :contains")
                    if hit:
                        return True
                elif ":matches" in tags:
                    if comparator == "i;ascii-numeric":
                        raise SieveRuntimeError("i;ascii-numeric does not do :matches")
                    found = _glob(key, comparator == "i;ascii-casemap").fullmatch(value)
                    if found:
                        self.matches = [found.group(0), *found.groups()][:10]
                        return True
                elif ":regex" in tags:
                    pattern = _regex(key, comparator == "i;ascii-casemap", self.limits)
                    try:
                        found = pattern.search(value, timeout=self.limits.regex_timeout)
                    except TimeoutError:
                        raise SieveRuntimeError(f"regular expression {key[:60]!r} took longer than "
                                                f"{self.limits.regex_timeout} s") from None
                    if found:
                        self.matches = [found.group(0), *(g or "" for g in found.groups())][:10]
                        return True
                elif _compare(value, key, comparator) == 0:
                    return True
        return False


_VARIABLE_REF = re.compile(r"\$\{([A-Za-z0-9_.]+)\}")


def _flag_words(values: Iterable[str]) -> list[str]:
    words: list[str] = []
    for value in values:
        for word in value.split():
            if word.lower() not in (w.lower() for w in words):
                words.append(word)
    return words


def _modify(value: str, tags: dict[str, object]) -> str:
    """RFC 5229 4.1: the modifiers apply in precedence order."""
    if ":lower" in tags:
        value = value.lower()
    if ":upper" in tags:
        value = value.upper()
    if ":lowerfirst" in tags:
        value = value[:1].lower() + value[1:]
    if ":upperfirst" in tags:
        value = value[:1].upper() + value[1:]
    if ":quotewildcard" in tags:
        value = re.sub(r"([*?\\])", r"\\\1", value)
    if ":quoteregex" in tags:
        value = re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\1", value)
    if ":encodeurl" in tags:
        from urllib.parse import quote

        value = quote(value, safe="-._~")
    if ":length" in tags:
        value = str(len(value))
    return value


def _address_part(address: str, tags: dict[str, object]) -> str | None:
    local, at, domain = address.rpartition("@")
    if not at:
        local, domain = address, ""
    if ":localpart" in tags:
        return local
    if ":domain" in tags:
        return domain
    if ":user" in tags:
        return local.split("+", 1)[0]
    if ":detail" in tags:
        return local.split("+", 1)[1] if "+" in local else None
    return address


def _numeric(text: str) -> int | None:
    digits = re.match(r"\d+", text)
    return int(digits.group()) if digits else None


def _compare(value: str, key: str, comparator: str) -> int:
    """-1, 0 or 1 under the comparator (RFC 4790); i;ascii-numeric puts non-numbers last."""
    if comparator == "i;ascii-numeric":
        a, b = _numeric(value), _numeric(key)
        if a is None or b is None:
            return (a is None) - (b is None)
        return (a > b) - (a < b)
    if comparator == "i;ascii-casemap":
        value, key = _ascii_lower(value), _ascii_lower(key)
    return (value > key) - (value < key)


def _ascii_lower(text: str) -> str:
    return text.translate(_ASCII_LOWER)


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def _relate(order: int, relation: str) -> bool:
    return {"gt": order > 0, "ge": order >= 0, "lt": order < 0, "le": order <= 0, "eq": order == 0,
            "ne": order != 0}[relation]


_GLOB_CACHE: dict[tuple[str, bool], re.Pattern[str]] = {}


def _glob(key: str, casemap: bool) -> re.Pattern[str]:
    """A :matches pattern as a regular expression; each wildcard is a group for ${1}..${9}."""
    cached = _GLOB_CACHE.get((key, casemap))
    if cached is not None:
        return cached
    out, i = [], 0
    while i < len(key):
        c = key[i]
        if c == "\\" and i + 1 < len(key):
            out.append(re.escape(key[i + 1]))
            i += 2
            continue
        out.append("(.*?)" if c == "*" else "(.)" if c == "?" else re.escape(c))
        i += 1
    pattern = re.compile("".join(out), re.DOTALL | (re.IGNORECASE | re.ASCII if casemap else 0))
    if len(_GLOB_CACHE) > 1024:
        _GLOB_CACHE.clear()
    _GLOB_CACHE[(key, casemap)] = pattern
    return pattern


def _zone(text: str) -> timezone:
    match = _ZONE_TEXT.match(text)
    if not match:
        raise SieveRuntimeError(f"bad zone {text!r}")
    minutes = int(match.group(1)) * 60 + int(match.group(2))
    return timezone(timedelta(minutes=-minutes if text.startswith("-") else minutes))


def _date_part(when: datetime, part: str) -> str | None:
    part = part.lower()
    offset = when.utcoffset() or timedelta(0)
    total = int(offset.total_seconds() // 60)
    zone = f"{'-' if total < 0 else '+'}{abs(total) // 60:02d}{abs(total) % 60:02d}"
    if part == "year":
        return f"{when.year:04d}"
    if part == "month":
        return f"{when.month:02d}"
    if part == "day":
        return f"{when.day:02d}"
    if part == "date":
        return f"{when.year:04d}-{when.month:02d}-{when.day:02d}"
    if part == "julian":
        return str((when.date() - datetime(1858, 11, 17).date()).days)
    if part == "hour":
        return f"{when.hour:02d}"
    if part == "minute":
        return f"{when.minute:02d}"
    if part == "second":
        return f"{when.second:02d}"
    if part == "time":
        return f"{when.hour:02d}:{when.minute:02d}:{when.second:02d}"
    if part == "iso8601":
        return when.strftime("%Y-%m-%dT%H:%M:%S") + zone[:3] + ":" + zone[3:]
    if part == "std11":
        return when.strftime("%a, %d %b %Y %H:%M:%S ") + zone
    if part == "zone":
        return zone
    if part == "weekday":
        return str((when.weekday() + 1) % 7)
    return None


def run(script: Script, message: Message, envelope: Envelope, mailboxes: Iterable[str], limits: Limits,
        now: datetime | None = None) -> list[Action]:
    """The actions a script decides for a message, implicit keep included; SieveRuntimeError when
    it fails (the caller keeps the message in INBOX)."""
    return Run(script, message, envelope, mailboxes, limits, now).run()


def check(text: str, limits: Limits = Limits()) -> str | None:
    """None when a script is valid, else why not (ManageSieve's CHECKSCRIPT)."""
    try:
        compile_script(text, limits)
    except SieveError as exc:
        return str(exc)
    return None


__all__ = ["Action", "Discard", "EXTENSIONS", "Envelope", "FileInto", "Keep", "Limits", "Message", "Redirect",
           "Reject", "Script", "SieveError", "SieveRuntimeError", "Vacation", "check", "compile_script", "run"]
