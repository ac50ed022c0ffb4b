"""The mbox store against the classic mbox rewrite: the seed thesis's two experiments, on this machine.

(1) Deletion distance. Mailboxes of 5 to 320 MB (messages of 0.5-10 KB); one message
    is deleted at a given distance from the end of the file (the bytes behind it) and
    the session ends (POP3 QUIT / IMAP EXPUNGE). "naive" is what UW-imap does: rewrite
    everything after the first deleted message, in place, then truncate. "ours" is the
    store's `delete`: one index record, collapsed ranges, a pad, and defragmentation
    within the default budget. Time, bytes written (write syscalls, and bytes moved by
    the kernel for defragmentation) and CPU of this process, caches dropped before
    each deletion.

(2) Fragmentation. An ~500 MB mailbox of 80,000 messages is built the way a busy
    server builds one: deliveries to it interleaved with deliveries to another mailbox,
    each batch fsync'd, so the file starts fragmented. Then 40,000 random messages are
    deleted in sessions of `--batch` deletions each. After 0, 10,000, 20,000 and 40,000
    deletions: extents (FIEMAP, physically contiguous extents merged, as filefrag counts
    them), file size, and the time to read the whole mailbox with cold caches; for the
    naive rewrite, for ours, and for ours without defragmentation (collapse only).

Run it as root to drop the page cache (`echo 3 > /proc/sys/vm/drop_caches`); otherwise
the files are evicted with posix_fadvise(DONTNEED), which the table says.

    .venv/bin/python loadtest/bench_mbox.py --quick          # ~1 minute: 5/20 MB, 8,000 messages
    .venv/bin/python loadtest/bench_mbox.py                  # full size (several minutes)
    .venv/bin/python loadtest/bench_mbox.py --only 2 --messages 80000 --batch 1000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cassmail.config import MboxSettings  # noqa: E402
from cassmail.model import new_message_id  # noqa: E402
from cassmail.store import mbox_fs  # noqa: E402
from cassmail.store.mbox import MboxStore  # noqa: E402
from cassmail.store.mbox_format import from_line, keyword_capacity, quote, record_head, trailer_length  # noqa: E402
from cassmail.store.mbox_index import MailboxFile  # noqa: E402

USER = "bench@example.org"
MiB = 1024 * 1024

# --------------------------------------------------------------------------- measuring


def drop_caches(paths: list[Path]) -> str:
    """Cold caches: the whole page cache where permitted, else the files' own pages."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return "drop_caches"
    except OSError:
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "fadvise(DONTNEED) (no permission for drop_caches)"


def wchar() -> int:
    with open("/proc/self/io") as fh:
        for line in fh:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    return 0


@dataclass
class Cost:
    seconds: float
    written: int
    cpu: float
    moved: int = 0


class Meter:
    def __enter__(self) -> Meter:
        self.t, self.w, self.r = time.perf_counter(), wchar(), resource.getrusage(resource.RUSAGE_SELF)
        return self

    def __exit__(self, *exc: object) -> None:
        r = resource.getrusage(resource.RUSAGE_SELF)
        self.cost = Cost(
            time.perf_counter() - self.t,
            wchar() - self.w,
            (r.ru_utime - self.r.ru_utime) + (r.ru_stime - self.r.ru_stime),
        )


