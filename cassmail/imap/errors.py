"""How a command fails: a tagged NO (with its RFC 5530 response code) or a tagged BAD."""

from __future__ import annotations


class No(Exception):
    """A tagged NO; `code` goes in brackets."""

    def __init__(self, text: str, code: str | None = None) -> None:
        super().__init__(text)
        self.text = f"[{code}] {text}" if code else text


class Bad(Exception):
    """A tagged BAD: the client's syntax or protocol was wrong. The text is a fixed description."""
