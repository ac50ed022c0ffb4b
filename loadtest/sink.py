"""A fast SMTP sink for the outbound benchmark: accepts every message and throws it away,
counting messages and bytes.

Not aiosmtpd: aiosmtpd reads DATA line by line in Python (tens of MB/s on one core), which
would make the sink what a benchmark measures. Here DATA is read in blocks with cassmail's
own reader (`cassmail.smtp.protocol.read_data`). It speaks just enough ESMTP for an MTA's
client (EHLO with PIPELINING, 8BITMIME, SIZE; MAIL, RCPT, DATA, RSET, NOOP, QUIT) and prints
`seconds messages bytes` once a second (cumulative), so a benchmark reads its progress.

    .venv/bin/python loadtest/sink.py --port 2526
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from cassmail.smtp.protocol import read_data

LIMIT = 128 * 1024 * 1024


class Counts:
    def __init__(self) -> None:
        self.messages = 0
        self.bytes = 0
        self.connections = 0


async def session(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, counts: Counts) -> None:
    counts.connections += 1
    writer.write(b"220 sink.bench ESMTP\r\n")
    try:
        while True:
            line = await reader.readline()
            if not line:
                return
            verb = line[:4].upper()
            if verb in (b"EHLO", b"LHLO"):
                writer.write(b"250-sink.bench\r\n250-PIPELINING\r\n250-8BITMIME\r\n250-SIZE %d\r\n250 SMTPUTF8\r\n" % LIMIT)
            elif verb == b"HELO":
                writer.write(b"250 sink.bench\r\n")
            elif verb == b"DATA":
                writer.write(b"354 go ahead\r\n")
                await writer.drain()
                data = await read_data(reader, LIMIT)
                counts.messages += 1
                counts.bytes += len(data)
                writer.write(b"250 2.0.0 OK\r\n")
            elif verb == b"QUIT":
                writer.write(b"221 2.0.0 bye\r\n")
                await writer.drain()
                return
            else:  # MAIL, RCPT, RSET, NOOP
                writer.write(b"250 2.0.0 OK\r\n")
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        return
    finally:
        writer.close()


async def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    counts = Counts()
    server = await asyncio.start_server(lambda r, w: session(r, w, counts), args.host, args.port, backlog=1024)
    start = time.monotonic()
    print(f"listening {args.host}:{args.port}", flush=True)
    async with server:
        while True:
            await asyncio.sleep(1)
            print(f"{time.monotonic() - start:.3f} {counts.messages} {counts.bytes} {counts.connections}", flush=True)


if __name__ == "__main__":
    try:
        sys.exit(asyncio.run(main()))
    except KeyboardInterrupt:
        sys.exit(0)
