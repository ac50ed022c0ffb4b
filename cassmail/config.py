"""One typed settings object: TOML file, then environment, then command-line flags.

Setting names are a public interface (operators' files and scripts use them).
Every value is checked at start-up; a bad one stops start-up with one line
naming the key and what is wrong (`ConfigError`).

Environment overrides are `CASSMAIL_<SECTION>_<KEY>` with dots as underscores,
e.g. `CASSMAIL_STORE_CASSANDRA_CONTACT_POINTS=10.0.0.1,10.0.0.2`; flags are
`--set store.cassandra.keyspace=mail` (TOML syntax for the value, or a bare word).
A variable that starts like a section (`CASSMAIL_STORE_...`, `CASSMAIL_SMTP_...`) but
names no setting is refused like an unknown key in the file, so a typo cannot pass
unnoticed; other `CASSMAIL_*` variables (CASSMAIL_CONFIG, CASSMAIL_CLUSTER,
CASSMAIL_CACHE, CASSMAIL_TEST_*, CASSMAIL_LOADTEST_*, the load tests' bare
CASSMAIL_SMTP / CASSMAIL_POP3 / CASSMAIL_IMAP, compose's CASSMAIL_RF, ...) are not
settings and are left alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import ipaddress
import json
import os
import re
import socket
import tomllib
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONSISTENCY_LEVELS = (
    "ANY", "ONE", "TWO", "THREE", "QUORUM", "ALL", "LOCAL_QUORUM", "EACH_QUORUM", "LOCAL_ONE",
)
SERIAL_LEVELS = ("SERIAL", "LOCAL_SERIAL")
ENV_PREFIX = "CASSMAIL_"


class ConfigError(ValueError):
    """A setting is missing, unknown or invalid; str() is the one line to show."""


def _check(cond: bool, key: str, why: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {why}")


# --------------------------------------------------------------------------- sections


@dataclass
class NodeSettings:
    #: Name of this node in Received: headers and logs.
    name: str = field(default_factory=socket.getfqdn)
    #: Worker processes sharing the listening sockets (SO_REUSEPORT); 0 = one per CPU core.
    workers: int = 0
    #: Log level of `cassmail serve`: DEBUG, INFO, WARNING or ERROR.
    log_level: str = "INFO"
    #: Seconds a stopping node (SIGTERM) lets sessions in progress finish before it cuts them;
    #: a container's stop timeout must be longer (docker-compose.yml gives 20 s).
    stop_grace: float = 10.0

    def validate(self, prefix: str) -> None:
        _check(bool(self.name.strip()), f"{prefix}.name", "must not be empty")
        _check(0 <= self.stop_grace <= 600, f"{prefix}.stop_grace", "must be 0-600 seconds")
        _check(0 <= self.workers <= 256, f"{prefix}.workers", "must be 0 (one per core) .. 256")
        _check(
            self.log_level.upper() in ("DEBUG", "INFO", "WARNING", "ERROR"),
            f"{prefix}.log_level",
            f"must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}",
        )


@dataclass
class CassandraSettings:
    #: Cassandra nodes the driver first connects to (it discovers the rest of the cluster).
    contact_points: list[str] = field(default_factory=lambda: ["127.0.0.1"])
    #: Cassandra's CQL (native protocol) port.
    port: int = 9042
    #: Keyspace holding every table; `cassmail schema apply` creates it.
    keyspace: str = "cassmail"
    #: "SimpleStrategy" (one data centre) or "NetworkTopologyStrategy" (per-DC factors in `datacenters`).
    replication_strategy: str = "SimpleStrategy"
    #: SimpleStrategy only: replicas of every partition (applied by `cassmail schema apply`).
    replication_factor: int = 1
    #: NetworkTopologyStrategy only: {"dc1" = 3, "dc2" = 2}.
    datacenters: dict[str, int] = field(default_factory=dict)
    #: Data centre this node prefers for its requests ("" = the driver's default policy).
    local_dc: str = ""
    #: Consistency level of reads: with RF=3, QUORUM/LOCAL_QUORUM reads see every acknowledged write (R + W >
    #: RF); ONE may miss one for a while after a node failure.
    read_consistency: str = "LOCAL_QUORUM"
    #: Consistency level of writes: a write acknowledged to a client (SMTP 250) was stored at this level; ALL
    #: refuses writes (4xx, senders retry) while any replica is down.
    write_consistency: str = "LOCAL_QUORUM"
    #: Paxos level of the few lightweight transactions (IMAP UID allocation, account and mailbox creation,
    #: queue leases): SERIAL across data centres, LOCAL_SERIAL within one.
    serial_consistency: str = "LOCAL_SERIAL"
    #: Seconds before a request to Cassandra is abandoned (a StoreUnavailable, SMTP 451).
    request_timeout: float = 10.0
    #: Seconds to wait for the cluster when the store is opened.
    connect_timeout: float = 10.0
    #: CQL native protocol version, 4 or 5. Version 5 checksums every frame on the wire, which
    #: the Python driver does in Python: 1.6 to 1.8 times the client CPU per message written or
    #: read. Version 4's frames rely on TCP's own checksum (and TLS's, where used).
    protocol_version: int = 4
    #: Credentials for Cassandra's PasswordAuthenticator ("" = none).
    username: str = ""
    #: Password of `username`.
    password: str = ""
    #: Bodies are cut into chunks of this many bytes, each its own partition (well under
    #: Cassandra's cell and frame limits).
    chunk_size: int = 256 * 1024
    #: A queued outbound message of up to this many bytes (one chunk at least) is kept in its
    #: queue entry (one write to queue it, one delete to finish it); a larger one in chunks like
    #: a mailbox's body. Well under Cassandra's largest mutation (half of
    #: `commitlog_segment_size`, 16 MiB by default) and frame (`native_transport_max_frame_size`).
    queue_inline_max: int = 4 * 1024 * 1024
    #: Chunk reads/writes kept in flight per message.
    chunk_concurrency: int = 8
    #: Chunk reads/writes in flight across all messages of one process (64 x 256 KiB = 16 MiB;
    #: a body of two chunks is read as one of them).
    max_chunks_in_flight: int = 64
    #: Seconds a deleted range must age before listings skip it by the low-water mark; must
    #: exceed clock skew between nodes plus the longest replication delay (hint window).
    tombstone_grace: float = 3 * 3600.0
    #: Seconds a worker may reuse a mailbox's row (its id, UIDVALIDITY) for calls on the messages
    #: of a mailbox it has just resolved (an IMAP session's every command), instead of reading it
    #: again; 0 reads it every time. Delivery and listings always read it; EXPUNGE and other
    #: deletions, and the copies of COPY and MOVE, may reuse it. A rename or deletion made on
    #: another node reaches this one's sessions that much later. RCPT's quota check reuses the
    #: account row its user lookup read for as long (the delivery checks the limit again).
    mailbox_cache: float = 1.0
    #: A process that delivered this many messages to one mailbox within 10 minutes gives them
    #: their UIDs in the background (a conditional batch per 1,024, never before the delivery's
    #: reply), so that the next SELECT of a mailbox that got much mail meanwhile does not number
    #: all of it; 0 leaves all numbering to the listings (cassmail/store/cassandra_ahead.py).
    number_ahead: int = 1024

    def validate(self, prefix: str) -> None:
        _check(bool(self.contact_points), f"{prefix}.contact_points", "needs at least one host")
        _check(0 < self.port < 65536, f"{prefix}.port", f"must be a TCP port, got {self.port}")
        _check(
            self.keyspace.replace("_", "a").isalnum() and self.keyspace[:1].isalpha() and len(self.keyspace) <= 48,
            f"{prefix}.keyspace",
            f"must be letters, digits and _ (starting with a letter, at most 48), got {self.keyspace!r}",
        )
        _check(
            self.replication_strategy in ("SimpleStrategy", "NetworkTopologyStrategy"),
            f"{prefix}.replication_strategy",
            f"must be SimpleStrategy or NetworkTopologyStrategy, got {self.replication_strategy!r}",
        )
        _check(self.replication_factor >= 1, f"{prefix}.replication_factor", "must be >= 1")
        _check(self.protocol_version in (4, 5), f"{prefix}.protocol_version", f"must be 4 or 5, got {self.protocol_version}")
        if self.replication_strategy == "NetworkTopologyStrategy":
            _check(bool(self.datacenters), f"{prefix}.datacenters", "NetworkTopologyStrategy needs per-DC factors")
            for dc, rf in self.datacenters.items():
                _check(rf >= 1, f"{prefix}.datacenters.{dc}", "must be >= 1")
        for key in ("read_consistency", "write_consistency"):
            _check(
                getattr(self, key).upper() in CONSISTENCY_LEVELS,
                f"{prefix}.{key}",
                f"must be one of {', '.join(CONSISTENCY_LEVELS)}, got {getattr(self, key)!r}",
            )
        _check(self.read_consistency.upper() != "ANY", f"{prefix}.read_consistency", "ANY is for writes only")
        _check(
            self.serial_consistency.upper() in SERIAL_LEVELS,
            f"{prefix}.serial_consistency",
            f"must be SERIAL or LOCAL_SERIAL, got {self.serial_consistency!r}",
        )
        _check(self.request_timeout > 0, f"{prefix}.request_timeout", "must be > 0 seconds")
        _check(self.connect_timeout > 0, f"{prefix}.connect_timeout", "must be > 0 seconds")
        _check(
            4096 <= self.chunk_size <= 1024 * 1024,
            f"{prefix}.chunk_size",
            f"must be between 4096 and 1048576 bytes, got {self.chunk_size}",
        )
        _check(
            0 <= self.queue_inline_max <= 8 * 1024 * 1024,
            f"{prefix}.queue_inline_max",
            f"must be between 0 and 8388608 bytes, got {self.queue_inline_max}",
        )
        _check(self.chunk_concurrency >= 1, f"{prefix}.chunk_concurrency", "must be >= 1")
        _check(self.max_chunks_in_flight >= 1, f"{prefix}.max_chunks_in_flight", "must be >= 1")
        _check(self.tombstone_grace >= 0, f"{prefix}.tombstone_grace", "must be >= 0 seconds")
        _check(self.number_ahead >= 0, f"{prefix}.number_ahead", "must be >= 0 (0 = off)")
        _check(0 <= self.mailbox_cache <= 60, f"{prefix}.mailbox_cache", "must be 0-60 seconds")


@dataclass
class MboxSettings:
    #: Data directory: domains, users, password hashes and every mailbox (one mbox file each).
    path: str = "./var/mail"
    #: Reclaim the space of deleted mail during the deletion itself (POP3 QUIT, IMAP EXPUNGE).
    compact_on_delete: bool = True
    #: Bytes one deletion may write while compacting (pads, defragmentation moves, a rewritten
    #: tail); what is left waits for the next deletion or `cassmail store compact`.
    compact_budget: int = 32 * 1024 * 1024
    #: Seconds one deletion may spend defragmenting after its collapses.
    compact_seconds: float = 0.5
    #: "auto": collapse ranges where the file system can (ext4, XFS), else rewrite the tail;
    #: "collapse": require it; "rewrite": always rewrite the tail (the classic mbox way).
    method: str = "auto"
    #: Move data to merge small extents around collapse points (ext4 only).
    defrag: bool = True
    #: Largest run of extents moved at once, in bytes (a multiple of 4096).
    defrag_window: int = 1024 * 1024
    #: A run is moved only when it holds at least this many extents (moving removes all but one).
    defrag_min_extents: int = 8
    #: Also take `<mbox>.lock` dot-locks, for mbox tools that do not use fcntl locks.
    dotlock: bool = True
    #: Seconds to wait for a mailbox lock before answering "try again later".
    lock_timeout: float = 30.0
    #: Bytes reserved in each message's X-Keywords header so keyword changes are in-place writes.
    keyword_reserve: int = 64
    #: fsync before acknowledging; false only for throw-away test data.
    fsync: bool = True

    def validate(self, prefix: str) -> None:
        _check(bool(self.path.strip()), f"{prefix}.path", "must name a directory")
        _check(self.compact_budget >= 0, f"{prefix}.compact_budget", "must be >= 0 bytes")
        _check(self.compact_seconds > 0, f"{prefix}.compact_seconds", "must be > 0 seconds")
        _check(
            self.method in ("auto", "collapse", "rewrite"),
            f"{prefix}.method",
            f"must be auto, collapse or rewrite, got {self.method!r}",
        )
        _check(
            self.defrag_window % 4096 == 0 and 64 * 1024 <= self.defrag_window <= 1024**3,
            f"{prefix}.defrag_window",
            f"must be a multiple of 4096 between 65536 and 1073741824, got {self.defrag_window}",
        )
        _check(self.defrag_min_extents >= 2, f"{prefix}.defrag_min_extents", "must be >= 2")
        _check(self.lock_timeout > 0, f"{prefix}.lock_timeout", "must be > 0 seconds")
        _check(0 <= self.keyword_reserve <= 4096, f"{prefix}.keyword_reserve", "must be between 0 and 4096 bytes")


@dataclass
class WheelFSSettings:
    """The WheelFS store (store/wheelfs.py): one file per message on a shared file system."""

    #: Directory of the store: a WheelFS mount (e.g. /wfs/mail) or any shared POSIX file system.
    root: str = "./var/wheelfs"
    #: Put WheelFS semantic cues in paths; false on NFS, CephFS or a local directory.
    cues: bool = True
    #: Mail (bodies, listings, flags, tombstones) under .EventualConsistency: reads and writes
    #: go to a backup when the primary is slow or down. Accounts and UIDs never are.
    eventual_consistency: bool = True
    #: .Site=X: the site that holds the primary copy ("" = no cue, WheelFS places it).
    home_site: str = ""
    #: .KeepTogether: each user's files on one set of servers (the cues sit above the user directories).
    keep_together: bool = True
    #: .RepSites=N: replicas spread over N sites (0 = no cue).
    rep_sites: int = 0
    #: .RepLevel=N: replicas of every file (WheelFS allows 1..4; its default is 3).
    rep_level: int = 3
    #: .SyncLevel=N: replicas that must accept a mail write before it returns (0 = no cue: all).
    sync_level: int = 0
    #: .MaxTime=T: milliseconds a mail read or write may wait for the network (0 = no cue).
    max_time: int = 0
    #: fsync bodies and markers before acknowledging; false only for throw-away test data.
    fsync: bool = True
    #: Bytes per read when a body is streamed.
    chunk_size: int = 256 * 1024
    #: Seconds one store call may take before it fails as "store unavailable" (SMTP 451).
    timeout: float = 30.0
    #: Seconds after which a UID claim file that is still empty counts as abandoned (by its
    #: mtime: must exceed the clock skew between the nodes and the file server).
    claim_timeout: float = 60.0
    #: Seconds a deletion record is kept (0 = for ever). A replica apart for longer than this
    #: could bring a deleted message back, so it must outlast any partition (Cassandra's gc_grace).
    tombstone_grace: float = 30 * 86400.0

    def validate(self, prefix: str) -> None:
        _check(bool(self.root.strip()), f"{prefix}.root", "must name a directory")
        _check(1 <= self.rep_level <= 4, f"{prefix}.rep_level", f"must be 1..4 (WheelFS keeps at most 4), got {self.rep_level}")
        _check(0 <= self.rep_sites <= self.rep_level, f"{prefix}.rep_sites", "must be 0 (no cue) .. rep_level")
        _check(0 <= self.sync_level <= self.rep_level, f"{prefix}.sync_level", "must be 0 (no cue) .. rep_level")
        _check(self.max_time >= 0, f"{prefix}.max_time", "must be >= 0 ms")
        _check(
            all(c.isalnum() or c in "-_" for c in self.home_site),
            f"{prefix}.home_site",
            f"must be letters, digits, - and _, got {self.home_site!r}",
        )
        _check(
            4096 <= self.chunk_size <= 4 * 1024 * 1024,
            f"{prefix}.chunk_size",
            f"must be between 4096 and 4194304 bytes, got {self.chunk_size}",
        )
        _check(self.timeout > 0, f"{prefix}.timeout", "must be > 0 seconds")
        _check(self.claim_timeout >= 1, f"{prefix}.claim_timeout", "must be >= 1 second")
        _check(self.tombstone_grace >= 0, f"{prefix}.tombstone_grace", "must be >= 0 seconds (0 = keep for ever)")


@dataclass
class StoreSettings:
    #: "mbox" (the embedded default: local files, nothing to set up), "cassandra" (a cluster) or
    #: "wheelfs" (one file per message on a shared file system).
    backend: str = "mbox"
    #: Largest message accepted, in bytes (SMTP SIZE, IMAP APPEND limit).
    max_message_size: int = 64 * 1024 * 1024
    #: Seconds `serve` keeps trying to open a store that is not ready (Cassandra still starting,
    #: keyspace not made yet), logging each retry; 0 gives up at once (exit status 3).
    open_wait: float = 0.0
    #: Seconds an expunged message's UID is remembered at least, so an IMAP client that
    #: resynchronises with QRESYNC learns it is gone (VANISHED); a client away for longer
    #: resynchronises in full.
    vanished_keep: float = 30 * 86400.0
    cassandra: CassandraSettings = field(default_factory=CassandraSettings)
    mbox: MboxSettings = field(default_factory=MboxSettings)
    wheelfs: WheelFSSettings = field(default_factory=WheelFSSettings)

    def validate(self, prefix: str) -> None:
        _check(
            self.backend in ("cassandra", "mbox", "wheelfs"),
            f"{prefix}.backend",
            f"must be cassandra, mbox or wheelfs, got {self.backend!r}",
        )
        _check(self.max_message_size >= 1024, f"{prefix}.max_message_size", "must be at least 1024 bytes")
        _check(self.open_wait >= 0, f"{prefix}.open_wait", "must be >= 0 seconds")
        _check(self.vanished_keep >= 3600, f"{prefix}.vanished_keep", "must be at least 3600 seconds")


@dataclass
class AuthSettings:
    #: scrypt cost for new password hashes (existing hashes keep the cost they were made with).
    scrypt_n: int = 2**14
    #: scrypt block size for new password hashes.
    scrypt_r: int = 8
    #: scrypt parallelism for new password hashes.
    scrypt_p: int = 1
    #: Login attempts a node counts before slowing answers down, per client address and per
    #: account, across all its listeners and worker processes (attempts in progress count).
    free_attempts: int = 2
    #: Peers and accounts the node's attempt counter holds (24 bytes each, shared by its workers);
    #: when full, the one counted longest ago is forgotten.
    throttle_entries: int = 65536

    def validate(self, prefix: str) -> None:
        _check(self.free_attempts >= 0, f"{prefix}.free_attempts", "must be >= 0")
        _check(self.throttle_entries >= 16, f"{prefix}.throttle_entries", "must be >= 16")
        n = self.scrypt_n
        _check(n >= 2**10 and n & (n - 1) == 0, f"{prefix}.scrypt_n", f"must be a power of two >= 1024, got {n}")
        _check(self.scrypt_r >= 1, f"{prefix}.scrypt_r", "must be >= 1")
        _check(self.scrypt_p >= 1, f"{prefix}.scrypt_p", "must be >= 1")


@dataclass
class ListenerSettings:
    #: Run this listener in `cassmail serve`.
    enabled: bool = True
    #: Address and port to listen on, "host:port" (IPv6 as "[::1]:port").
    listen: str = "127.0.0.1:0"
    #: PEM certificate chain and key; with them STARTTLS (or STLS) is offered.
    tls_cert: str = ""
    #: PEM private key of `tls_cert` (the two go together).
    tls_key: str = ""
    #: TLS from the first byte (ports 465, 993, 995 style) instead of STARTTLS.
    implicit_tls: bool = False
    #: Offer password authentication without TLS (only for trusted networks and tests).
    allow_plaintext_auth: bool = False
    #: Seconds a session may stay idle before it is closed.
    timeout: float = 300.0
    #: Failed authentications before the session is closed.
    max_auth_failures: int = 3
    #: Sessions one worker process serves at once; more are turned away at once (SMTP 421).
    max_connections: int = 1000
    #: Seconds an answer to a failed login waits once a peer or user has failed twice; doubles per
    #: further failure (at most 30 s). 0 turns the slow-down off.
    auth_failure_delay: float = 1.0

    def validate(self, prefix: str) -> None:
        host_port(self.listen, f"{prefix}.listen")
        _check(bool(self.tls_cert) == bool(self.tls_key), f"{prefix}.tls_cert", "tls_cert and tls_key go together")
        for key in ("tls_cert", "tls_key"):
            path = getattr(self, key)
            _check(not path or Path(path).is_file(), f"{prefix}.{key}", f"no such file: {path}")
        _check(not (self.enabled and self.implicit_tls) or bool(self.tls_cert), f"{prefix}.implicit_tls",
               "needs tls_cert and tls_key")
        _check(self.timeout > 0, f"{prefix}.timeout", "must be > 0 seconds")
        _check(self.max_auth_failures >= 1, f"{prefix}.max_auth_failures", "must be >= 1")
        _check(self.max_connections >= 1, f"{prefix}.max_connections", "must be >= 1")
        _check(self.auth_failure_delay >= 0, f"{prefix}.auth_failure_delay", "must be >= 0 seconds")


@dataclass
class SmtpSettings(ListenerSettings):
    #: Recipients accepted per message (more get 452 4.5.3).
    max_recipients: int = 100
    #: Longest command line in bytes (RFC 5321: 512), CRLF not counted; after EHLO, MAIL may be
    #: 36 bytes longer (SIZE, SMTPUTF8). Longer ones get 500 5.5.2.
    max_command_length: int = 512
    #: Times one command may be sent in a session before it is closed with 421 (e.g. RCPT, NOOP).
    max_commands: int = 1000
    #: Commands one connection may send per minute, as a token bucket that holds a minute's worth
    #: (so a pipelined burst passes); past it 421 4.7.0 and the session is closed. DATA content
    #: is not commands. 0 = no limit.
    max_command_rate: int = 600
    #: Connections one peer IP address may open per minute to one worker process (a token bucket
    #: like max_command_rate); past it 421 4.7.0 before the greeting and closed. 0 = no limit.
    max_connection_rate: int = 300
    #: Client networks (CIDR or single addresses) that max_command_rate and max_connection_rate
    #: do not apply to: local relays and load generators; like Postfix's
    #: smtpd_client_event_limit_exceptions. [] = limit everyone.
    rate_limit_exempt: list[str] = field(default_factory=lambda: ["127.0.0.0/8", "::1/128"])
    #: Seconds the list of local domains is cached for RCPT checks.
    domain_cache_seconds: float = 10.0
    #: Mail to `user<delimiter>detail@domain` that names no user or alias reaches `user@domain`
    #: (RFC 5233 subaddresses; Sieve's :detail sees the detail). "" turns it off.
    recipient_delimiter: str = "+"
    #: Submission listeners only: client networks that may submit without AUTH, like Postfix's
    #: mynetworks (applications on the same host, a load generator): their mail may go to any
    #: domain, from any sender, with no copy in Sent. [] = every client authenticates.
    trusted_networks: list[str] = field(default_factory=list)
    #: A recipient over their storage quota (`cassmail user quota`) is refused with 452 4.2.2, so
    #: the sender keeps the message and retries, instead of 552 5.2.2 (mailbox full, final: the
    #: sender bounces it), the default of Postfix's virtual delivery and Dovecot's LMTP (this is
    #: Dovecot's quota_full_tempfail). A recipient found full only after DATA while others of the
    #: same SMTP message took it gets a DSN (5.2.2) either way: SMTP has one reply to DATA.
    quota_full_tempfail: bool = False
    #: DATA past this many bytes is written to an unlinked file in spool_dir as it arrives and
    #: reaches the store mapped from that file, not held in the worker's memory (the kernel's page
    #: cache holds it, and may drop it under memory pressure). 0 = every message in memory.
    spool_above: int = 1 << 20
    #: Directory of those files; "" = the system's temporary directory ($TMPDIR, else /tmp). Put
    #: it on a disk file system: on tmpfs the spooled messages are memory again.
    spool_dir: str = ""

    def validate(self, prefix: str) -> None:
        super().validate(prefix)
        _check(self.spool_above == 0 or self.spool_above >= 65536, f"{prefix}.spool_above",
               f"must be 0 (never spool) or >= 65536 bytes, got {self.spool_above}")
        _check(not self.spool_dir or Path(self.spool_dir).is_dir(), f"{prefix}.spool_dir",
               f"no such directory: {self.spool_dir}")
        _check(1 <= self.max_recipients <= 100_000, f"{prefix}.max_recipients", "must be 1..100000")
        _check(
            512 <= self.max_command_length <= 65536, f"{prefix}.max_command_length", "must be 512..65536 bytes"
        )
        _check(self.max_commands >= 10, f"{prefix}.max_commands", "must be >= 10")
        _check(
            self.max_command_rate == 0 or self.max_command_rate >= 10,
            f"{prefix}.max_command_rate",
            f"must be 0 (no limit) or >= 10 commands per minute, got {self.max_command_rate}",
        )
        _check(
            self.max_connection_rate >= 0,
            f"{prefix}.max_connection_rate",
            f"must be 0 (no limit) or >= 1 connections per minute, got {self.max_connection_rate}",
        )
        for i, network in enumerate(self.rate_limit_exempt):
            try:
                ipaddress.ip_network(network, strict=False)
            except ValueError:
                raise ConfigError(
                    f"{prefix}.rate_limit_exempt[{i}]: must be an IP address or network like 10.0.0.0/8, got {network!r}"
                ) from None
        _check(self.domain_cache_seconds >= 0, f"{prefix}.domain_cache_seconds", "must be >= 0")
        _check(self.recipient_delimiter in ("", "+", "-", "_", "=", "."), f"{prefix}.recipient_delimiter",
               f'must be "" (off) or one of + - _ = ., got {self.recipient_delimiter!r}')
        _check(not self.trusted_networks or prefix not in ("smtp", "lmtp"), f"{prefix}.trusted_networks",
               "is for the submission listeners only (the MX never relays)")
        for i, network in enumerate(self.trusted_networks):
            try:
                ipaddress.ip_network(network, strict=False)
            except ValueError:
                raise ConfigError(
                    f"{prefix}.trusted_networks[{i}]: must be an IP address or network like 10.0.0.0/8, got {network!r}"
                ) from None


@dataclass
class MailboxListenerSettings(ListenerSettings):
    """What POP3 and IMAP listeners share: they list mailboxes, stream messages to clients and
    hold what clients pipeline."""

    #: Message summaries read from the store per request when a session lists a mailbox.
    page_size: int = 500
    #: Bytes a client may send ahead of the command being answered (pipelining); past it the
    #: server stops reading from that client until it has caught up.
    max_pipelined_bytes: int = 64 * 1024
    #: Seconds a client may take no bytes while the server has a message for it (RETR/TOP or
    #: FETCH); past it the connection is dropped, so a client that stops reading cannot hold a
    #: session forever. Not the idle timer: that one waits for the client's next command.
    write_timeout: float = 600.0

    def validate(self, prefix: str) -> None:
        super().validate(prefix)
        _check(
            1024 <= self.max_pipelined_bytes <= 1 << 24,
            f"{prefix}.max_pipelined_bytes",
            f"must be 1024..16777216 bytes, got {self.max_pipelined_bytes}",
        )
        _check(1 <= self.page_size <= 10_000, f"{prefix}.page_size", "must be 1..10000")
        _check(1 <= self.write_timeout <= 86400, f"{prefix}.write_timeout", "must be 1..86400 seconds")


@dataclass
class Pop3Settings(MailboxListenerSettings):
    #: Seconds a session may stay idle before it is closed; RFC 1939 3: at least 10 minutes.
    timeout: float = 600.0
    #: Longest command line in bytes (RFC 2449: 255); longer ones get -ERR and the session goes on.
    max_line_length: int = 1024

    def validate(self, prefix: str) -> None:
        super().validate(prefix)
        _check(self.timeout >= 600, f"{prefix}.timeout", "must be at least 600 seconds (RFC 1939)")
        _check(255 <= self.max_line_length <= 65536, f"{prefix}.max_line_length", "must be 255..65536 bytes")


@dataclass
class ImapSettings(MailboxListenerSettings):
    #: Seconds a session may stay idle before it is closed; RFC 3501 5.4: at least 30 minutes.
    timeout: float = 1800.0
    #: Longest command line in bytes, literals excluded; longer ones get BAD and the session goes on.
    max_line_length: int = 65536
    #: Largest literal other than an APPEND's message (names, passwords, search strings).
    max_string_literal: int = 8192
    #: Seconds between two questions to the store, while sessions IDLE, of which of their
    #: mailboxes changed (on any node): one per worker process, whatever the number of sessions
    #: and mailboxes (a read of recent change events on Cassandra, of inotify on mbox); only the
    #: sessions of a mailbox that changed read anything (what changed; on WheelFS its listing).
    idle_poll: float = 0.5
    #: Seconds after which an IDLE session's mailbox is looked at even if no change was reported:
    #: its changes token is read, and it is listed if the token moved (a change whose event was
    #: lost is seen then).
    idle_refresh: float = 60.0
    page_size: int = 1000
    #: Bytes of parsed message headers each worker keeps (ENVELOPE, HEADER.FIELDS and SEARCH on
    #: headers read a message's header from the store once); 0 keeps none.
    header_cache_bytes: int = 32 * 1024 * 1024
    #: Messages of closed mailbox views each worker keeps: the next SELECT of such a mailbox in
    #: that worker reads only what changed since, not the whole listing (about 300 bytes per
    #: message beside what sessions hold); 0 keeps none.
    snapshot_messages: int = 200_000
    #: Views of mailboxes of at least this many messages are also left in the store when closed
    #: (on a store that keeps them: Cassandra), so that a SELECT on any worker or node reads only
    #: what changed since instead of the whole listing; 0 leaves none there.
    store_snapshot_messages: int = 10_000

    def validate(self, prefix: str) -> None:
        super().validate(prefix)
        _check(self.timeout >= 1800, f"{prefix}.timeout", "must be at least 1800 seconds (RFC 3501)")
        _check(1024 <= self.max_line_length <= 1 << 24, f"{prefix}.max_line_length", "must be 1024..16777216 bytes")
        _check(256 <= self.max_string_literal <= 1 << 20, f"{prefix}.max_string_literal", "must be 256..1048576")
        _check(0.1 <= self.idle_poll <= 600, f"{prefix}.idle_poll", "must be 0.1..600 seconds")
        _check(1 <= self.idle_refresh <= 3600, f"{prefix}.idle_refresh", "must be 1..3600 seconds")
        _check(0 <= self.header_cache_bytes <= 1 << 34, f"{prefix}.header_cache_bytes", "must be 0..17179869184 bytes")
        _check(0 <= self.snapshot_messages <= 100_000_000, f"{prefix}.snapshot_messages", "must be 0..100000000")
        _check(0 <= self.store_snapshot_messages <= 100_000_000, f"{prefix}.store_snapshot_messages",
               "must be 0..100000000")


@dataclass
class ManageSieveSettings(ListenerSettings):
    """The ManageSieve listener (RFC 5804), where mail clients edit their Sieve scripts."""

    #: Longest command line in bytes, literals excluded; longer ones get NO and the session goes on.
    max_line_length: int = 8192

    def validate(self, prefix: str) -> None:
        super().validate(prefix)
        _check(not self.implicit_tls, f"{prefix}.implicit_tls", "ManageSieve has STARTTLS only (RFC 5804)")
        _check(1024 <= self.max_line_length <= 1 << 20, f"{prefix}.max_line_length", "must be 1024..1048576 bytes")


@dataclass
class SieveSettings:
    """Per-user Sieve scripts run at delivery (cassmail.sieve); every limit bounds one script's
    work on one message, and a script past one leaves the message in INBOX."""

    #: Run users' active scripts when mail is delivered to them.
    enabled: bool = True
    #: Largest script a user may store, in bytes (ManageSieve HAVESPACE answers by it).
    max_script_size: int = 64 * 1024
    #: Most scripts one user may store.
    max_scripts: int = 32
    #: Actions one script may take on one message.
    max_actions: int = 32
    #: Of those actions, how many may be redirects.
    max_redirects: int = 4
    #: Longest :regex key, in characters.
    max_regex_length: int = 1024
    #: Seconds one regular expression may run on one value.
    regex_timeout: float = 0.1
    #: Bytes of a message the body test looks at.
    max_body_bytes: int = 1024 * 1024
    #: Vacation (RFC 5230): seconds between two replies to one sender when a script names no period.
    vacation_default_period: float = 7 * 86400.0
    #: The shortest period a script may ask for, in seconds.
    vacation_min_period: float = 86400.0
    #: The longest period a script may ask for, in seconds.
    vacation_max_period: float = 90 * 86400.0
    #: Compiled scripts each worker keeps (by their text).
    cache_size: int = 1000

    def validate(self, prefix: str) -> None:
        _check(64 <= self.max_script_size <= 1 << 20, f"{prefix}.max_script_size", "must be 64..1048576 bytes")
        _check(1 <= self.max_scripts <= 1000, f"{prefix}.max_scripts", "must be 1..1000")
        _check(1 <= self.max_actions <= 1000, f"{prefix}.max_actions", "must be 1..1000")
        _check(0 <= self.max_redirects <= 100, f"{prefix}.max_redirects", "must be 0..100")
        _check(1 <= self.max_regex_length <= 65536, f"{prefix}.max_regex_length", "must be 1..65536")
        _check(0.001 <= self.regex_timeout <= 10, f"{prefix}.regex_timeout", "must be 0.001..10 seconds")
        _check(1024 <= self.max_body_bytes <= 1 << 30, f"{prefix}.max_body_bytes", "must be 1024..1073741824")
        _check(0 < self.vacation_min_period <= self.vacation_default_period <= self.vacation_max_period,
               f"{prefix}.vacation_default_period", "needs 0 < vacation_min_period <= it <= vacation_max_period")
        _check(0 <= self.cache_size <= 1_000_000, f"{prefix}.cache_size", "must be 0..1000000")


@dataclass
class MetricsSettings:
    """The Prometheus endpoint (cassmail.metrics): node-wide totals over every worker, at /metrics."""

    #: Serve counters and histograms in the Prometheus text format over HTTP.
    enabled: bool = False
    #: Address of the HTTP endpoint; keep it on a private interface (it needs no password).
    listen: str = "127.0.0.1:9150"

    def validate(self, prefix: str) -> None:
        host_port(self.listen, f"{prefix}.listen")


TLS_LEVELS = ("none", "may", "encrypt", "verify")


@dataclass
class DeliverySettings:
    """The queue workers (cassmail.delivery) in every worker process of `cassmail serve`."""

    #: Run queue workers on this node; off, the node still queues mail (another node delivers it).
    enabled: bool = True
    #: Deliveries in progress on this node at once, shared out among its worker processes.
    concurrency: int = 40
    #: Connections open to one destination (a domain, or a transport/relayhost next hop) at
    #: once on this node, shared out among its worker processes.
    destination_concurrency: int = 20
    #: Seconds a worker holds an entry before another may take it; renewed every third of it
    #: while the delivery goes on, so it bounds how long a dead node delays its entries.
    lease: float = 300.0
    #: Seconds between two looks at the queue when nothing was due (new local mail wakes the
    #: workers of its process at once).
    poll_interval: float = 1.0
    #: Retry schedule after a temporary failure: the first wait, doubled per attempt up to max_backoff.
    min_backoff: float = 300.0
    #: Seconds: the longest wait between two attempts (the doubling stops there).
    max_backoff: float = 4000.0
    #: Seconds a message may stay queued; then every recipient still pending bounces.
    max_lifetime: float = 5 * 86400.0
    #: Seconds after which the sender is told (once) that a message is still waiting; 0 = never.
    delay_warning: float = 4 * 3600.0
    #: A message with more Received: headers than this is a loop and bounces.
    max_hops: int = 50

    def validate(self, prefix: str) -> None:
        _check(1 <= self.concurrency <= 10_000, f"{prefix}.concurrency", "must be 1..10000")
        _check(1 <= self.destination_concurrency <= 1000, f"{prefix}.destination_concurrency", "must be 1..1000")
        _check(self.lease >= 1, f"{prefix}.lease", "must be >= 1 second")
        _check(0.05 <= self.poll_interval <= 600, f"{prefix}.poll_interval", "must be 0.05..600 seconds")
        _check(self.min_backoff > 0, f"{prefix}.min_backoff", "must be > 0 seconds")
        _check(self.max_backoff >= self.min_backoff, f"{prefix}.max_backoff", "must be >= min_backoff")
        _check(self.max_lifetime > 0, f"{prefix}.max_lifetime", "must be > 0 seconds")
        _check(self.delay_warning >= 0, f"{prefix}.delay_warning", "must be >= 0 seconds (0 = no warning)")
        _check(1 <= self.max_hops <= 1000, f"{prefix}.max_hops", "must be 1..1000")


@dataclass
class RelaySettings:
    """How mail leaves for other domains: routing (DNS, transport map, relayhost) and the SMTP client."""

    #: DNS servers for MX/A/AAAA lookups ("host" or "host:port"); [] = the system's (/etc/resolv.conf).
    nameservers: list[str] = field(default_factory=list)
    #: Port of the hosts found through DNS (MX, or A/AAAA when a domain has no MX).
    port: int = 25
    #: Domain -> next hop, before DNS: "host" (its MX), "host:port", "[host]" or "[host]:port"
    #: (that host itself, no MX lookup). A key ".example.com" also matches its subdomains.
    transport: dict[str, str] = field(default_factory=dict)
    #: Send everything not in the transport map through this host (a provider's smarthost):
    #: "[smtp.example.net]:587" (bracketed: no MX lookup). "" = deliver to each domain's MX.
    relayhost: str = ""
    #: AUTH (PLAIN or LOGIN) at the relayhost; only over TLS.
    relayhost_username: str = ""
    #: Password of `relayhost_username`.
    relayhost_password: str = ""
    #: TLS at the relayhost: "encrypt" (required) or "verify" (required, certificate checked).
    relayhost_tls: str = "encrypt"
    #: TLS from the first byte at the relayhost (port 465 style) instead of STARTTLS.
    relayhost_implicit_tls: bool = False
    #: TLS to other MXs: "none" (never), "may" (STARTTLS when offered, any certificate),
    #: "encrypt" (required, any certificate), "verify" (required, certificate and name checked).
    tls: str = "may"
    #: Per destination domain, a level other than `tls`, e.g. { "bank.example" = "verify" }.
    tls_policy: dict[str, str] = field(default_factory=dict)
    #: CA bundle for "verify" (PEM); "" = the system's.
    tls_ca_file: str = ""
    #: Name given in EHLO; "" = node.name.
    helo_name: str = ""
    #: Seconds to connect and get the greeting.
    connect_timeout: float = 30.0
    #: Seconds for every reply but the greeting (DATA's grows with the message: one more second per 64 KiB).
    timeout: float = 300.0
    #: Seconds for a DNS answer.
    dns_timeout: float = 10.0
    #: Seconds an open connection waits for more mail to the same destination.
    connection_reuse_time: float = 2.0
    #: Messages one connection carries at most.
    connection_reuse_count: int = 100

    def validate(self, prefix: str) -> None:
        for i, server in enumerate(self.nameservers):
            _check(bool(server.strip()), f"{prefix}.nameservers[{i}]", "must not be empty")
            host, _, port = server.rpartition(":") if server.count(":") == 1 else (server, "", "")
            try:
                ipaddress.ip_address((host or server).strip("[]"))
            except ValueError:
                raise ConfigError(f"{prefix}.nameservers[{i}]: must be an IP address (with :port), got {server!r}") from None
            _check(not port or (port.isdigit() and 0 < int(port) < 65536), f"{prefix}.nameservers[{i}]",
                   f"bad port in {server!r}")
        _check(0 < self.port < 65536, f"{prefix}.port", f"must be a TCP port, got {self.port}")
        for domain, hop in self.transport.items():
            _check(next_hop_ok(hop), f"{prefix}.transport.{domain}", f'must be "host", "host:port", "[host]" or "[host]:port", got {hop!r}')
        _check(not self.relayhost or next_hop_ok(self.relayhost), f"{prefix}.relayhost",
               f'must be "host", "host:port", "[host]" or "[host]:port", got {self.relayhost!r}')
        _check(bool(self.relayhost_username) == bool(self.relayhost_password), f"{prefix}.relayhost_username",
               "relayhost_username and relayhost_password go together")
        _check(self.relayhost_tls in ("encrypt", "verify"), f"{prefix}.relayhost_tls",
               f"must be encrypt or verify, got {self.relayhost_tls!r}")
        _check(self.tls in TLS_LEVELS, f"{prefix}.tls", f"must be one of {', '.join(TLS_LEVELS)}, got {self.tls!r}")
        for domain, level in self.tls_policy.items():
            _check(level in TLS_LEVELS, f"{prefix}.tls_policy.{domain}", f"must be one of {', '.join(TLS_LEVELS)}")
        _check(not self.tls_ca_file or Path(self.tls_ca_file).is_file(), f"{prefix}.tls_ca_file",
               f"no such file: {self.tls_ca_file}")
        _check(self.connect_timeout > 0, f"{prefix}.connect_timeout", "must be > 0 seconds")
        _check(self.timeout > 0, f"{prefix}.timeout", "must be > 0 seconds")
        _check(self.dns_timeout > 0, f"{prefix}.dns_timeout", "must be > 0 seconds")
        _check(self.connection_reuse_time >= 0, f"{prefix}.connection_reuse_time", "must be >= 0 seconds")
        _check(self.connection_reuse_count >= 1, f"{prefix}.connection_reuse_count", "must be >= 1")


@dataclass
class InboundSettings:
    """What the MX does with a message between DATA and the store (cassmail.inbound): sender
    authentication (SPF, DKIM, DMARC, ARC; DNS through the [relay] resolver settings) and the
    rspamd spam filter. Submission and LMTP are never checked."""

    #: Check SPF (MAIL FROM and HELO), every DKIM signature, DMARC and the ARC chain, and add one
    #: Authentication-Results header.
    authentication: bool = False
    #: The authserv-id of that header (RFC 8601); "" = node.name. Incoming Authentication-Results
    #: headers that claim this id are forged and removed.
    authserv_id: str = ""
    #: Refuse a message whose From domain fails DMARC with p=reject (550 5.7.1 at the end of DATA).
    dmarc_reject: bool = True
    #: File a message whose From domain fails DMARC with p=quarantine into `junk_mailbox`.
    dmarc_quarantine: bool = True
    #: Refuse a message whose MAIL FROM domain's SPF record says fail ("-all" matched): 550 5.7.23.
    spf_reject_fail: bool = False
    #: Seconds for every check of one message (DNS included); past it the sender is told to retry.
    timeout: float = 20.0
    #: Mailbox of the messages judged junk (DMARC quarantine, rspamd "add header"); made when missing.
    junk_mailbox: str = "Junk"
    #: rspamd's normal worker ("http://127.0.0.1:11333"); "" = no spam filter.
    rspamd_url: str = ""
    #: The worker's password (rspamd's `password` option), sent as the Password header; "" = none.
    rspamd_password: str = ""
    #: Seconds for rspamd's answer.
    rspamd_timeout: float = 15.0
    #: rspamd unreachable or too slow: "accept" the message unfiltered (logged and counted) or
    #: "tempfail" (451, the sender retries).
    rspamd_failure: str = "accept"
    #: File what rspamd marks as spam (its "add header" and "rewrite subject" actions) into
    #: `junk_mailbox`; false only marks it (X-Spam-Flag: YES, rspamd's rewritten Subject) and
    #: leaves it in INBOX for the users' Sieve scripts or mail clients to file.
    rspamd_file_junk: bool = True
    #: Largest message given to rspamd, in bytes; larger ones are accepted unfiltered (as rspamd's
    #: own milter does).
    rspamd_max_size: int = 20 * 1024 * 1024
    #: Teach rspamd what users decide over IMAP: a message flagged \Junk or $Junk, or copied or
    #: moved into the Junk mailbox, is learned as spam; one flagged $NotJunk, or moved out of Junk
    #: (not to Trash), as ham. Sent in the background to rspamd's controller.
    rspamd_learn: bool = False
    #: rspamd's controller worker, where learning goes ("http://127.0.0.1:11334"); "" = the host of
    #: rspamd_url on port 11334. Sent rspamd_password as its Password header.
    rspamd_controller_url: str = ""

    def validate(self, prefix: str) -> None:
        _check(0.5 <= self.timeout <= 600, f"{prefix}.timeout", "must be 0.5..600 seconds")
        _check(0.5 <= self.rspamd_timeout <= 600, f"{prefix}.rspamd_timeout", "must be 0.5..600 seconds")
        _check(self.rspamd_failure in ("accept", "tempfail"), f"{prefix}.rspamd_failure",
               f"must be accept or tempfail, got {self.rspamd_failure!r}")
        _check(not self.rspamd_url or self.rspamd_url.startswith("http://"), f"{prefix}.rspamd_url",
               f'must be "" or an http:// URL, got {self.rspamd_url!r}')
        _check(not self.rspamd_controller_url or self.rspamd_controller_url.startswith("http://"),
               f"{prefix}.rspamd_controller_url", f'must be "" or an http:// URL, got {self.rspamd_controller_url!r}')
        _check(not self.rspamd_learn or bool(self.rspamd_url or self.rspamd_controller_url), f"{prefix}.rspamd_learn",
               "needs rspamd_url or rspamd_controller_url")
        _check(bool(self.junk_mailbox.strip()), f"{prefix}.junk_mailbox", "must not be empty")
        _check(self.rspamd_max_size > 0, f"{prefix}.rspamd_max_size", "must be > 0 bytes")
        _check(all(c.isprintable() and c not in " ;()" for c in self.authserv_id), f"{prefix}.authserv_id",
               "must be a host name (no spaces, ';' or parentheses)")


def next_hop_ok(text: str) -> bool:
    """Whether a transport value or relayhost has one of the forms "host", "host:port", "[host]",
    "[host]:port" (host a name or an IP address)."""
    host, sep, port = text.rpartition(":") if not text.endswith("]") else (text, "", "")
    if not sep:
        host, port = text, ""
    if port and not (port.isdigit() and 0 < int(port) < 65536):
        return False
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return bool(bare) and all(c.isalnum() or c in "-._:" for c in bare)


def _listener(port: int, enabled: bool = True, kind: type = ListenerSettings, implicit_tls: bool = False) -> Any:
    return field(default_factory=lambda: kind(enabled=enabled, listen=f"127.0.0.1:{port}", implicit_tls=implicit_tls))


#: Every listener section and the protocol it speaks: the implicit-TLS ones (ports 465, 993,
#: 995) run beside their STARTTLS siblings (587, 143, 110) with settings of their own.
LISTENER_PROTOCOLS: dict[str, str] = {
    "smtp": "smtp", "submission": "submission", "submissions": "submission", "lmtp": "lmtp",
    "pop3": "pop3", "pop3s": "pop3", "imap": "imap", "imaps": "imap", "managesieve": "managesieve",
}


@dataclass
class Settings:
    node: NodeSettings = field(default_factory=NodeSettings)
    store: StoreSettings = field(default_factory=StoreSettings)
    auth: AuthSettings = field(default_factory=AuthSettings)
    smtp: SmtpSettings = _listener(2525, kind=SmtpSettings)
    submission: SmtpSettings = _listener(2587, kind=SmtpSettings)
    lmtp: SmtpSettings = _listener(2424, enabled=False, kind=SmtpSettings)
    submissions: SmtpSettings = _listener(2465, enabled=False, kind=SmtpSettings, implicit_tls=True)
    pop3: Pop3Settings = _listener(1110, kind=Pop3Settings)
    pop3s: Pop3Settings = _listener(1995, enabled=False, kind=Pop3Settings, implicit_tls=True)
    imap: ImapSettings = _listener(1143, kind=ImapSettings)
    imaps: ImapSettings = _listener(1993, enabled=False, kind=ImapSettings, implicit_tls=True)
    managesieve: ManageSieveSettings = _listener(14190, enabled=False, kind=ManageSieveSettings)
    sieve: SieveSettings = field(default_factory=SieveSettings)
    delivery: DeliverySettings = field(default_factory=DeliverySettings)
    relay: RelaySettings = field(default_factory=RelaySettings)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    inbound: InboundSettings = field(default_factory=InboundSettings)


def host_port(text: str, key: str = "listen") -> tuple[str, int]:
    """Split "host:port" (IPv6 as "[::1]:port"), or ConfigError naming the key."""
    host, sep, port = text.rpartition(":")
    _check(bool(sep) and port.isdigit(), key, f'must be "host:port", got {text!r}')
    _check(0 <= int(port) < 65536, key, f"port out of range in {text!r}")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    _check(bool(host), key, f"missing host in {text!r}")
    return host, int(port)


# --------------------------------------------------------------------------- writing


def toml_value(value: Any) -> str:
    """One value as TOML (what `load` reads back)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"no TOML for {value!r}")


