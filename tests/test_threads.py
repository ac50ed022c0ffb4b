"""The thread pool of the file stores (cassmail.threads): results and failures come back to the
awaiting coroutine, work that blocks gets a thread of its own up to the pool's size and waits
for a free one beyond it, and a waiter that gave up leaves the pool as it was."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from cassmail.threads import Threads


async def test_results_and_failures_come_back_from_the_threads() -> None:
    pool = Threads(4, "test-pool")
    assert await pool.run(lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(ZeroDivisionError):
        await pool.run(lambda: 1 / 0)
    names = await asyncio.gather(*(pool.run(lambda: threading.current_thread().name) for _ in range(50)))
    assert threading.current_thread().name not in names
    assert {n.rsplit("-", 1)[0] for n in names} == {"test-pool"}


async def test_blocking_work_gets_threads_up_to_the_size_and_the_rest_waits_for_one() -> None:
    pool = Threads(3, "test-pool")
    release = threading.Event()
    running, most = 0, 0
    lock = threading.Lock()

    def blocked(i: int) -> int:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        release.wait(10)
        with lock:
            running -= 1
        return i

    calls = [pool.run(blocked, i) for i in range(7)]
    deadline = time.monotonic() + 5
    while most < 3 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)
    assert most == 3 and running == 3  # three threads, all of them blocked; four calls wait
    assert not any(c.done() for c in calls)
    release.set()
    assert await asyncio.gather(*calls) == list(range(7))
    deadline = time.monotonic() + 5
    while pool._idle < 3 and time.monotonic() < deadline:  # (a thread counts itself idle just after its answer)
        await asyncio.sleep(0.01)
    assert most == 3 and pool._started == 3 and pool._idle == 3 and pool._waiting == 0


async def test_a_waiter_that_gave_up_leaves_the_pool_working() -> None:
    pool = Threads(2, "test-pool")
    started = threading.Event()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(pool.run(lambda: (started.set(), time.sleep(0.3))), 0.05)
    assert started.is_set()
    assert await pool.run(lambda: "after") == "after"
    await asyncio.sleep(0.4)
    assert pool._idle == pool._started and pool._waiting == 0
