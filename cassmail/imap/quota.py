"""QUOTA (RFC 9208): GETQUOTAROOT, GETQUOTA and SETQUOTA, with the STORAGE resource.

Each user has one quota root, named "" (as Dovecot names it by default), over all their
mailboxes; its STORAGE is the store's usage (the sizes of every message in every mailbox) and
the limit the administrator set (`cassmail user quota`), both in units of 1024 octets: the usage
rounded up and the limit down, so a client never reads room that is not there. A user without a
limit has no quota root: GETQUOTAROOT names none and GETQUOTA "" answers NO [NONEXISTENT], since
a QUOTA response must list at least one resource with a limit. Users cannot set their own quota:
SETQUOTA is parsed and answered NO [NOPERM], and QUOTASET is not advertised.

What QUOTA=RES-STORAGE requires beside these, the STATUS items DELETED-STORAGE (and DELETED), is
counted with the other STATUS items (mailboxes.py); APPEND, COPY and MOVE over the limit are
refused by the store before anything is written, and the session answers NO [OVERQUOTA].
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cassmail.imap import commands as c
from cassmail.imap import wire
from cassmail.imap.errors import No
from cassmail.store.base import Quota

if TYPE_CHECKING:
    from cassmail.imap.session import Session

#: The one quota root of every user.
ROOT = ""


def storage(quota: Quota) -> bytes:
    """The quota list of a root with a limit: `(STORAGE usage limit)` in KiB."""
    assert quota.limit is not None
    return b"(STORAGE %d %d)" % (-(-quota.used // 1024), quota.limit // 1024)


async def getquotaroot(session: Session, args: c.Mailbox) -> str:
    """RFC 9208 4.1.2: the mailbox need not exist (it names the root it would have)."""
    user = session.user
    assert user is not None
    name = session.mailbox(args.name)
    # The limit first: a user without one (most) costs no count of the usage.
    quota = await session.store.get_quota(user) if await session.store.quota_limit(user) is not None else None
    roots = b"" if quota is None or quota.limit is None else b" " + wire.astring(ROOT.encode())
    session.untagged(b"QUOTAROOT " + session.encode_name(name) + roots)
    if quota is not None and quota.limit is not None:
        session.untagged(b"QUOTA " + wire.astring(ROOT.encode()) + b" " + storage(quota))
    return "GETQUOTAROOT completed"


async def getquota(session: Session, args: c.GetQuota) -> str:
    user = session.user
    assert user is not None
    store = session.store
    quota = await store.get_quota(user) if args.root == ROOT.encode() and await store.quota_limit(user) is not None \
        else None
    if quota is None or quota.limit is None:
        raise No("No such quota root", "NONEXISTENT")
    session.untagged(b"QUOTA " + wire.astring(ROOT.encode()) + b" " + storage(quota))
    return "GETQUOTA completed"


async def setquota(session: Session, args: c.SetQuota) -> str:
    raise No("Quotas are set by the administrator", "NOPERM")