def to_toml(obj: Any, prefix: str = "") -> str:
    """Settings (or one section of them) written back as the TOML file an operator would write."""
    scalars, tables = [], []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            tables.append(to_toml(value, f"{prefix}{f.name}."))
        else:
            scalars.append(f"{f.name} = {toml_value(value)}")
    head = f"[{prefix[:-1]}]\n" if prefix else ""
    return head + "\n".join(scalars) + "\n\n" + "".join(tables)


# --------------------------------------------------------------------------- loading


def load(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Sequence[str] = (),
) -> Settings:
    """Settings from the TOML file (`path`, else $CASSMAIL_CONFIG, else defaults), then
    environment overrides, then `overrides` ("dotted.key=value"), validated."""
    env = os.environ if env is None else env
    path = path or env.get("CASSMAIL_CONFIG") or None
    data: dict[str, Any] = {}
    if path:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: invalid TOML: {exc}") from None
        except UnicodeDecodeError as exc:  # TOML is UTF-8; tomllib lets the decoding error through
            raise ConfigError(f"{path}: invalid TOML: not UTF-8 at byte {exc.start}") from None
    settings = _build(Settings, data, "")
    for key, value in _env_overrides(env):
        _assign(settings, key, value, from_text=True)
    for item in overrides:
        key, sep, value = item.partition("=")
        _check(bool(sep) and bool(key.strip()), item, 'a flag override must be "section.key=value"')
        _assign(settings, key.strip(), value.strip(), from_text=True)
    validate(settings)
    return settings


