"""WheelFS semantic cues as path components, built and read by pure functions.

WheelFS takes its cues from the path: a component such as `.RepLevel=2` is no
directory but an instruction that applies to every component after it, and a
later cue of the same name overrides an earlier one. Cues are of two kinds
(the paper's Table 1): placement and durability cues (`.Site`, `.KeepTogether`,
`.RepSites`, `.RepLevel`) are *persistent*, recorded with an object when it is
created and ignored on every later access; the others (`.SyncLevel`,
`.MaxTime`, `.WholeFile`, `.Hotspot`) are *transient*, for the one operation.
`.EventualConsistency` is transient, and on a directory also persistent when
given at its creation (replicas of such a directory are merged by union).

On a plain POSIX file system the same components are ordinary directories, so
the store always uses one fixed prefix per consistency class and never varies
cues between operations: a path names the same file on either kind of mount.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

#: Cue name -> (takes a value, persistent at creation, transient on access).
CUES: dict[str, tuple[bool, bool, bool]] = {
    "Site": (True, True, False),
    "KeepTogether": (False, True, False),
    "RepSites": (True, True, False),
    "RepLevel": (True, True, False),
    "SyncLevel": (True, False, True),
    "EventualConsistency": (False, True, True),
    "MaxTime": (True, False, True),
    "WholeFile": (False, False, True),
    "Hotspot": (False, False, True),
}
#: WheelFS keeps at most this many replicas of an object.
MAX_REP_LEVEL = 4
_NUMERIC = {"RepSites", "RepLevel", "SyncLevel", "MaxTime"}


class CueError(ValueError):
    """A cue WheelFS would not accept (unknown name, missing or bad value, RepLevel > 4)."""


@dataclass(frozen=True, slots=True)
class Cue:
    name: str
    value: str | None = None

    def __post_init__(self) -> None:
        if self.name not in CUES:
            raise CueError(f"unknown WheelFS cue .{self.name}")
        takes_value = CUES[self.name][0]
        if takes_value != (self.value is not None):
            raise CueError(f".{self.name} {'needs' if takes_value else 'takes no'} value")
        if self.value is not None:
            if not self.value or any(c in self.value for c in "/=\0"):
                raise CueError(f"bad value for .{self.name}: {self.value!r}")
            if self.name in _NUMERIC:
                if not self.value.isdigit() or int(self.value) < 1:
                    raise CueError(f".{self.name} needs a positive integer, got {self.value!r}")
                if self.name == "RepLevel" and int(self.value) > MAX_REP_LEVEL:
                    raise CueError(f".RepLevel is at most {MAX_REP_LEVEL}, got {self.value}")

    @property
    def persistent(self) -> bool:
        return CUES[self.name][1]

    @property
    def transient(self) -> bool:
        return CUES[self.name][2]

    def component(self) -> str:
        return f".{self.name}" if self.value is None else f".{self.name}={self.value}"


def parse_component(text: str) -> Cue | None:
    """The cue a path component spells, or None for an ordinary name."""
    if not text.startswith("."):
        return None
    name, sep, value = text[1:].partition("=")
    if name not in CUES:
        return None
    return Cue(name, value if sep else None)


def build(cues: Iterable[Cue]) -> list[str]:
    """Path components for `cues` in the order given; a repeated cue keeps only its last value,
    at the place of its first mention (the later cue overrides the earlier, as in WheelFS)."""
    order: dict[str, Cue] = {}
    for cue in cues:
        order[cue.name] = cue  # dict keeps the first position, takes the last value
    return [cue.component() for cue in order.values()]


@dataclass(frozen=True, slots=True)
class Resolved:
    """What a WheelFS path means: the plain path and the cues in force for its last component."""

    plain: tuple[str, ...]
    cues: dict[str, Cue]


def resolve(components: Sequence[str], creating: bool) -> Resolved:
    """Read a path as WheelFS does: cues apply to what follows, later ones override earlier ones;
    persistent cues count only when the operation creates the object (`creating`)."""
    plain: list[str] = []
    cues: dict[str, Cue] = {}
    for part in components:
        cue = parse_component(part)
        if cue is None:
            plain.append(part)
        else:
            cues[cue.name] = cue
    in_force = {n: c for n, c in cues.items() if c.transient or (creating and c.persistent)}
    return Resolved(tuple(plain), in_force)


def store_cues(
    *,
    eventual: bool,
    eventual_consistency: bool = True,
    home_site: str = "",
    keep_together: bool = True,
    rep_sites: int = 0,
    rep_level: int = 3,
    sync_level: int = 0,
    max_time: int = 0,
) -> list[Cue]:
    """The cues of one of the store's two trees.

    The strong tree (accounts, mailbox lists, UID claims) never has
    `.EventualConsistency`, `.SyncLevel` or `.MaxTime`: an exclusive create there
    is a compare-and-set only if every replica agrees. The mail tree takes them
    all, as the paper's Wheemail did.
    """
    out: list[Cue] = []
    if eventual and eventual_consistency:
        out.append(Cue("EventualConsistency"))
    if eventual and max_time:
        out.append(Cue("MaxTime", str(max_time)))
    if home_site:
        out.append(Cue("Site", home_site))
    if keep_together:
        out.append(Cue("KeepTogether"))
    if rep_sites:
        out.append(Cue("RepSites", str(rep_sites)))
    out.append(Cue("RepLevel", str(rep_level)))
    if eventual and sync_level:
        out.append(Cue("SyncLevel", str(sync_level)))
    return out


__all__ = ["CUES", "MAX_REP_LEVEL", "Cue", "CueError", "Resolved", "build", "parse_component", "resolve", "store_cues"]
