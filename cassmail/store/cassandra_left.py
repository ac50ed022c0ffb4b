"""What this process's last change of a mailbox left, for its next change to be decided on
without reading first (CassandraStore._change).

A change to a mailbox's messages (numbering, flags, expunges) is one conditional batch, decided on
a read of the rows it changes and of the mailbox's statics (the counters, the STATUS counts and
their bound), and applied only if the counters and the bound are still as read. The batch itself
says what the statics are once it applied. When the same process changes the mailbox next, and
knows the rows it changes as they are at that state (a session's view of its selected mailbox,
Store.store_flags's `known`; the message an APPEND has just delivered), the batch can be made from
that knowledge instead of a read: it still applies only if the statics are what it assumed, so a
change made meanwhile by anyone else (a MODSEQ, a UID, a STATUS that moved the bound, a plain
change) makes it not apply, and it is decided again on a read as before.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict, namedtuple
from collections.abc import Sequence
from typing import NamedTuple

from cassmail.model import MessageSummary as Message
from cassmail.store.cassandra_counts import Tally

#: Mailboxes whose last change a process remembers, at most.
LEFT_KEPT = 10_000


class Statics(NamedTuple):
    """The statics a change's batch left (the names of `Messages.state`'s columns)."""

    uidnext: int | None
    highest_modseq: int
    count_messages: int
    count_unseen: int
    count_size: int
    count_deleted: int
    count_deleted_size: int
    count_unnumbered: int
    count_uid_max: int
    counted_through: uuid.UUID | None
    counts_modseq: int | None
    plain_at: uuid.UUID | None
    counts_plain: uuid.UUID | None


#: A row of `Messages.state` made from what is known of a message and the statics, for the plans
#: of a flag change or a numbering (not of an expunge: the body's columns and the expunge
#: records' trim state are not known, and are None).
Known = namedtuple("Known", ("id", "uid", "size", "flags", "modseq", "body_id", "chunk_size", "shared",
                             "vanished_floor", "vanished_mark", "vanished_mark_at", *Statics._fields))


class Left:
    """The statics each mailbox's last change by this process left (LEFT_KEPT at most)."""

    def __init__(self) -> None:
        self._left: OrderedDict[uuid.UUID, Statics] = OrderedDict()

    def applied(self, mailbox_id: uuid.UUID, uidnext: int | None, highest: int, tally: Tally) -> None:
        """A batch decided on the statics `tally` was made from applied, setting the counters to
        `uidnext` and `highest`, and the counts as `tally` has them if they were true (else
        leaving them)."""
        read = tally.read  # (counts not true are left as read: the tally does not move them)
        self._left[mailbox_id] = Statics(uidnext, highest, *tally.counts.values(), read.counted_through,
                                         highest if tally.valid else read.counts_modseq, read.plain_at,
                                         read.counts_plain)
        self._left.move_to_end(mailbox_id)
        if len(self._left) > LEFT_KEPT:
            self._left.popitem(last=False)

    def forget(self, mailbox_id: uuid.UUID) -> None:
        """A batch decided on what was left did not apply: someone else changed the mailbox."""
        self._left.pop(mailbox_id, None)

    def rows(self, mailbox_id: uuid.UUID, messages: Sequence[Message], at: int | None) -> list[Known] | None:
        """Rows of `messages` as given, which are the store's as of MODSEQ `at` (None: as of any),
        with the statics the last change left; None unless that change left MODSEQ `at`."""
        statics = self._left.get(mailbox_id)
        if statics is None or (at is not None and statics.highest_modseq != at):
            return None
        return [Known(m.id, m.uid, m.size, set(m.flags) or None, m.modseq, None, None, None, None, None, None,
                      *statics) for m in messages]