def validate(obj: Any, prefix: str = "") -> None:
    """Run every section's own checks, depth first; ConfigError names the first bad key."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            key = f"{prefix}{f.name}"
            validate(value, key + ".")
            if hasattr(value, "validate"):
                value.validate(key)


def _build(cls: type, data: Mapping[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in known:
            where = f"{prefix}{key}"
            raise ConfigError(f"{where}: unknown setting (known here: {', '.join(sorted(known))})")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        key = f"{prefix}{f.name}"
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            _check(isinstance(data[f.name], dict), key, "must be a table")
            kwargs[f.name] = _build(hint, data[f.name], key + ".")
        else:
            kwargs[f.name] = _coerce(data[f.name], hint, key, from_text=False)
    return cls(**kwargs)


def _env_overrides(env: Mapping[str, str]) -> list[tuple[str, str]]:
    """Map CASSMAIL_SECTION_KEY variables onto dotted keys by walking the settings tree."""
    paths = {}

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            dotted = f"{prefix}{f.name}"
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], dotted + ".")
            else:
                paths[ENV_PREFIX + dotted.replace(".", "_").upper()] = dotted

    walk(Settings, "")
    sections = {f.name.upper() for f in dataclasses.fields(Settings)}
    found = []
    for name, value in sorted(env.items()):
        if name in paths:
            found.append((paths[name], value))
            continue
        section, sep, _ = name[len(ENV_PREFIX) :].partition("_") if name.startswith(ENV_PREFIX) else ("", "", "")
        if sep and section.upper() in sections:
            close = difflib.get_close_matches(name.upper(), list(paths), n=1, cutoff=0.8)
            hint = f"did you mean {close[0]}?" if close else f"no setting of [{section.lower()}] has this name"
            raise ConfigError(f"{name}: unknown setting in the environment ({hint})")
    return found


def _assign(settings: Settings, dotted: str, value: str, from_text: bool) -> None:
    obj: Any = settings
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        names = {f.name for f in dataclasses.fields(obj)}
        if part not in names:
            raise ConfigError(f"{'.'.join(parts[: i + 1])}: unknown setting (known here: {', '.join(sorted(names))})")
        if i == len(parts) - 1:
            hint = typing.get_type_hints(type(obj))[part]
            _check(not dataclasses.is_dataclass(hint), dotted, "is a section, set one of its keys")
            setattr(obj, part, _coerce(value, hint, dotted, from_text=from_text))
        else:
            obj = getattr(obj, part)
            _check(dataclasses.is_dataclass(obj), dotted, f"{part} is not a section")


def _coerce(value: Any, hint: Any, key: str, from_text: bool) -> Any:
    """Convert a TOML value (or, from the environment/flags, a string) to the field's type."""
    origin = typing.get_origin(hint)
    if from_text and isinstance(value, str) and hint is not str:
        text = value.strip()
        if origin in (list, dict) and text[:1] in "[{":
            try:  # TOML's own syntax first: '{ "a.example" = "[127.0.0.1]:2525" }'
                value = tomllib.loads(f"v = {text}")["v"]
                return _coerce(value, hint, key, from_text=False)
            except tomllib.TOMLDecodeError:
                pass  # the short forms below: [a, b] and {k=v, ...}
        if origin is list:
            value = [v.strip() for v in text.strip("[]").split(",") if v.strip().strip("\"'")]
            value = [v.strip("\"'") for v in value]
        elif origin is dict:
            pairs = [p for p in text.strip("{}").split(",") if p.strip()]
            value = {}
            for pair in pairs:
                k, sep, v = pair.replace(":", "=").partition("=")
                _check(bool(sep), key, f'must be "name=value, ..." got {text!r}')
                value[k.strip().strip("\"'")] = v.strip()
        else:
            value = text
    if hint is bool:
        if isinstance(value, str):
            lowered = value.lower()
            _check(lowered in ("true", "false", "1", "0", "yes", "no", "on", "off"), key, f"must be true or false, got {value!r}")
            return lowered in ("true", "1", "yes", "on")
        _check(isinstance(value, bool), key, f"must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""), 0)
            except ValueError:
                raise ConfigError(f"{key}: must be an integer, got {value!r}") from None
        _check(isinstance(value, int) and not isinstance(value, bool), key, f"must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise ConfigError(f"{key}: must be a number, got {value!r}") from None
        _check(isinstance(value, (int, float)) and not isinstance(value, bool), key, f"must be a number, got {value!r}")
        return float(value)
    if hint is str:
        _check(isinstance(value, str), key, f"must be a string, got {value!r}")
        return value
    if origin is list:
        (item,) = typing.get_args(hint)
        _check(isinstance(value, list), key, f"must be a list, got {value!r}")
        return [_coerce(v, item, f"{key}[{i}]", from_text) for i, v in enumerate(value)]
    if origin is dict:
        _, item = typing.get_args(hint)
        _check(isinstance(value, dict), key, f"must be a table, got {value!r}")
        return {str(k): _coerce(v, item, f"{key}.{k}", from_text) for k, v in value.items()}
    raise ConfigError(f"{key}: unsupported setting type {hint!r}")  # pragma: no cover - programming error


def example_path() -> Path:
    """The commented example config shipped in the repository."""
    return Path(__file__).resolve().parent.parent / "cassmail.example.toml"


# --------------------------------------------------------------------------- reference

#: Where the generated configuration reference lives, and the command that writes it.
REFERENCE_PATH = "docs/configuration.md"
REFERENCE_COMMAND = "make docs"


def field_comments(cls: type) -> dict[str, str]:
    """The `#:` comment lines above each field of a settings class, read from its source: the
    settings' own definitions are the documentation, so the reference cannot drift from them.
    A field a subclass redeclares without a comment (a different default, the same meaning)
    keeps its base class's comment."""
    comments: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        lines, pending = inspect.getsourcelines(klass)[0], []
        for line in lines[1:]:
            stripped = line.strip()
            if stripped.startswith("#:"):
                pending.append(stripped[2:].strip())
            elif (match := re.match(r"    (\w+)\s*:", line)) and not stripped.startswith("def "):
                if pending:
                    comments[match.group(1)] = " ".join(pending)
                pending = []
            else:
                pending = []
    return comments


def _type_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint)


def _default_text(cls: type, name: str, value: Any) -> str:
    """A default as it would be written in the file; one computed on the running machine (a
    named factory such as socket.getfqdn) is shown as the call, so the page is the same everywhere."""
    factory = next(f.default_factory for f in dataclasses.fields(cls) if f.name == name)
    if callable(factory) and getattr(factory, "__name__", "<lambda>") != "<lambda>" and not isinstance(factory, type):
        return f"`{factory.__module__}.{factory.__qualname__}()`"
    return f"`{toml_value(value)}`"


def settings_sections(obj: Any = None, prefix: str = "") -> list[tuple[str, Any]]:
    """Every section of the settings, dotted name and value, parents before their subsections."""
    obj = Settings() if obj is None else obj
    out: list[tuple[str, Any]] = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out.append((f"{prefix}{f.name}", value))
            out += settings_sections(value, f"{prefix}{f.name}.")
    return out


def undocumented_settings() -> list[str]:
    """Settings whose field has no `#:` comment (each must say what it is for)."""
    missing = []
    for name, section in settings_sections():
        comments = field_comments(type(section))
        for f in dataclasses.fields(section):
            if not dataclasses.is_dataclass(getattr(section, f.name)) and f.name not in comments:
                missing.append(f"{name}.{f.name}")
    return missing


def reference() -> str:
    """docs/configuration.md: every section and key with its type, default and comment, from
    the dataclasses above. Sections of one class (the listeners) share a table."""
    out = [
        "# Configuration reference",
        "",
        f"Generated from the settings' definitions in `cassmail/config.py` by `{REFERENCE_COMMAND}`",
        "(`python -m cassmail.config reference`); do not edit it by hand: `tests/test_docs.py` fails",
        "when this page is not what the generator writes.",
        "",
        "Settings are read from a TOML file (`--config FILE` or `CASSMAIL_CONFIG`), then from",
        "environment variables `CASSMAIL_<SECTION>_<KEY>` (dots as underscores, e.g.",
        "`CASSMAIL_STORE_CASSANDRA_CONTACT_POINTS=10.0.0.1,10.0.0.2`), then from flags",
        "`--set section.key=value` (or `-o`). An invalid value, or an unknown key in any of the three",
        "(a misspelt variable is refused with the closest real name), stops start-up with one line",
        "naming the key. [`cassmail.example.toml`](../cassmail.example.toml) is a commented file with",
        "every key.",
        "",
    ]
    groups: dict[type, list[tuple[str, Any]]] = {}
    for name, section in settings_sections():
        groups.setdefault(type(section), []).append((name, section))
    for cls, members in groups.items():
        names = [name for name, _ in members]
        out.append("## " + ", ".join(f"`[{name}]`" for name in names))
        out.append("")
        if cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}("):
            out += [" ".join(cls.__doc__.split()), ""]
        out += ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        comments, hints = field_comments(cls), typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                continue
            defaults = [_default_text(cls, f.name, getattr(section, f.name)) for _, section in members]
            if len(set(defaults)) == 1:
                default = defaults[0]
            else:
                default = "<br>".join(f"{name}: {text}" for name, text in zip(names, defaults))
            meaning = comments.get(f.name, "").replace("|", "\\|")
            out.append(f"| `{f.name}` | `{_type_name(hints[f.name])}` | {default} | {meaning} |")
        out.append("")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m cassmail.config reference [--write]`: print the configuration reference, or
    write it to docs/configuration.md in the repository."""
    parser = argparse.ArgumentParser(prog="python -m cassmail.config")
    sub = parser.add_subparsers(dest="command", required=True)
    ref = sub.add_parser("reference", help="the configuration reference (Markdown)")
    ref.add_argument("--write", action="store_true", help=f"write it to {REFERENCE_PATH} instead of printing it")
    args = parser.parse_args(argv)
    text = reference()
    if args.write:
        (example_path().parent / REFERENCE_PATH).write_text(text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
