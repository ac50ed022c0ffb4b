"""The Sieve grammar (RFC 5228 section 8): text to a tree of commands and tests.

This is syntax only; which commands, tags and extensions exist is checked by
`cassmail.sieve.script.compile_script`. The parser is our own because the one
on PyPI (sievelib) rejects things filter editors write: the subaddress
address parts, `:index`, `ereject` and comparators other than octet and
ascii-casemap.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

#: Nesting of blocks and tests a script may use; deeper is refused (bounded recursion).
MAX_DEPTH = 32


class SieveSyntaxError(ValueError):
    """A script that is not Sieve; str() says where and why, for ManageSieve's NO answer."""

    def __init__(self, message: str, line: int) -> None:
        super().__init__(f"line {line}: {message}")
        self.line = line


@dataclass(frozen=True, slots=True)
class Tag:
    name: str  # lower case, with the colon
    line: int


@dataclass(frozen=True, slots=True)
class Number:
    value: int
    line: int


@dataclass(frozen=True, slots=True)
class Strings:
    """A string or a string list; `single` tells which was written (some arguments take one)."""

    values: tuple[str, ...]
    single: bool
    line: int


Argument = Tag | Number | Strings


@dataclass(slots=True)
class Test:
    name: str
    arguments: list[Argument]
    tests: list[Test]
    line: int
    #: Filled in by compile_script: the arguments sorted out by the test's signature.
    compiled: object = field(default=None, repr=False)


@dataclass(slots=True)
class Command:
    name: str
    arguments: list[Argument]
    tests: list[Test]
    block: list[Command] | None
    line: int
    #: Filled in by compile_script: the arguments sorted out by the command's signature.
    compiled: object = field(default=None, repr=False)


_TOKEN = re.compile(
    r"""
      (?P<ws>[ \t\r\n]+)
    | (?P<hash>\#[^\n]*)
    | (?P<bracket>/\*.*?\*/)
    | (?P<multiline>text:[ \t]*(?:\#[^\n]*)?\r?\n)
    | (?P<quoted>"(?:[^"\\]|\\.)*")
    | (?P<tag>:[A-Za-z_][A-Za-z0-9_]*)
    | (?P<number>[0-9]+[KMGkmg]?)
    | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
    | (?P<punct>[\[\](){},;])
    """,
    re.VERBOSE | re.DOTALL,
)
_MULTILINE_END = re.compile(r"\r?\n\.\r?\n")
_QUOTED_ESCAPE = re.compile(r"\\(.)", re.DOTALL)
_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
#: Numbers are unsigned 63-bit at most, like the counters they are compared with.
MAX_NUMBER = 2**63 - 1


@dataclass(frozen=True, slots=True)
class _Token:
    kind: str
    value: str | int
    line: int


def _tokens(text: str) -> list[_Token]:
    out: list[_Token] = []
    pos, line = 0, 1
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            if text.startswith("/*", pos):
                raise SieveSyntaxError("unterminated /* comment", line)
            raise SieveSyntaxError(f"unexpected character {text[pos]!r}", line)
        kind = match.lastgroup or ""
        raw = match.group()
        start_line = line
        if kind == "multiline":
            end = _MULTILINE_END.search(text, match.end() - 1)
            if end is None:
                raise SieveSyntaxError("multi-line string without its closing '.' line", line)
            # The line break before the closing dot ends the last line of the string.
            body = text[match.end():end.start()] + "\n" if end.start() >= match.end() else ""
            lines = body.split("\n")
            value = "\n".join(item[1:] if item.startswith("..") else item for item in lines)
            value = value.replace("\r\n", "\n").replace("\n", "\r\n")
            raw = text[match.start():end.end()]
            out.append(_Token("string", value, start_line))
            pos = end.end()
            line += raw.count("\n")
            continue
        if kind in ("bracket", "hash", "ws"):
            pass
        elif kind == "quoted":
            out.append(_Token("string", _QUOTED_ESCAPE.sub(r"\1", raw[1:-1]), start_line))
        elif kind == "number":
            unit = _UNITS.get(raw[-1].lower(), 1)
            digits = raw[:-1] if unit > 1 else raw
            value = int(digits) * unit
            if value > MAX_NUMBER:
                raise SieveSyntaxError(f"number {raw} is too large", line)
            out.append(_Token("number", value, start_line))
        elif kind == "tag":
            out.append(_Token("tag", raw.lower(), start_line))
        elif kind == "ident":
            out.append(_Token("ident", raw.lower(), start_line))
        else:
            out.append(_Token(raw, raw, start_line))
        line += raw.count("\n")
        pos = match.end()
    return out


