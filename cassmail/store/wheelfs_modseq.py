"""What the WheelFS store knows of a mailbox's two claim chains: UIDs and MODSEQs (RFC 7162).

Both chains are files made by exclusive create (O_EXCL) in the strong tree, one name after the
other, never removed and never rewritten, so a process reads each claim once and keeps here
what it said (wheelfs.py does the reading; this module is the bookkeeping, without I/O):

- `uids/<mailbox>/<n>`: UID n went to a message. The claim names the message and the MODSEQ
  claim that sequences the numbering; one made before the store kept MODSEQs names the message
  alone (MODSEQ 1). A renumbered message holds several claims: its UID is the highest, and each
  UID it gave up is remembered as vanished with the MODSEQ of the claim that replaced it.
- `modseqs/<mailbox>/<n>`, n from 2 (no change is given 1): MODSEQ n sequences one change, a
  JSON line whose "k" says which: "n" a numbering (its UID claims name n), "f" a flag change
  (mode, flags and the sids of the messages whose flags it changed) or "x" an expunge (the UIDs
  it made vanish, when, and the floor: expunges up to that MODSEQ, older than vanished_keep when
  it was written, are forgotten; the floor is in the chain, so every process forgets the same).

A message's MODSEQ is the highest claim naming one of its changes. Its flags are the ones it was
delivered with (marker and keyword record, in the mail tree) changed by each "f" claim naming
it, in MODSEQ order. A checkpoint sums both chains up to a point (the messages' UIDs, MODSEQs
and flag changes, the expunges still remembered), so a process that starts reads it and the
claims made since, not every claim ever made.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection, Container
from dataclasses import dataclass, field
from typing import Any

from cassmail.model import sortable_id

#: No change is given MODSEQ 1: it is the MODSEQ of messages numbered before the store kept
#: MODSEQs and the HIGHESTMODSEQ of a mailbox where nothing was numbered.
FIRST_MODSEQ = 2
#: Claims (UIDs and MODSEQs) read since the last checkpoint after which a listing writes a new one
#: (or more: a quarter of the entries of the last one, so writing them costs little per claim).
CHECKPOINT_EVERY = 256
FLAG_MODES = ("set", "add", "remove")


class _Abandoned:
    def __repr__(self) -> str:
        return "ABANDONED"


#: What a claim reads as when it was left empty (or half written) for claim_timeout: its claimer died.
ABANDONED: Any = _Abandoned()


@dataclass(frozen=True, slots=True)
class FlagEffect:
    """The flag changes sequenced so far on one message, folded into one: its flags are `replace`
    after a "set", else the ones it was delivered with less `remove` plus `add`; `modseq` is that
    of the last change."""

    modseq: int
    replace: frozenset[str] | None = None
    add: frozenset[str] = frozenset()
    remove: frozenset[str] = frozenset()

    def then(self, modseq: int, mode: str, flags: frozenset[str]) -> FlagEffect:
        if mode == "set":
            return FlagEffect(modseq, flags)
        if self.replace is not None:
            return FlagEffect(modseq, self.replace | flags if mode == "add" else self.replace - flags)
        if mode == "add":
            return FlagEffect(modseq, None, self.add | flags, self.remove - flags)
        return FlagEffect(modseq, None, self.add - flags, self.remove | flags)

    def apply(self, delivered: frozenset[str]) -> frozenset[str]:
        return self.replace if self.replace is not None else (delivered - self.remove) | self.add


def changed_flags(current: frozenset[str], mode: str, flags: frozenset[str]) -> frozenset[str]:
    return flags if mode == "set" else current | flags if mode == "add" else current - flags


@dataclass
class Chains:
    """What one process has read of a mailbox's UID and MODSEQ claims."""

    next_uid: int = 1  # the first UID claim not read yet
    uid_of: dict[uuid.UUID, int] = field(default_factory=dict)  # each numbered message's UID
    numbered: dict[uuid.UUID, int] = field(default_factory=dict)  # ... and the MODSEQ of its last numbering
    next_modseq: int = FIRST_MODSEQ  # the first MODSEQ claim not read yet
    effects: dict[str, FlagEffect] = field(default_factory=dict)  # flag changes by message sid
    vanished: list[tuple[int, int, float]] = field(default_factory=list)  # (MODSEQ, UID, when) of remembered expunges
    forgotten: int = 0  # the floor: expunges with a MODSEQ up to it are forgotten
    vanished_uids: set[int] = field(default_factory=set)  # every UID this process knows vanished
    repair: bool = False  # an abandoned MODSEQ claim was read: an expunge may lack its claim
    loaded: bool = False  # the checkpoint was looked for
    checkpointed: int = 1 + FIRST_MODSEQ  # next_uid + next_modseq of the last checkpoint read or written
    checkpoint_size: int = 0
    pruned: int = 0  # tombstones seen when flag changes were last pruned

    @property
    def highest(self) -> int:
        return max(1, self.next_modseq - 1)

    # ------------------------------------------------------------------ reading claims

    def take_uid(self, uid: int, claimed: object, now: float) -> int:
        """Record UID claim `uid` (its parsed content); returns the next claim to read."""
        if isinstance(claimed, tuple):
            message_id, modseq = claimed
            old = self.uid_of.get(message_id)
            if old is None or old < uid:
                if old is not None:
                    self._vanish(modseq, old, now)  # renumbered: the old UID is given up
                self.uid_of[message_id] = uid
            self.numbered[message_id] = max(self.numbered.get(message_id, 0), modseq)
            if modseq == 1:  # numbered before MODSEQs: what vanished before them is not known
                self.forgotten = max(self.forgotten, 1)
        self.next_uid = max(self.next_uid, uid + 1)
        return self.next_uid

    def take_change(self, n: int, change: object, now: float) -> int:
        """Record MODSEQ claim `n` (its parsed content); returns the next claim to read."""
        if change is ABANDONED:
            self.repair = True
        elif isinstance(change, dict):
            kind = change.get("k")
            if kind == "f" and change.get("mode") in FLAG_MODES:
                mode, flags = change["mode"], frozenset(str(f) for f in change.get("flags", ()))
                for sid in change.get("ids", ()):
                    self.effects[sid] = self.effects.get(sid, FlagEffect(n)).then(n, mode, flags)
            elif kind == "x":
                when = float(change.get("t", now))
                for uid in change.get("uids", ()):
                    self._vanish(n, int(uid), when)
                self.forgotten = max(self.forgotten, int(change.get("floor", 0)))
                if self.vanished and self.vanished[0][0] <= self.forgotten:
                    self.vanished = [v for v in self.vanished if v[0] > self.forgotten]
        self.next_modseq = max(self.next_modseq, n + 1)
        return self.next_modseq

    def _vanish(self, modseq: int, uid: int, when: float) -> None:
        self.vanished.append((modseq, uid, when))
        self.vanished_uids.add(uid)

    # ------------------------------------------------------------------ answers

    def modseq_of(self, message_id: uuid.UUID, sid: str) -> int | None:
        """The MODSEQ of a message's last numbering or flag change; None when it had neither."""
        effect = self.effects.get(sid)
        values = [v for v in (self.numbered.get(message_id), effect.modseq if effect else None) if v]
        return max(values) if values else None

    def flags_of(self, sid: str, delivered: frozenset[str]) -> frozenset[str]:
        effect = self.effects.get(sid)
        return effect.apply(delivered) if effect else delivered

    def expunge(self, uids: list[int], now: float, keep: float) -> dict[str, Any]:
        """An expunge claim's content: the UIDs, the time, and the floor its writer sets, the
        highest MODSEQ of the expunges it knows that are older than `keep` (vanished_since
        answers None below the floor). Written by a change holding the next claim, so it knows
        every expunge before it."""
        old = [n for n, _, when in self.vanished if when < now - keep]
        return {"k": "x", "uids": sorted(uids), "t": now, "floor": max([self.forgotten, *old])}

    def vanished_since(self, modseq: int) -> list[int] | None:
        """The UIDs that vanished with a MODSEQ above `modseq`; None if some may be forgotten."""
        if modseq < self.forgotten:
            return None
        return sorted({uid for n, uid, _ in self.vanished if n > modseq})

    def prune(self, dead: Collection[str]) -> None:
        """Drop the flag changes of messages deleted (their tombstones seen): never listed again.
        Nothing to do while no tombstone was seen since the last time."""
        if len(dead) != self.pruned:
            self.effects = {sid: e for sid, e in list(self.effects.items()) if sid not in dead}
            self.pruned = len(dead)

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_due(self) -> bool:
        read = self.next_uid + self.next_modseq - self.checkpointed
        return read >= max(CHECKPOINT_EVERY, self.checkpoint_size // 4)

    def checkpoint(self, dead: Container[str]) -> tuple[bytes, int]:
        """A checkpoint of everything read so far (messages in `dead` left out) and its entries."""
        uids = [[m.hex, uid, self.numbered.get(m, 1)] for m, uid in list(self.uid_of.items()) if sortable_id(m) not in dead]
        flags = [
            [sid, e.modseq, sorted(e.replace) if e.replace is not None else None, sorted(e.add), sorted(e.remove)]
            for sid, e in list(self.effects.items()) if sid not in dead
        ]
        record = {
            "format": 1, "uid": self.next_uid, "modseq": self.next_modseq, "forgotten": self.forgotten,
            "uids": uids, "flags": flags, "vanished": [list(v) for v in self.vanished],
        }
        return json.dumps(record, separators=(",", ":")).encode() + b"\n", len(uids) + len(flags) + len(self.vanished)

    def load(self, data: bytes) -> bool:
        """Start from a checkpoint (only before any claim was read); False if it is of an unknown
        format. Raises ValueError, KeyError or TypeError for one that is not a checkpoint."""
        if self.next_uid != 1 or self.next_modseq != FIRST_MODSEQ:
            return False
        record = json.loads(data)
        if record.get("format") != 1:
            return False
        uid_of, numbered = {}, {}
        for text, uid, modseq in record["uids"]:
            message_id = uuid.UUID(hex=text)
            uid_of[message_id], numbered[message_id] = int(uid), int(modseq)
        effects = {
            str(sid): FlagEffect(int(modseq), frozenset(replace) if replace is not None else None, frozenset(add), frozenset(remove))
            for sid, modseq, replace, add, remove in record["flags"]
        }
        vanished = [(int(n), int(uid), float(when)) for n, uid, when in record["vanished"]]
        next_uid, next_modseq, forgotten = int(record["uid"]), int(record["modseq"]), int(record["forgotten"])
        self.uid_of, self.numbered, self.effects, self.vanished = uid_of, numbered, effects, vanished
        self.vanished_uids = {uid for _, uid, _ in vanished}
        self.next_uid, self.next_modseq, self.forgotten = next_uid, next_modseq, forgotten
        self.checkpointed, self.checkpoint_size = next_uid + next_modseq, len(uid_of) + len(effects) + len(vanished)
        return True


__all__ = ["ABANDONED", "CHECKPOINT_EVERY", "FIRST_MODSEQ", "Chains", "FlagEffect", "changed_flags"]
