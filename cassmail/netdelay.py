"""Hold packets for a fixed time before letting them go: latency for `cassmail cluster delay`.

The kernel's netem qdisc is the usual tool, but kernels built without it (sch_netem is a
module many small VM kernels leave out) still have netfilter's queue: an iptables rule
`-j NFQUEUE --queue-num Q` hands each matching packet to this process, which gives the
verdict ACCEPT `ms` milliseconds later. Verdicts go out in arrival order and every packet
waits the same time, so nothing is reordered and TCP sees only a longer round trip.

It speaks nfnetlink_queue over a raw netlink socket with the standard library only
(linux/netfilter/nfnetlink_queue.h), so it needs no C library; it runs inside a node's
network namespace (`ip netns exec`), one process per delayed node, until SIGTERM.
Loss is not done here: an iptables `statistic` match drops that share before the queue.
"""

from __future__ import annotations

import argparse
import collections
import os
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
SOL_NETLINK = 270
NETLINK_NO_ENOBUFS = 5
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_CFG_F_FAIL_OPEN = 1
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
NF_ACCEPT = 1
QUEUE_MAXLEN = 20000


def _attr(kind: int, payload: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def _message(msg: int, queue: int, attrs: bytes, flags: int = NLM_F_REQUEST, seq: int = 0) -> bytes:
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs
    return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg, flags, seq, 0) + body


def _attrs(data: bytes) -> dict[int, bytes]:
    found = {}
    while len(data) >= 4:
        length, kind = struct.unpack_from("=HH", data)
        if length < 4:
            break
        found[kind & 0x7FFF] = data[4:length]
        data = data[(length + 3) & ~3:]
    return found


class Delayer:
    """One bound queue and the packets it holds, oldest first."""

    def __init__(self, queue: int, delay: float) -> None:
        self.queue, self.delay = queue, delay
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)
        self.sock.bind((0, 0))
        self.held: collections.deque[tuple[float, int]] = collections.deque()
        self._config(_attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_BIND, socket.AF_INET)), 1)
        self._config(_attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META)), 2)
        self._config(_attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", QUEUE_MAXLEN)), 3)
        # When the queue is full, let packets through rather than drop them: the fault is latency.
        self._config(_attr(NFQA_CFG_FLAGS, struct.pack("!I", NFQA_CFG_F_FAIL_OPEN))
                     + _attr(NFQA_CFG_MASK, struct.pack("!I", NFQA_CFG_F_FAIL_OPEN)), 4)

    def _config(self, attrs: bytes, seq: int) -> None:
        """Send one config request and read its acknowledgement (an error code of 0)."""
        self.sock.send(_message(NFQNL_MSG_CONFIG, self.queue, attrs, NLM_F_REQUEST | NLM_F_ACK, seq))
        while True:
            data = self.sock.recv(65536)
            _length, kind, _flags, got_seq, _pid = struct.unpack_from("=IHHII", data)
            if kind == NLMSG_ERROR and got_seq == seq:
                (error,) = struct.unpack_from("=i", data, 16)
                if error:
                    raise OSError(-error, f"nfnetlink_queue config {seq}: {os.strerror(-error)}")
                return

    def _receive(self) -> None:
        data = self.sock.recv(1 << 20)
        now = time.monotonic()
        while len(data) >= 16:
            length, kind, _flags, _seq, _pid = struct.unpack_from("=IHHII", data)
            if length < 16:
                break
            if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
                header = _attrs(data[20:length]).get(NFQA_PACKET_HDR)
                if header:
                    (packet_id,) = struct.unpack_from("!I", header)
                    self.held.append((now + self.delay, packet_id))
            data = data[(length + 3) & ~3:]

    def _release(self) -> None:
        now = time.monotonic()
        while self.held and self.held[0][0] <= now:
            _due, packet_id = self.held.popleft()
            verdict = _attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, packet_id))
            self.sock.send(_message(NFQNL_MSG_VERDICT, self.queue, verdict))

    def serve(self, stop: list[bool]) -> None:
        while not stop:
            wait = max(0.0, self.held[0][0] - time.monotonic()) if self.held else 1.0
            readable, _, _ = select.select([self.sock], [], [], wait)
            if readable:
                self._receive()
            self._release()
        # Let everything still held go at once: stopping the delay must not drop packets.
        self.held = collections.deque((0.0, packet_id) for _due, packet_id in self.held)
        self._release()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Delay the packets of one netfilter queue by a fixed time.")
    parser.add_argument("--queue", type=int, required=True, help="the NFQUEUE number the iptables rules name")
    parser.add_argument("--ms", type=int, required=True, help="milliseconds each packet is held")
    args = parser.parse_args(argv)
    stop: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    signal.signal(signal.SIGINT, lambda *_: stop.append(True))
    try:
        delayer = Delayer(args.queue, args.ms / 1000)
    except OSError as exc:
        print(f"netdelay: cannot bind netfilter queue {args.queue}: {exc}", file=sys.stderr)
        return 1
    print(f"netdelay: queue {args.queue}, {args.ms} ms", flush=True)
    delayer.serve(stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