class _Parser:
    def __init__(self, text: str) -> None:
        self.tokens = _tokens(text)
        self.pos = 0

    def peek(self) -> _Token | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self, kind: str | None = None) -> _Token:
        token = self.peek()
        if token is None:
            last = self.tokens[-1].line if self.tokens else 1
            raise SieveSyntaxError(f"unexpected end of script{f', expected {kind!r}' if kind else ''}", last)
        if kind is not None and token.kind != kind:
            raise SieveSyntaxError(f"expected {kind!r}, found {token.value!r}", token.line)
        self.pos += 1
        return token

    def commands(self, depth: int, closing: str | None) -> list[Command]:
        if depth > MAX_DEPTH:
            raise SieveSyntaxError(f"blocks nested deeper than {MAX_DEPTH}", self.peek().line if self.peek() else 1)
        out: list[Command] = []
        while True:
            token = self.peek()
            if token is None:
                if closing is not None:
                    raise SieveSyntaxError("missing '}'", self.tokens[-1].line if self.tokens else 1)
                return out
            if closing is not None and token.kind == closing:
                self.pos += 1
                return out
            out.append(self.command(depth))

    def command(self, depth: int) -> Command:
        name = self.take("ident")
        arguments, tests = self.arguments(depth)
        token = self.take()
        if token.kind == ";":
            return Command(str(name.value), arguments, tests, None, name.line)
        if token.kind == "{":
            return Command(str(name.value), arguments, tests, self.commands(depth + 1, "}"), name.line)
        raise SieveSyntaxError(f"expected ';' or '{{' after {name.value}, found {token.value!r}", token.line)

    def arguments(self, depth: int) -> tuple[list[Argument], list[Test]]:
        arguments: list[Argument] = []
        while True:
            token = self.peek()
            if token is None:
                return arguments, []
            if token.kind == "tag":
                self.pos += 1
                arguments.append(Tag(str(token.value), token.line))
            elif token.kind == "number":
                self.pos += 1
                arguments.append(Number(int(token.value), token.line))
            elif token.kind == "string":
                self.pos += 1
                arguments.append(Strings((str(token.value),), True, token.line))
            elif token.kind == "[":
                arguments.append(self.string_list())
            elif token.kind == "ident":
                return arguments, [self.test(depth + 1)]
            elif token.kind == "(":
                return arguments, self.test_list(depth + 1)
            else:
                return arguments, []

    def string_list(self) -> Strings:
        opening = self.take("[")
        values = [str(self.take("string").value)]
        while True:
            token = self.take()
            if token.kind == "]":
                return Strings(tuple(values), False, opening.line)
            if token.kind != ",":
                raise SieveSyntaxError(f"expected ',' or ']' in a string list, found {token.value!r}", token.line)
            values.append(str(self.take("string").value))

    def test(self, depth: int) -> Test:
        if depth > MAX_DEPTH:
            raise SieveSyntaxError(f"tests nested deeper than {MAX_DEPTH}", self.peek().line if self.peek() else 1)
        name = self.take("ident")
        arguments, tests = self.arguments(depth)
        return Test(str(name.value), arguments, tests, name.line)

    def test_list(self, depth: int) -> list[Test]:
        self.take("(")
        tests = [self.test(depth)]
        while True:
            token = self.take()
            if token.kind == ")":
                return tests
            if token.kind != ",":
                raise SieveSyntaxError(f"expected ',' or ')' in a test list, found {token.value!r}", token.line)
            tests.append(self.test(depth))


def parse(text: str) -> list[Command]:
    """The commands of a script, or SieveSyntaxError."""
    return _Parser(text).commands(0, None)