def extents(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return len(mbox_fs.fiemap(fd))
    finally:
        os.close(fd)


def filefrag(path: Path) -> str:
    try:
        out = subprocess.run(["filefrag", str(path)], capture_output=True, text=True, timeout=60).stdout
        return out.rsplit(":", 1)[1].split()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "-"


def cold_read(path: Path) -> float:
    drop_caches([path])
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as fh:
        while fh.read(MiB):
            pass
    return time.perf_counter() - started


# --------------------------------------------------------------------------- building mailboxes


def message(n: int, rnd: random.Random) -> bytes:
    size = rnd.randint(512, 10 * 1024)
    head = b"From: sender%d@example.net\r\nTo: bench@example.org\r\nSubject: message %d\r\n\r\n" % (n, n)
    return head + (rnd.randbytes(size // 2).hex().encode() + b"\r\n")[: max(size - len(head), 2)]


def record(raw: bytes, when_us: int) -> bytes:
    """One record exactly as the store's delivery writes it."""
    stored = bytes(quote(raw))
    head = record_head(from_line(raw, when_us), new_message_id(when_us / 1e6), when_us, len(raw), len(stored),
                       frozenset(), keyword_capacity(frozenset(), 64))
    return head + stored + b"\n" * trailer_length(raw)


def build(paths: list[Path], messages: int, seed: int, interleave: int = 0) -> list[list[tuple[int, int]]]:
    """The same mailbox into every path; with `interleave`, batches of that many messages go to
    each file in turn, each fsync'd, as deliveries to several mailboxes of one server would.
    Returns each file's (offset, length) per message."""
    rnd = random.Random(seed)
    fds = [os.open(p, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600) for p in paths]
    layout: list[tuple[int, int]] = []
    pos = 0
    now = int(time.time() * 1e6) - messages * 1000
    pending: list[bytes] = []

    def flush() -> None:
        data = b"".join(pending)
        for fd in fds:
            os.write(fd, data)
            if interleave:
                os.fdatasync(fd)
        pending.clear()

    for n in range(messages):
        rec = record(message(n, rnd), now + n * 1000)
        layout.append((pos, len(rec)))
        pos += len(rec)
        pending.append(rec)
        if len(pending) >= (interleave or 256):
            flush()
    flush()
    for fd in fds:
        os.fsync(fd)
        os.close(fd)
    return [list(layout) for _ in paths]


async def store_on(root: Path, mbox: Path, **settings: object) -> tuple[MboxStore, MailboxFile]:
    """A store whose INBOX is the given prebuilt mbox file (its index rebuilt from it)."""
    store = MboxStore(MboxSettings(path=str(root), **settings))  # type: ignore[arg-type]
    await store.open()
    if not await store.is_local_domain("example.org"):
        await store.add_domain("example.org")
        await store.create_user(USER, "x")
    inbox, index = store.mailbox_paths(USER, "INBOX")
    await store.close()
    os.replace(mbox, inbox)
    index.unlink()
    store = MboxStore(MboxSettings(path=str(root), **settings))  # type: ignore[arg-type]
    await store.open()
    return store, store.mailbox_file(USER, "INBOX")


def naive_delete(fd: int, layout: list[tuple[int, int]], doomed: set[int]) -> list[tuple[int, int]]:
    """UW-imap at QUIT: rewrite everything after the first deleted message in place, truncate,
    fsync. (Writes never overtake reads: every message moves down, never up.)"""
    first = min(doomed)
    write_at = layout[first][0]
    out = list(layout[:first])
    buf = bytearray()
    for i in range(first, len(layout)):
        if i in doomed:
            continue
        off, length = layout[i]
        out.append((write_at + len(buf), length))
        buf += os.pread(fd, length, off)
        if len(buf) >= 8 * MiB:
            os.pwrite(fd, buf, write_at)
            write_at += len(buf)
            buf.clear()
    os.pwrite(fd, buf, write_at)
    os.ftruncate(fd, write_at + len(buf))
    os.fsync(fd)
    return out


# --------------------------------------------------------------------------- experiment 1


async def experiment_distance(work: Path, sizes_mb: list[int], fractions: list[float], tuning: dict[str, int]) -> list[str]:
    rows = []
    cache_note = ""
    for size_mb in sizes_mb:
        count = max(int(size_mb * MiB / 6200), 50)
        naive_path, ours_path = work / f"naive-{size_mb}.mbox", work / f"ours-{size_mb}.mbox"
        [layout, _] = build([naive_path, ours_path], count, seed=size_mb)
        store, mf = await store_on(work / f"store-{size_mb}", ours_path, **tuning)
        ours_file = mf.mbox_path
        ids = [s.id async for s in store.list_messages(USER, "INBOX", page_size=10_000)]
        naive_fd = os.open(naive_path, os.O_RDWR)
        for fraction in fractions:
            # the message with `fraction` of the file behind it (the deletion distance)
            target = int(len(layout) * (1 - fraction))
            target = min(max(target, 0), len(layout) - 1)
            distance = layout[-1][0] + layout[-1][1] - layout[target][0]
            cache_note = drop_caches([naive_path, ours_file])
            with Meter() as naive:
                layout = naive_delete(naive_fd, layout, {target})
            cache_note = drop_caches([naive_path, ours_file])
            with Meter() as ours:
                report = await asyncio.to_thread(mf.delete, [ids[target]])
            del ids[target]
            moved = report.moved if report else 0
            rows.append(
                f"{size_mb:>5} MB {distance / MiB:>9.2f} MB | "
                f"{naive.cost.seconds * 1000:>9.1f} {naive.cost.written / 1024:>11.0f} {naive.cost.cpu * 1000:>8.1f} | "
                f"{ours.cost.seconds * 1000:>8.1f} {ours.cost.written / 1024:>8.1f} {moved / 1024:>9.0f} {ours.cost.cpu * 1000:>8.1f}"
            )
        os.close(naive_fd)
        await store.close()
        shutil.rmtree(work / f"store-{size_mb}", ignore_errors=True)
        naive_path.unlink(missing_ok=True)
    header = [
        "(1) one deletion, then QUIT/EXPUNGE: cost against deletion distance (bytes behind the deleted message)",
        f"    caches: {cache_note}; 'written' = bytes passed to write(2) (mbox + index); 'moved' = bytes the kernel",
        "    copied to give runs of small extents fresh blocks (EXT4_IOC_MOVE_EXT)",
        "",
        " mailbox   distance |     naive rewrite (UW-imap)    |             ours (collapse + pad)",
        "                    |   time ms  written KiB   cpu ms | time ms  wrt KiB mov KiB   cpu ms",
    ]
    return header + rows


# --------------------------------------------------------------------------- experiment 2


async def experiment_fragmentation(work: Path, messages: int, checkpoints: list[int], batch: int,
                                   interleave: int, deadline: float, tuning: dict[str, int]) -> list[str]:
    paths = {name: work / f"frag-{name}.mbox" for name in ("naive", "ours", "collapse-only", "other")}
    started = time.perf_counter()
    layouts = build(list(paths.values()), messages, seed=42, interleave=interleave)
    build_s = time.perf_counter() - started
    layout = layouts[0]
    stores = {}
    for name, extra in (("ours", tuning), ("collapse-only", {**tuning, "defrag": False})):
        stores[name] = await store_on(work / f"frag-store-{name}", paths[name], **extra)
    paths["other"].unlink()
    files = {"naive": paths["naive"], **{n: mf.mbox_path for n, (_, mf) in stores.items()}}
    ids = {n: [s.id async for s in store.list_messages(USER, "INBOX", page_size=10_000)] for n, (store, _) in stores.items()}
    rnd = random.Random(7)
    order = rnd.sample(range(messages), max(checkpoints))  # message numbers, in deletion order
    naive_fd = os.open(files["naive"], os.O_RDWR)
    alive = list(range(messages))  # message numbers still in the naive layout, in file order
    totals = {n: Cost(0.0, 0, 0.0) for n in files}
    rows = []
    done = 0
    cache_note = ""
    stopped = False
    for checkpoint in sorted(checkpoints):
        while done < checkpoint:
            if time.perf_counter() > deadline:
                stopped = True
                break
            session = order[done : min(done + batch, checkpoint)]
            doomed_numbers = set(session)
            positions = {n: i for i, n in enumerate(alive)}
            with Meter() as m:
                layout = naive_delete(naive_fd, layout, {positions[n] for n in doomed_numbers})
            alive = [n for n in alive if n not in doomed_numbers]
            _add(totals["naive"], m.cost)
            for name, (_, mf) in stores.items():
                with Meter() as m:
                    report = await asyncio.to_thread(mf.delete, [ids[name][n] for n in session])
                m.cost.moved = report.moved if report else 0
                _add(totals[name], m.cost)
            done += len(session)
        cells = []
        for path in files.values():
            cache_note = drop_caches([path])
            cells.append(f"{extents(path):>7} {filefrag(path):>8} {path.stat().st_size / MiB:>6.1f} {cold_read(path):>6.3f}")
        rows.append(f"{done:>9} | " + " | ".join(cells))
        if stopped:
            rows.append(f"   (stopped at {done} deletions: --max-seconds reached)")
            break
    # finish: what `cassmail store compact` would do on ours afterwards
    after = []
    for name, (store, mf) in stores.items():
        with Meter() as m:
            report = await asyncio.to_thread(mf.compact, None, None, name == "ours")
        path = files[name]
        after.append(
            f"  {name:<13} store compact: {m.cost.seconds:.1f} s, moved {report.moved / MiB:.0f} MiB, "
            f"extents {extents(path)}, size {path.stat().st_size / MiB:.1f} MiB, cold read {cold_read(path):.3f} s"
        )
    os.close(naive_fd)
    for store, _ in stores.values():
        await store.close()
    live = sum(n for _, n in layout)
    header = [
        f"(2) fragmentation: {messages} messages ({live / MiB:.0f} MiB live at the end), built interleaved with another "
        f"mailbox in fsync'd batches of {interleave} ({build_s:.0f} s), deleted at random in sessions of {batch}",
        f"    caches: {cache_note}. extents = FIEMAP (physically contiguous merged) / filefrag; read = cold whole-file read, s",
        "",
        " deleted  |        naive rewrite         |   ours (collapse+pad+defrag) |     ours, collapse only",
        "          | extents filefrag   MiB  read s | extents filefrag   MiB  read s | extents filefrag   MiB  read s",
    ]
    footer = ["", "  deletion sessions, totals:"] + [
        f"  {name:<13} {c.seconds:>7.1f} s  written {c.written / MiB:>8.0f} MiB  moved {c.moved / MiB:>6.0f} MiB  cpu {c.cpu:>6.1f} s"
        for name, c in totals.items()
    ]
    return header + rows + footer + [""] + after


def _add(total: Cost, cost: Cost) -> None:
    total.seconds += cost.seconds
    total.written += cost.written
    total.cpu += cost.cpu
    total.moved += cost.moved


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes for a check (about a minute)")
    p.add_argument("--only", type=int, choices=(1, 2), help="run one experiment")
    p.add_argument("--sizes", default="5,20,80,320", help="experiment 1 mailbox sizes, MB")
    p.add_argument("--fractions", default="0.01,0.1,0.25,0.5,0.75,0.99", help="experiment 1 deletion distances, as fractions of the file")
    p.add_argument("--messages", type=int, default=80_000, help="experiment 2 mailbox size, in messages")
    p.add_argument("--deletions", default="10000,20000,40000", help="experiment 2 checkpoints")
    p.add_argument("--batch", type=int, default=1000, help="experiment 2 deletions per session (QUIT)")
    p.add_argument("--interleave", type=int, default=16, help="experiment 2: messages per fsync'd batch while building")
    p.add_argument("--budget", type=int, default=MboxSettings.compact_budget, help="store.mbox.compact_budget for ours")
    p.add_argument("--window", type=int, default=MboxSettings.defrag_window, help="store.mbox.defrag_window for ours")
    p.add_argument("--min-extents", type=int, default=MboxSettings.defrag_min_extents,
                   help="store.mbox.defrag_min_extents for ours")
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one under ./var)")
    p.add_argument("--max-seconds", type=float, default=840.0, help="stop experiment 2's deletions after this")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.messages, args.deletions, args.batch = "5,20", 8000, "1000,2000,4000", 250
        args.fractions = "0.01,0.5,0.99"
    started = time.perf_counter()
    deadline = started + args.max_seconds
    tuning = {"compact_budget": args.budget, "defrag_window": args.window, "defrag_min_extents": args.min_extents}
    base = Path(args.dir) if args.dir else Path(__file__).resolve().parent.parent / "var"
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-mbox-", dir=base))
    print(f"# bench_mbox on {os.uname().nodename}, {os.cpu_count()} cores, work dir {work} "
          f"(collapse {'supported' if mbox_fs.supports_collapse(work) else 'NOT supported'}); ours: "
          + ", ".join(f"{k}={v}" for k, v in tuning.items()), flush=True)
    try:
        if args.only in (None, 1):
            lines = asyncio.run(experiment_distance(
                work, [int(s) for s in args.sizes.split(",")], [float(f) for f in args.fractions.split(",")], tuning))
            print("\n".join(lines), flush=True)
            print(flush=True)
        if args.only in (None, 2):
            checkpoints = [0] + [int(d) for d in args.deletions.split(",")]
            lines = asyncio.run(experiment_fragmentation(
                work, args.messages, checkpoints, args.batch, args.interleave, deadline, tuning))
            print("\n".join(lines), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"# done in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
