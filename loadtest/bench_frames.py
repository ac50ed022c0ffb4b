"""How a worker's Cassandra connections cut answers into frames: cassmail's reading against the
driver's, side by side in one run (cassandra_io.LoopConnection).

Not a test, and no Cassandra: a socket pair stands in for the connection's socket, and the frames
written into it are CQL v4 frames of the given body sizes. Each round writes a batch of frames
(as many as arrive together under load) and reads them with `_readable` (cassmail's framing) or
`_read_for_driver` (the driver's buffer and `process_io_buffer`, which cassmail keeps for v5's
checksummed segments); the frames' bodies are handed to a `process_msg` that only counts them,
so what is measured is the reading and framing alone. CPU time of this process per frame:

    .venv/bin/python loadtest/bench_frames.py
"""

from __future__ import annotations

import argparse
import os
import socket
import struct
import time
from typing import Any

from cassandra.connection import _ConnectionIOBuffer

from cassmail.store.cassandra_io import IN_BUFFER_SIZE, LoopConnection

#: (body size, frames written at once): a listing's or a flag's answer, a page of a listing, chunks
SHAPES = ((300, 64), (4_000, 32), (40_000, 8), (262_144, 1), (262_144, 8))


class _Reader(LoopConnection):
    """A LoopConnection on one end of a socket pair, without the driver's connection set-up."""

    def __init__(self, sock: socket.socket) -> None:  # (no Connection.__init__: nothing to connect)
        self._socket = sock
        self._io_buffer = _ConnectionIOBuffer(self)
        self._current_frame = None
        self._is_checksumming_enabled = False
        self._start_framing()
        self.is_closed = self.is_defunct = False
        self.frames = 0

    def process_msg(self, header: Any, body: bytes) -> None:
        self.frames += 1


def _batch(size: int, count: int) -> bytes:
    return (struct.pack(">BBhBi", 0x84, 0, 1, 8, size) + os.urandom(size)) * count


def measure(how: str, size: int, count: int, rounds: int) -> float:
    """CPU microseconds per frame of reading `rounds` batches of `count` frames."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        for s, opt in ((ours, socket.SO_RCVBUF), (theirs, socket.SO_SNDBUF)):
            s.setsockopt(socket.SOL_SOCKET, opt, 8 << 20)
        ours.setblocking(False)
        reader, batch = _Reader(ours), _batch(size, count)
        read = reader._readable if how == "cassmail" else reader._read_for_driver
        spent = 0.0
        for _ in range(rounds):
            theirs.sendall(batch)
            start = time.process_time()
            while reader.frames < count:
                read()
            spent += time.process_time() - start
            reader.frames = 0
    return spent / (rounds * count) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=300, help="batches per measurement (default 300)")
    parser.add_argument("--repeat", type=int, default=3, help="measurements per cell, the best kept (default 3)")
    args = parser.parse_args(argv)
    print(f"# reading CQL v4 frames from a socket pair: {args.rounds} batches a measurement, best of "
          f"{args.repeat}; recv() size {IN_BUFFER_SIZE} bytes\n")
    print("| body bytes | frames a batch | driver us/frame | cassmail us/frame | driver/cassmail |")
    print("|---:|---:|---:|---:|---:|")
    for size, count in SHAPES:
        rounds = max(10, args.rounds * 300 // max(size, 300) if size > 40_000 else args.rounds)
        best = {how: min(measure(how, size, count, rounds) for _ in range(args.repeat))
                for how in ("driver", "cassmail")}
        print(f"| {size:,} | {count} | {best['driver']:.1f} | {best['cassmail']:.1f} | "
              f"{best['driver'] / best['cassmail']:.1f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
