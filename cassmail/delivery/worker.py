"""The queue worker of one worker process: takes due entries from the store under a lease,
delivers each to its recipients' destinations, records what happened, and either finishes
the entry, or reschedules it on a growing backoff, or bounces what cannot be delivered.

Nothing here is owned by a node: an entry is the store's, and this worker only holds a
lease on it (renewed every third of its length while it works). If the process dies the
lease runs out and any worker of any node takes the entry again.

One attempt per entry: the recipients are grouped by route (transport map, relayhost or
the domain's MX), each group sent as one transaction over a pooled connection. A 2xx
is final, a 5xx (or a permanent routing failure: null MX, no such domain) fails the
recipient with one DSN to the sender, anything else waits for the next attempt until the
lifetime has passed; a DSN of failure goes out before the failure is recorded, so a crash
in between sends it twice rather than never.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace

from cassmail.config import Settings
from cassmail.delivery import dkim, dsn
from cassmail.delivery.client import Connection, Pool, Reply, Trouble, connect
from cassmail.delivery.message import delivered_to, downgrade_8bit, from_domain, has_8bit, header_section, hop_count
from cassmail.delivery.message import needs_smtputf8
from cassmail.delivery.routing import Route, RouteError, Router
from cassmail.logs import Timer, kv
from cassmail.model import InvalidInput, address_key
from cassmail.store.base import (
    NoSuchQueueEntry,
    QueuedRecipient,
    QueueEntry,
    QuotaExceeded,
    Store,
    StoreError,
    Target,
    local_recipients,
)

log = logging.getLogger("cassmail.delivery")

#: Seconds a stopping worker lets deliveries in progress finish before it cuts them (their
#: entries are then taken again once their leases run out).
STOP_GRACE = 10.0
#: Seconds to wait after a failure to read the queue at all.
STORE_BACKOFF = 5.0
#: Seconds a worker woken by new mail waits for more before it looks at the queue.
WAKE_BATCH = 0.05


@dataclass(frozen=True)
class Outcome:
    """What one attempt did for one recipient."""

    address: str
    state: str  # sent, failed or pending (deferred)
    reply: str
    remote: str
    status: str
    #: Where the attempt was headed (a Route's key and kind; empty when no route was looked
    #: for, as for a loop) and how long it took: what its log line says.
    destination: str = ""
    route: str = ""
    ms: int = 0

    def recipient(self) -> QueuedRecipient:
        return QueuedRecipient(self.address, self.state, self.reply, self.remote)  # type: ignore[arg-type]


def backoff(attempts: int, low: float, high: float) -> float:
    """Seconds before the next attempt after `attempts` failed ones: doubling from `low` up to
    `high`, with a tenth of jitter so entries deferred together do not come back together."""
    base = min(high, low * 2 ** min(attempts, 30))
    return base * random.uniform(0.9, 1.1)


def domain_of(address: str) -> str:
    return address.rpartition("@")[2].lower()


def share(limit: int, processes: int) -> int:
    """One worker process's part of a node-wide limit: the node's processes together never go
    over it, except that each has at least one (a limit below the number of processes)."""
    return max(1, limit // max(processes, 1))


#: An attempt's outcome as its log line and the counters name it.
RESULTS = {"sent": "sent", "failed": "bounced", "pending": "deferred"}


class DeliveryWorker:
    def __init__(self, settings: Settings, store: Store, processes: int = 1) -> None:
        self.settings, self.store = settings, store
        self.delivery, self.relay = settings.delivery, settings.relay
        self.owner = f"{settings.node.name}/{os.getpid()}"
        self.helo = settings.relay.helo_name or settings.node.name
        self.limit = share(self.delivery.concurrency, processes)
        self.router = Router(settings.relay)
        self.pool = Pool(share(self.delivery.destination_concurrency, processes), settings.relay.connection_reuse_time,
                         settings.relay.connection_reuse_count)
        self.keys = dkim.Keys(store)
        self._wake = asyncio.Event()
        self._stopping = False
        self._tasks: set[asyncio.Task[None]] = set()
        #: Entries an attempt of this process is working on.
        self._working: set[uuid.UUID] = set()
        #: Slots promised to messages being queued in this process (see reserve).
        self._reserved = 0
        #: The queue may hold due entries this worker has not looked at (its last look filled
        #: every free slot, or mail was queued without a lease): a finished delivery then looks
        #: again at once rather than at the next poll.
        self._backlog = True
        self.lease = self.delivery.lease
        self._runner: asyncio.Task[None] | None = None

    # ----------------------------------------------------------------- the loop

    def start(self) -> None:
        self._runner = asyncio.ensure_future(self._run())

    def notify(self) -> None:
        """New mail was queued in this process: look at the queue now, not at the next poll."""
        self._backlog = True
        self._wake.set()

    def reserve(self) -> str | None:
        """A slot for a message this process is about to queue, which will then start leased to
        this worker and be handed over (no look at the queue, no lightweight transaction); None
        when every slot is busy (the message is queued free and taken from the queue later)."""
        if self._stopping or len(self._tasks) + self._reserved >= self.limit:
            return None
        self._reserved += 1
        return self.owner

    def unreserve(self) -> None:
        self._reserved -= 1

    def hand_over(self, entry_id: uuid.UUID, sender: str, recipients: list[str], message: bytes, smtputf8: bool,
                  queued_at: float) -> None:
        self._reserved -= 1
        entry = QueueEntry(entry_id, sender, tuple(QueuedRecipient(r) for r in recipients), len(message), queued_at,
                           queued_at, lease_owner=self.owner, lease_until=queued_at + self.lease, smtputf8=smtputf8)
        self._start(entry, message)

    async def stop(self) -> None:
        """Take nothing more; let deliveries in progress finish for a while, then cut them."""
        self._stopping = True
        self._wake.set()
        if self._runner is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._runner
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=STOP_GRACE)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2)
        await self.pool.close()

    async def _run(self) -> None:
        while not self._stopping:
            self._wake.clear()
            free = self.limit - len(self._tasks) - self._reserved
            taken: list[QueueEntry] = []
            if free > 0:
                try:
                    taken = await self.store.take_due(self.owner, free, self.delivery.lease)
                except StoreError as exc:
                    log.warning(kv("queue-take", owner=self.owner, result="tempfail", error=exc))
                    await self._sleep(STORE_BACKOFF)
                    continue
                except Exception:  # noqa: BLE001 - a bug must not stop delivery for good
                    log.exception(kv("queue-take", owner=self.owner, result="error"))
                    await self._sleep(STORE_BACKOFF)
                    continue
            self._backlog = free <= 0 or len(taken) == free
            for entry in taken:
                self._start(entry)
            if taken and len(taken) == free:
                continue  # more may be due
            await self._sleep(self.delivery.poll_interval)
            if self._wake.is_set() and not self._stopping:
                # Woken by new mail: let the mail of the next moments join it, so a busy node
                # looks at the queue a few times a second rather than once per message.
                await asyncio.sleep(WAKE_BATCH)

    def _start(self, entry: QueueEntry, body: bytes | None = None) -> None:
        if entry.id in self._working:
            return  # already being delivered here (the store handed it out again)
        self._working.add(entry.id)
        task = asyncio.ensure_future(self._attempt(entry, body))
        self._tasks.add(task)
        task.add_done_callback(lambda done, entry_id=entry.id: self._done(done, entry_id))

    def _done(self, task: asyncio.Task[None], entry_id: uuid.UUID) -> None:
        self._tasks.discard(task)
        self._working.discard(entry_id)
        if self._backlog or self._stopping:
            self._wake.set()

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)

    async def _keep_lease(self, entry_id: uuid.UUID) -> None:
        while True:
            await asyncio.sleep(self.delivery.lease / 3)
            try:
                if not await self.store.renew_lease(entry_id, self.owner, self.delivery.lease):
                    log.warning(kv("queue-lease", id=entry_id.hex, owner=self.owner, result="lost"))
                    return
            except StoreError as exc:
                log.warning(kv("queue-lease", id=entry_id.hex, owner=self.owner, result="tempfail", error=exc))

    # ----------------------------------------------------------------- one attempt

    async def _attempt(self, entry: QueueEntry, body: bytes | None = None) -> None:
        keeper = asyncio.ensure_future(self._keep_lease(entry.id))
        try:
            await self._deliver(entry, body)
        except NoSuchQueueEntry:
            pass  # deleted by an operator while we worked
        except StoreError as exc:
            # Nothing was sent: try again soon (or, if the store cannot even take that, when the
            # lease runs out).
            log.warning(kv("outbound", id=entry.id.hex, result="tempfail", error=exc))
            with contextlib.suppress(StoreError):
                await self.store.reschedule(entry.id, self.owner, time.time() + min(self.delivery.min_backoff, STORE_BACKOFF),
                                            f"store: {exc}")
        except Exception:  # noqa: BLE001 - one entry's bug must not take the worker down
            log.exception(kv("outbound", id=entry.id.hex, result="error"))
            with contextlib.suppress(StoreError):
                await self.store.reschedule(entry.id, self.owner, time.time() + self.delivery.min_backoff,
                                            "internal error")
        finally:
            keeper.cancel()

    async def _deliver(self, entry: QueueEntry, body: bytes | None) -> None:
        started = time.time()
        timer = Timer()
        if body is None:
            body = await self.store.read_queued(entry.id)
        headers = header_section(body)
        pending = [r.address for r in entry.pending]
        decided: list[Outcome] = []  # before any connection: loops, routing failures
        hops = hop_count(headers)
        if hops > self.delivery.max_hops:
            reason = f"554 5.4.6 Too many hops ({hops} Received: fields): mail loop"
            decided += [Outcome(a, "failed", reason, "", "5.4.6", ms=timer.ms) for a in pending]
            pending = []
        looped = delivered_to(headers)
        for address in [a for a in pending if a.lower() in looped]:
            decided.append(Outcome(address, "failed", "554 5.4.6 Delivered-To names this recipient: mail loop", "",
                                   "5.4.6", ms=timer.ms))
            pending.remove(address)
        groups: dict[str, tuple[Route, list[str]]] = {}
        for domain in dict.fromkeys(domain_of(a) for a in pending):
            wanted = [a for a in pending if domain_of(a) == domain]
            lookup = Timer()
            try:
                route = await self.router.route(domain)
            except RouteError as exc:
                decided += self._every(wanted, str(exc), exc.permanent, exc.status, "", exc.destination, exc.kind,
                                       lookup.ms)
                continue
            groups.setdefault(route.channel, (route, []))[1].extend(wanted)
        outcomes = await self._attempted(entry, decided, record=False)
        several = len(groups) > 1
        results = await asyncio.gather(*(self._send_group(entry, body, route, rcpts, several)
                                         for route, rcpts in groups.values()))
        for group in results:
            outcomes += group
        await self._conclude(entry, body, outcomes, started)

    async def _send_group(self, entry: QueueEntry, body: bytes, route: Route, rcpts: list[str],
                          record: bool) -> list[Outcome]:
        """One destination: a transaction over a pooled connection (a fresh one if a reused one
        turns out dead before the remote took anything)."""
        timer = Timer()
        for attempt in (1, 2):
            try:
                conn = await self.pool.acquire(route.channel, lambda: connect(route, self.relay, self.helo))
            except Trouble as exc:
                outcomes = self._trouble(rcpts, exc)
                break
            reused = conn.messages > 0
            reusable = False
            try:
                replies = await self._transaction(entry, body, conn, rcpts)
                reusable = True
            except Trouble as exc:
                if reused and attempt == 1 and not exc.permanent and not conn.alive:
                    continue  # the remote closed an idle connection: try once on a new one
                outcomes = self._trouble(rcpts, exc)
                break
            finally:
                self.pool.release(route.channel, conn, reusable)
            outcomes = [self._judge(r) for r in replies]
            break
        ms = timer.ms
        return await self._attempted(entry, [replace(o, destination=route.key, route=route.kind, ms=ms)
                                             for o in outcomes], record)

    async def _attempted(self, entry: QueueEntry, outcomes: list[Outcome], record: bool) -> list[Outcome]:
        """What this attempt decided for some recipients, whatever decided it (a loop, routing,
        a remote): one log line each (the deferrals among them are counted from it), and with
        `record` (several destinations) what was sent is stored at once, so a crash while
        another destination is slow cannot send it twice."""
        for o in outcomes:
            log.info(kv("outbound", id=entry.id.hex, rcpt=o.address, remote=o.remote or o.destination or None,
                        route=o.route or None, result=RESULTS[o.state], reply=o.reply, attempt=entry.attempts + 1,
                        ms=o.ms))
        sent = [o.recipient() for o in outcomes if o.state == "sent"]
        if record and sent:
            await self.store.record_results(entry.id, self.owner, sent)
        return outcomes

    async def _transaction(self, entry: QueueEntry, body: bytes, conn: Connection, rcpts: list[str]) -> list[Reply]:
        utf8 = entry.smtputf8 and needs_smtputf8(body, [entry.sender, *rcpts])
        if utf8 and not conn.supports("smtputf8"):
            raise Trouble(f"{conn.remote} does not support SMTPUTF8, which this message needs", conn.remote,
                          permanent=True, status="5.6.7")
        eight_bit = has_8bit(body)
        if eight_bit and not utf8 and not conn.supports("8bitmime"):
            if has_8bit(header_section(body)):
                raise Trouble(f"{conn.remote} supports neither 8BITMIME nor SMTPUTF8", conn.remote, permanent=True,
                              status="5.6.3")
            body, eight_bit = downgrade_8bit(body), False
        message = await self._signed(entry, body)
        return await conn.send(entry.sender, rcpts, message, smtputf8=utf8, eight_bit=eight_bit,
                               timeout=self.relay.timeout)

    async def _signed(self, entry: QueueEntry, body: bytes) -> bytes:
        headers = header_section(body)
        key = await self.keys.get(from_domain(headers))
        if key is None and entry.sender:
            key = await self.keys.get(domain_of(entry.sender))
        if key is None:
            return body
        try:
            return dkim.sign(body, key)
        except Exception as exc:  # noqa: BLE001 - dkimpy raises its own and plain errors on odd input
            log.warning(kv("dkim", id=entry.id.hex, domain=key.domain, result="unsigned", error=repr(exc)[:200]))
            return body

    @staticmethod
    def _every(rcpts: Sequence[str], reason: str, permanent: bool, status: str, remote: str, destination: str = "",
               route: str = "", ms: int = 0) -> list[Outcome]:
        """The same failure for every recipient: bounced when permanent, else deferred."""
        code, state = ("550", "failed") if permanent else ("451", "pending")
        return [Outcome(a, state, f"{code} {status} {reason}", remote, status, destination, route, ms) for a in rcpts]

    @classmethod
    def _trouble(cls, rcpts: Sequence[str], trouble: Trouble) -> list[Outcome]:
        return cls._every(rcpts, trouble.reason, trouble.permanent, trouble.status, trouble.remote)

    @staticmethod
    def _judge(reply: Reply) -> Outcome:
        if 200 <= reply.code < 300:
            state = "sent"
        elif 500 <= reply.code < 600:
            state = "failed"
        else:
            state = "pending"
        return Outcome(reply.address, state, reply.line, reply.remote, dsn.status_of(reply.line, "4.0.0"))

    # ----------------------------------------------------------------- after the attempt

    async def _conclude(self, entry: QueueEntry, body: bytes, outcomes: list[Outcome], started: float) -> None:
        now = time.time()
        deferred = [o for o in outcomes if o.state == "pending"]
        failed = [o for o in outcomes if o.state == "failed"]
        expired = bool(deferred) and now - entry.created >= self.delivery.max_lifetime
        if expired:
            failed += [Outcome(o.address, "failed", f"{o.reply} (delivery time expired)", o.remote, "4.4.7")
                       for o in deferred]
            deferred = []
        final = [o for o in outcomes if o.state == "sent"] + failed
        if failed and entry.sender:
            try:
                await self._bounce(entry, body, failed, delayed=False)
            except StoreError as exc:
                # Not recorded as failed: the next attempt fails them again and sends the DSN then.
                log.warning(kv("dsn", id=entry.id.hex, result="tempfail", error=exc))
                deferred += [Outcome(o.address, "pending", o.reply, o.remote, o.status) for o in failed]
                final = [o for o in final if o.state == "sent"]
        if not deferred:
            try:
                await self.store.finish(entry.id)
            except StoreError as exc:
                # What was done is recorded, so the next attempt only finishes the entry (and
                # sends nothing twice); if this fails too, the lease's end brings it back.
                log.warning(kv("outbound", id=entry.id.hex, result="tempfail", error=exc))
                if not await self.store.reschedule(entry.id, self.owner, now + STORE_BACKOFF, f"store: {exc}",
                                                   results=[o.recipient() for o in final]):
                    return
            self._log_final(entry, final, now)
            return
        warned = False
        age = now - entry.created
        if entry.sender and not entry.warned and self.delivery.delay_warning and age >= self.delivery.delay_warning:
            with contextlib.suppress(StoreError):
                await self._bounce(entry, body, deferred, delayed=True)
                warned = True
        due = now + backoff(entry.attempts, self.delivery.min_backoff, self.delivery.max_backoff)
        due = min(due, entry.created + self.delivery.max_lifetime)  # one last attempt when the lifetime ends
        error = deferred[0].reply
        if not await self.store.reschedule(entry.id, self.owner, max(due, now + 1), error, warned=warned,
                                           results=[o.recipient() for o in final + deferred]):
            log.warning(kv("queue-lease", id=entry.id.hex, owner=self.owner, result="lost"))
            return
        self._log_final(entry, final, now)

    def _log_final(self, entry: QueueEntry, final: list[Outcome], now: float) -> None:
        for o in final:
            log.info(kv("outbound-done", id=entry.id.hex, rcpt=o.address,
                        result="sent" if o.state == "sent" else "bounced", age=int(now - entry.created)))

    async def _bounce(self, entry: QueueEntry, body: bytes, about: list[Outcome], delayed: bool) -> None:
        """A DSN to the entry's sender: into their mailbox when the sender is local, queued (from
        <>) when not; nothing when the sender's local address no longer exists."""
        report = dsn.build(
            self.settings.node.name, entry.sender, body,
            [dsn.Failure(o.address, o.status, o.reply, o.remote) for o in about], delayed=delayed,
            arrival=entry.created, retry_until=entry.created + self.delivery.max_lifetime,
        )
        sender = entry.sender
        try:
            local = await self.store.is_local_domain(domain_of(sender))
        except InvalidInput:
            return
        if local:
            users = await local_recipients(self.store, sender)
            if not users:
                log.warning(kv("dsn", id=entry.id.hex, to=sender, result="dropped", error="no such local user"))
                return
            targets = [Target(u) for u in users]
            while targets:
                try:
                    await self.store.deliver(report, targets)
                    break
                except QuotaExceeded as exc:  # trying the entry again would only send the mail out again
                    log.warning(kv("dsn", id=entry.id.hex, to=",".join(exc.users), result="dropped",
                                   error="over quota"))
                    targets = [t for t in targets if t.user not in exc.users]
            if not targets:
                return
        else:
            queued = await self.store.enqueue(report, "", [sender])
            self.notify()
            log.info(kv("dsn", id=entry.id.hex, to=sender, queued=queued.hex))
        log.info(kv("dsn", id=entry.id.hex, to=address_key(sender), kind="delayed" if delayed else "failed",
                    rcpts=len(about), result="ok"))
