"""Work handed between an event loop and threads, with fewer wake-ups than asyncio's own.

- `Inbox`: calls handed from other threads (the Cassandra driver's own, the pool's below) to one
  event loop. The loop is woken once for all that arrive while it is busy, not once per call
  (each wake-up is a write to its pipe).
- `Threads`: a pool for the blocking work of the file stores (reads that must wait, writes,
  fsyncs, lock waits), awaited with `await THREADS.run(fn, *args)`. The result comes back
  through the loop's Inbox.

`asyncio.to_thread` does the same with a ThreadPoolExecutor, a concurrent Future and their
Python-level locks and conditions, a copy of the context and one wake-up of the loop per
result: on a 2-core VM a hand-over to a thread and back cost 200 us of CPU that way and 65 us
this way (one caller at a time), 81 and 29 us with sixteen callers at once.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class Inbox:
    """Calls handed from other threads to one event loop, run there in the order they came."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: deque[tuple[Callable[..., None], tuple[Any, ...]]] = deque()
        self.lock = threading.Lock()
        self.waking = False

    def put(self, fn: Callable[..., None], *args: Any) -> None:
        with self.lock:
            self.items.append((fn, args))
            if self.waking:
                return
            self.waking = True
        try:
            self.loop.call_soon_threadsafe(self.drain)
        except RuntimeError:  # the loop is closed: nobody waits for these any more
            pass

    def drain(self) -> None:
        with self.lock:
            items, self.items = self.items, deque()
            self.waking = False
        for fn, args in items:
            fn(*args)


_inboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Inbox] = weakref.WeakKeyDictionary()


def inbox(loop: asyncio.AbstractEventLoop) -> Inbox:
    """The loop's Inbox (one per loop)."""
    found = _inboxes.get(loop)
    if found is None:
        found = _inboxes[loop] = Inbox(loop)
    return found


def settle(fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    """Give a future its outcome, unless its waiter gave up on it (cancelled)."""
    if fut.done():
        return
    if exc is None:
        fut.set_result(result)
    else:
        fut.set_exception(exc)


class Threads:
    """Threads for blocking work, started when none is idle, at most `size`; more work waits in
    the queue for the first thread free."""

    def __init__(self, size: int, name: str) -> None:
        self.size, self.name = size, name
        self._forget()
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        """A new process (after fork) has none of its parent's threads."""
        self._queue: queue.SimpleQueue[tuple[Inbox, asyncio.Future[Any], Callable[..., Any], tuple[Any, ...]]] = \
            queue.SimpleQueue()
        self._lock = threading.Lock()
        #: Threads started, those waiting for work, and work not taken yet (briefly -1 when a
        #: thread takes work before `run` has counted it).
        self._started = self._idle = self._waiting = 0

    def run(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """`fn(*args)` in a thread; its result (or exception) as the awaited future's."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._queue.put((inbox(loop), fut, fn, args))
        with self._lock:
            self._waiting += 1
            if self._waiting <= self._idle or self._started >= self.size:
                return fut  # a thread waiting takes it, or the first one free
            self._started += 1
            number = self._started
        threading.Thread(target=self._work, name=f"{self.name}-{number}", daemon=True).start()
        return fut

    def _work(self) -> None:
        take, lock = self._queue.get, self._lock
        was_idle = False  # (a new thread was started for work waiting)
        while True:
            to, fut, fn, args = take()
            with lock:
                self._waiting -= 1
                self._idle -= was_idle
            try:
                to.put(settle, fut, fn(*args), None)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter, as to_thread does
                to.put(settle, fut, None, exc)
            del to, fut, fn, args  # (nothing kept alive while idle)
            with lock:
                self._idle += 1
            was_idle = True


#: The file stores' pool: as many threads as asyncio's default executor has.
THREADS = Threads(min(32, (os.cpu_count() or 1) + 4), "cassmail-io")
