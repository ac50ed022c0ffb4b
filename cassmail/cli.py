"""The `cassmail` command: administration of users, aliases, domains, mailboxes, the schema and a local Cassandra.

Every command reads the same settings (`--config FILE` or $CASSMAIL_CONFIG,
then $CASSMAIL_* variables, then `--set key=value`) and talks to the store
they name. Errors print one line and exit 1; usage errors exit 2.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import re
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

from cassmail import auth, config
from cassmail.checkout import REPO_ROOT, CommandError, load_launcher
from cassmail.model import InvalidInput, address_key, normalize_domain
from cassmail.store import make_store
from cassmail.store.base import DkimKey, QueueEntry, Quota, Store, StoreError, UserExists, check_alias

IMPORT_CONCURRENCY = 64


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    try:
        settings = config.load(args.config or _local_cluster_config(), overrides=args.set)
        return args.run(settings, args) or 0
    except (config.ConfigError, CommandError, StoreError, InvalidInput, OSError) as exc:
        print(f"cassmail: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cassmail", description=__doc__.splitlines()[0])
    p.add_argument("--config", "-c", metavar="FILE", help="settings file (TOML); default $CASSMAIL_CONFIG")
    p.add_argument(
        "--set", "-o", metavar="KEY=VALUE", action="append", default=[], help="override a setting, e.g. store.cassandra.keyspace=mail"
    )
    sub = p.add_subparsers(metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the mail server (SMTP, submission, LMTP listeners)")
    serve.add_argument("--workers", type=int, help="worker processes (default: node.workers, 0 = one per core)")
    serve.set_defaults(run=cmd_serve)

    schema = sub.add_parser("schema", help="Cassandra keyspace and tables").add_subparsers(metavar="ACTION")
    schema.add_parser("apply", help="create or update the keyspace and tables").set_defaults(run=cmd_schema_apply)

    user = sub.add_parser("user", help="manage users").add_subparsers(metavar="ACTION")
    u = user.add_parser("add", help="create a user (password from a prompt or --password-stdin)")
    u.add_argument("address")
    u.add_argument("--password-stdin", action="store_true", help="read the password from the first line of stdin")
    u.set_defaults(run=cmd_user_add)
    u = user.add_parser("passwd", help="change a user's password")
    u.add_argument("address")
    u.add_argument("--password-stdin", action="store_true")
    u.set_defaults(run=cmd_user_passwd)
    u = user.add_parser("del", help="delete a user and all their mail")
    u.add_argument("address")
    u.set_defaults(run=cmd_user_del)
    u = user.add_parser("list", help="list users")
    u.add_argument("--domain")
    u.set_defaults(run=cmd_user_list)
    u = user.add_parser("import", help="create many users: one 'address password' per line ('-' = stdin)")
    u.add_argument("file")
    u.add_argument("--hashed", action="store_true", help="the second field is already a $scrypt$ hash")
    u.set_defaults(run=cmd_user_import)
    u = user.add_parser("quota", help="show a user's storage limit and usage, or set the limit")
    u.add_argument("address")
    u.add_argument("size", nargs="?", help="the new limit: bytes, or with K, M, G or T (powers of 1024: 500M, 2G, "
                                          "1.5G); 'none' removes it")
    u.add_argument("--recount", action="store_true",
                   help="count the usage again from the mailboxes (repairs the counters of the Cassandra store)")
    u.set_defaults(run=cmd_user_quota)

    alias = sub.add_parser("alias", help="manage aliases: addresses that deliver to local users").add_subparsers(
        metavar="ACTION"
    )
    a = alias.add_parser("add", help="create an alias, or replace the users of an existing one")
    a.add_argument("alias", help="an address in a local domain that is not a user")
    a.add_argument("users", nargs="+", metavar="user", help="local users it delivers to")
    a.set_defaults(run=cmd_alias_add)
    a = alias.add_parser("del", help="delete an alias (its users stay)")
    a.add_argument("alias")
    a.set_defaults(run=cmd_alias_del)
    a = alias.add_parser("list", help="list aliases and their users")
    a.add_argument("--domain")
    a.set_defaults(run=cmd_alias_list)

    domain = sub.add_parser("domain", help="manage local domains").add_subparsers(metavar="ACTION")
    for action, fn, needs in (("add", cmd_domain_add, True), ("del", cmd_domain_del, True), ("list", cmd_domain_list, False)):
        d = domain.add_parser(action, help=f"{action} local domain{'s' if not needs else ''}")
        if needs:
            d.add_argument("domain")
        d.set_defaults(run=fn)

    mailbox = sub.add_parser("mailbox", help="inspect mailboxes").add_subparsers(metavar="ACTION")
    m = mailbox.add_parser("list", help="a user's mailboxes with message counts and sizes")
    m.add_argument("address")
    m.set_defaults(run=cmd_mailbox_list)

    store = sub.add_parser("store", help="maintenance of the configured store").add_subparsers(metavar="ACTION")
    s = store.add_parser("compact", help="mbox store: reclaim the space of deleted mail and merge small extents now")
    s.add_argument("--user", help="only this user's mailboxes")
    s.add_argument("--mailbox", help="only this mailbox (with --user)")
    s.add_argument("--budget", type=int, metavar="BYTES", help="write at most this much per mailbox (default: no limit)")
    s.add_argument("--no-defrag", action="store_true", help="reclaim space only, move no data to merge extents")
    s.set_defaults(run=cmd_store_compact)

    queue = sub.add_parser("queue", help="the outbound queue: mail waiting for other domains").add_subparsers(
        metavar="ACTION"
    )
    q = queue.add_parser("list", help="every queued message: recipients and their state, attempts, next try")
    q.add_argument("--domain", help="only messages with a recipient in this domain")
    q.add_argument("--json", action="store_true", help="one JSON document instead of a table")
    q.set_defaults(run=cmd_queue_list)
    q = queue.add_parser("show", help="one queued message: envelope, each recipient's last reply, its header")
    q.add_argument("id")
    q.set_defaults(run=cmd_queue_show)
    q = queue.add_parser("retry", help="try a message (or every message) now")
    target = q.add_mutually_exclusive_group(required=True)
    target.add_argument("id", nargs="?")
    target.add_argument("--all", action="store_true")
    q.set_defaults(run=cmd_queue_retry)
    for action, fn, text in (("delete", cmd_queue_delete, "remove a message without delivering it (no DSN)"),
                             ("hold", cmd_queue_hold, "keep a message in the queue without trying it"),
                             ("release", cmd_queue_release, "let a held message go (tried now)")):
        q = queue.add_parser(action, help=text)
        q.add_argument("id")
        q.set_defaults(run=fn)

    dkim = sub.add_parser("dkim", help="DKIM signing keys of local domains").add_subparsers(metavar="ACTION")
    d = dkim.add_parser("add", help="make a key for a domain (its mail is signed from now on) and print the TXT record")
    d.add_argument("domain")
    d.add_argument("--selector", default=None, help="DNS selector (default: s + this year and month, e.g. s202611)")
    d.add_argument("--bits", type=int, default=2048, choices=(1024, 2048, 3072, 4096))
    d.set_defaults(run=cmd_dkim_add)
    d = dkim.add_parser("show", help="print the TXT record of a domain's key")
    d.add_argument("domain")
    d.set_defaults(run=cmd_dkim_show)
    d = dkim.add_parser("del", help="stop signing a domain's mail")
    d.add_argument("domain")
    d.set_defaults(run=cmd_dkim_del)
    dkim.add_parser("list", help="domains that sign, with their selectors").set_defaults(run=cmd_dkim_list)

    sieve = sub.add_parser("sieve", help="users' Sieve scripts (mail filters run at delivery)").add_subparsers(
        metavar="ACTION")
    v = sieve.add_parser("put", help="store a script (checked first) from FILE ('-' = stdin)")
    v.add_argument("address")
    v.add_argument("name")
    v.add_argument("file")
    v.add_argument("--activate", action="store_true", help="make it the script that runs")
    v.set_defaults(run=cmd_sieve_put)
    v = sieve.add_parser("get", help="print a script")
    v.add_argument("address")
    v.add_argument("name")
    v.set_defaults(run=cmd_sieve_get)
    v = sieve.add_parser("list", help="a user's scripts; the active one is marked")
    v.add_argument("address")
    v.set_defaults(run=cmd_sieve_list)
    v = sieve.add_parser("activate", help="make a script the one that runs (--none: no script runs)")
    v.add_argument("address")
    v.add_argument("name", nargs="?")
    v.add_argument("--none", action="store_true")
    v.set_defaults(run=cmd_sieve_activate)
    v = sieve.add_parser("delete", help="delete a script that is not active")
    v.add_argument("address")
    v.add_argument("name")
    v.set_defaults(run=cmd_sieve_delete)

    cass = sub.add_parser("cassandra", help="a local Apache Cassandra for development and tests").add_subparsers(
        metavar="ACTION"
    )
    c = cass.add_parser("up", help="start local Cassandra node(s) and apply the schema")
    c.add_argument("--nodes", type=int, default=1)
    c.add_argument("--heap-mb", type=int, default=1024)
    c.set_defaults(run=cmd_cassandra_up)
    cass.add_parser("down", help="stop the nodes `cassandra up` started").set_defaults(run=cmd_cassandra_down)
    cass.add_parser("status", help="state of the local nodes").set_defaults(run=cmd_cassandra_status)

    from cassmail import cluster  # the `cluster` commands live with the local cluster

    cluster.add_commands(sub)
    return p


def _local_cluster_config() -> str | None:
    """While `cassmail cluster up` runs a local cluster, commands given no config reach it."""
    from cassmail import cluster

    return cluster.active_config()


# --------------------------------------------------------------------------- helpers


def _with_store(settings: config.Settings, work: Callable[[Store], Awaitable[Any]]) -> Any:
    async def go() -> Any:
        store = make_store(settings)
        await store.open()
        try:
            return await work(store)
        finally:
            await store.close()

    return asyncio.run(go())


def _read_password(args: argparse.Namespace, stdin: TextIO = sys.stdin) -> str:
    if args.password_stdin:
        password = stdin.readline().rstrip("\r\n")
    else:
        if not stdin.isatty():
            raise CommandError("no terminal to prompt for a password: use --password-stdin")
        password = getpass.getpass("Password: ")
        if getpass.getpass("Again: ") != password:
            raise CommandError("passwords do not match")
    if not password:
        raise CommandError("empty password")
    return password


def _params(settings: config.Settings) -> auth.HashParams:
    return auth.HashParams.from_settings(settings.auth)


# --------------------------------------------------------------------------- commands


def cmd_serve(settings: config.Settings, args: argparse.Namespace) -> int:
    from cassmail import server

    if args.workers is not None:
        settings.node.workers = args.workers
        config.validate(settings)
    return server.serve(settings)


def cmd_schema_apply(settings: config.Settings, args: argparse.Namespace) -> int:
    """Applies [store.cassandra]'s schema whatever store.backend says: preparing a cluster
    before switching a node to it is the usual order."""
    from cassmail.store import cassandra_schema

    done = cassandra_schema.apply(settings.store.cassandra)
    print("\n".join(done) if done else f"schema of keyspace {settings.store.cassandra.keyspace} is up to date")
    return 0


def _key_and_hash(settings: config.Settings, args: argparse.Namespace) -> tuple[str, str]:
    """The user key and the hash of the password read for it (address checked before the prompt)."""
    key = address_key(args.address)
    return key, auth.hash_password(_read_password(args), _params(settings))


def cmd_user_add(settings: config.Settings, args: argparse.Namespace) -> int:
    key, hashed = _key_and_hash(settings, args)
    _with_store(settings, lambda s: s.create_user(key, hashed))
    print(f"created {key}")
    return 0


def cmd_user_passwd(settings: config.Settings, args: argparse.Namespace) -> int:
    key, hashed = _key_and_hash(settings, args)
    _with_store(settings, lambda s: s.set_password_hash(key, hashed))
    print(f"password of {key} changed")
    return 0


def cmd_user_del(settings: config.Settings, args: argparse.Namespace) -> int:
    key = address_key(args.address)
    _with_store(settings, lambda s: s.delete_user(key))
    print(f"deleted {key}")
    return 0


def cmd_user_list(settings: config.Settings, args: argparse.Namespace) -> int:
    for user in _with_store(settings, lambda s: s.list_users(args.domain)):
        print(user)
    return 0


_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?", re.I)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int | None:
    """A storage limit as `user quota` takes it: "none", bytes, or a number with K, M, G or T
    (powers of 1024, as Dovecot reads them; KiB/KB and the like too). CommandError otherwise."""
    if text.strip().lower() == "none":
        return None
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise CommandError(f"not a size: {text!r} (bytes, or a number with K, M, G or T, like 500M; or none)")
    value = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if value >= 2**63:
        raise CommandError(f"size too large: {text!r}")
    return value


def _human(size: int) -> str:
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= factor:
            return f"{size / factor:.1f} {unit}"
    return f"{size} bytes"


def cmd_user_quota(settings: config.Settings, args: argparse.Namespace) -> int:
    key = address_key(args.address)
    limit = parse_size(args.size) if args.size is not None else None  # checked before connecting

    async def work(store: Store) -> Quota:
        if args.size is not None:
            await store.set_quota(key, limit)
        return await (store.recount_quota(key) if args.recount else store.get_quota(key))

    quota = _with_store(settings, work)
    print(f"user      {key}")
    if quota.limit is None:
        print("limit     none")
    else:
        print(f"limit     {_human(quota.limit)} ({quota.limit} bytes)")
    share = f", {100 * quota.used / quota.limit:.1f}% of the limit" if quota.limit else ""
    print(f"used      {_human(quota.used)} ({quota.used} bytes){share}")
    print(f"messages  {quota.messages}")
    if quota.limit is not None and quota.used > quota.limit:
        print("over quota: new mail is refused until some is deleted")
    return 0


def cmd_alias_add(settings: config.Settings, args: argparse.Namespace) -> int:
    key, users = check_alias(args.alias, args.users)  # addresses checked before connecting
    _with_store(settings, lambda s: s.set_alias(key, users))
    print(f"alias {key} -> {', '.join(users)}")
    return 0


def cmd_alias_del(settings: config.Settings, args: argparse.Namespace) -> int:
    key = address_key(args.alias)
    _with_store(settings, lambda s: s.delete_alias(key))
    print(f"deleted alias {key}")
    return 0


def cmd_alias_list(settings: config.Settings, args: argparse.Namespace) -> int:
    for alias in _with_store(settings, lambda s: s.list_aliases(args.domain)):
        print(f"{alias.address} -> {', '.join(alias.users)}")
    return 0


def cmd_sieve_put(settings: config.Settings, args: argparse.Namespace) -> int:
    from cassmail.sieve.delivery import limits_of
    from cassmail.sieve.script import check

    key = address_key(args.address)
    text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text(encoding="utf-8")
    error = check(text, limits_of(settings.sieve))
    if error is not None:
        raise CommandError(f"script {args.name!r} not stored: {error}")

    async def put(store: Store) -> None:
        await store.put_sieve_script(key, args.name, text)
        if args.activate:
            await store.set_active_sieve_script(key, args.name)

    _with_store(settings, put)
    print(f"stored script {args.name!r} of {key}" + (" (active)" if args.activate else ""))
    return 0


def cmd_sieve_get(settings: config.Settings, args: argparse.Namespace) -> int:
    sys.stdout.write(_with_store(settings, lambda s: s.get_sieve_script(address_key(args.address), args.name)))
    return 0


def cmd_sieve_list(settings: config.Settings, args: argparse.Namespace) -> int:
    for script in _with_store(settings, lambda s: s.list_sieve_scripts(address_key(args.address))):
        print(f"{script.name}{'  (active)' if script.active else ''}")
    return 0


def cmd_sieve_activate(settings: config.Settings, args: argparse.Namespace) -> int:
    if bool(args.none) == bool(args.name):
        raise CommandError("give a script name or --none")
    key = address_key(args.address)
    _with_store(settings, lambda s: s.set_active_sieve_script(key, None if args.none else args.name))
    print(f"no script runs for {key}" if args.none else f"script {args.name!r} runs for {key}")
    return 0


def cmd_sieve_delete(settings: config.Settings, args: argparse.Namespace) -> int:
    key = address_key(args.address)
    _with_store(settings, lambda s: s.delete_sieve_script(key, args.name))
    print(f"deleted script {args.name!r} of {key}")
    return 0


def parse_import(lines: Iterable[str]) -> tuple[list[tuple[int, str, str]], list[str]]:
    """(line number, user key, secret) per good line, and one message per bad line."""
    entries, errors = [], []
    for number, line in enumerate(lines, 1):
        text = line.rstrip("\r\n")
        if not text.strip() or text.lstrip().startswith("#"):
            continue
        parts = text.strip().split(None, 1)
        if len(parts) != 2:
            errors.append(f"line {number}: expected 'address password'")
            continue
        try:
            entries.append((number, address_key(parts[0]), parts[1]))
        except InvalidInput as exc:
            errors.append(f"line {number}: {exc}")
    return entries, errors


def cmd_user_import(settings: config.Settings, args: argparse.Namespace) -> int:
    started = time.monotonic()
    if args.file == "-":
        entries, errors = parse_import(sys.stdin)
    else:
        with open(args.file, encoding="utf-8") as fh:
            entries, errors = parse_import(fh)
    if args.hashed:
        bad = [f"line {n}: not a $scrypt$ hash" for n, _, secret in entries if not auth.is_hash(secret)]
        errors += bad
        entries = [e for e in entries if auth.is_hash(e[2])]
        hashes = [secret for _, _, secret in entries]
    else:
        hashes = auth.hash_many((secret for _, _, secret in entries), _params(settings))

    async def create_all(store: Store) -> tuple[int, list[str]]:
        limit = asyncio.Semaphore(IMPORT_CONCURRENCY)
        failures: list[str] = []

        async def one(number: int, key: str, hashed: str) -> bool:
            async with limit:
                try:
                    await store.create_user(key, hashed)
                    return True
                except UserExists:
                    failures.append(f"line {number}: {key} already exists")
                except (StoreError, InvalidInput) as exc:
                    failures.append(f"line {number}: {exc}")
                return False

        results = await asyncio.gather(*(one(n, k, h) for (n, k, _), h in zip(entries, hashes)))
        return sum(results), failures

    created, failures = _with_store(settings, create_all)
    errors += failures
    for line in sorted(errors, key=lambda e: int(e.split(":")[0].split()[1])):
        print(line, file=sys.stderr)
    print(f"imported {created} user(s) in {time.monotonic() - started:.1f} s, {len(errors)} error(s)")
    return 1 if errors else 0


def cmd_domain_add(settings: config.Settings, args: argparse.Namespace) -> int:
    domain = normalize_domain(args.domain)
    _with_store(settings, lambda s: s.add_domain(domain))
    print(f"added {domain}")
    return 0


def cmd_domain_del(settings: config.Settings, args: argparse.Namespace) -> int:
    domain = normalize_domain(args.domain)
    _with_store(settings, lambda s: s.remove_domain(domain))
    print(f"removed {domain}")
    return 0


def cmd_domain_list(settings: config.Settings, args: argparse.Namespace) -> int:
    for domain in _with_store(settings, lambda s: s.list_domains()):
        print(domain)
    return 0


def cmd_mailbox_list(settings: config.Settings, args: argparse.Namespace) -> int:
    key = address_key(args.address)

    async def gather(store: Store) -> list[tuple[str, str, int, int, int]]:
        rows = []
        for info in await store.list_mailboxes(key):
            count = size = 0
            async for summary in store.list_messages(key, info.name):
                count += 1
                size += summary.size
            rows.append((info.name, info.special_use or "", info.uidvalidity, count, size))
        return rows

    rows = _with_store(settings, gather)
    width = max(len("MAILBOX"), *(len(r[0]) for r in rows))
    print(f"{'MAILBOX':<{width}}  {'SPECIAL-USE':<11}  {'UIDVALIDITY':>11}  {'MESSAGES':>8}  {'BYTES':>12}")
    for name, special, uidvalidity, count, size in rows:
        print(f"{name:<{width}}  {special:<11}  {uidvalidity:>11}  {count:>8}  {size:>12}")
    return 0


def cmd_store_compact(settings: config.Settings, args: argparse.Namespace) -> int:
    if settings.store.backend != "mbox":
        print(f"store.backend is {settings.store.backend}: nothing to compact")
        return 0
    if args.mailbox and not args.user:
        raise CommandError("--mailbox needs --user")

    async def compact(store: Store) -> Any:
        run = getattr(store, "compact", None)
        if run is None:
            raise CommandError(f"the {settings.store.backend} store cannot compact")
        return await run(args.user, args.mailbox, args.budget, not args.no_defrag)

    rows = _with_store(settings, compact)
    print(f"{'USER':<30} {'MAILBOX':<20} {'RECLAIMED':>10} {'WRITTEN':>9} {'MOVED':>10} {'EXTENTS':>11} {'LEFT':>8} {'SECONDS':>7}")
    for user, mailbox, r in rows:
        extents = "-" if r.extents_before is None else f"{r.extents_before}->{r.extents_after}"
        print(f"{user:<30} {mailbox:<20} {r.reclaimed:>10} {r.written:>9} {r.moved:>10} {extents:>11} {r.left:>8} {r.seconds:>7.3f}")
    return 0


# --------------------------------------------------------------------------- the outbound queue


def _entry_id(text: str) -> uuid.UUID:
    try:
        return uuid.UUID(text.strip())
    except ValueError:
        raise CommandError(f"not a queue id: {text!r} (32 hex digits, as `queue list` shows)") from None


def _when(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ") if seconds else "-"


def _entry_json(entry: QueueEntry) -> dict[str, Any]:
    return {
        "id": entry.id.hex, "sender": entry.sender, "size": entry.size, "created": _when(entry.created),
        "due": _when(entry.due), "attempts": entry.attempts, "held": entry.held, "warned": entry.warned,
        "last_error": entry.last_error, "lease_owner": entry.lease_owner,
        "lease_until": _when(entry.lease_until) if entry.lease_until > time.time() else None,
        "recipients": [{"address": r.address, "state": r.state, "reply": r.reply, "remote": r.remote}
                       for r in entry.recipients],
    }


def cmd_queue_list(settings: config.Settings, args: argparse.Namespace) -> int:
    entries = _with_store(settings, lambda s: s.list_queue(args.domain))
    if args.json:
        print(json.dumps([_entry_json(e) for e in entries], indent=2, ensure_ascii=False))
        return 0
    now = time.time()
    print(f"{'ID':<32}  {'AGE':>7}  {'SIZE':>9}  {'TRIES':>5}  {'NEXT':>7}  SENDER -> RECIPIENTS")
    for e in entries:
        leased = e.lease_until > now and e.lease_owner
        next_try = "held" if e.held else "now" if leased or e.due <= now else _age(e.due - now)
        rcpts = ", ".join(f"{r.address}{'' if r.state == 'pending' else ' (' + r.state + ')'}" for r in e.recipients)
        print(f"{e.id.hex:<32}  {_age(now - e.created):>7}  {e.size:>9}  {e.attempts:>5}  {next_try:>7}  "
              f"<{e.sender}> -> {rcpts}")
        if e.last_error:
            print(f"{'':<34}{e.last_error[:200]}")
    print(f"{len(entries)} message(s), {sum(len(e.pending) for e in entries)} recipient(s) pending")
    return 0


def _age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def cmd_queue_show(settings: config.Settings, args: argparse.Namespace) -> int:
    from cassmail.delivery.message import header_section

    entry_id = _entry_id(args.id)

    async def show(store: Store) -> tuple[QueueEntry, bytes]:
        return await store.get_queued(entry_id), await store.read_queued(entry_id)

    entry, message = _with_store(settings, show)
    data = _entry_json(entry)
    for key in ("id", "sender", "size", "created", "due", "attempts", "held", "warned", "last_error", "lease_owner",
                "lease_until"):
        print(f"{key + ':':<13}{data[key] if data[key] not in (None, '') else '-'}")
    print("recipients:")
    for r in entry.recipients:
        print(f"  {r.address}  {r.state}" + (f"  {r.remote}: {r.reply}" if r.reply else ""))
    print()
    print(header_section(message).decode("utf-8", "replace").rstrip())
    return 0


def cmd_queue_retry(settings: config.Settings, args: argparse.Namespace) -> int:
    entry_id = None if args.all else _entry_id(args.id)
    count = _with_store(settings, lambda s: s.retry_queued(entry_id))
    print(f"{count} message(s) due now")
    return 0


def _queue_action(done: str, call: Callable[[Store, uuid.UUID], Awaitable[None]]) -> Callable[..., int]:
    """A `queue delete|hold|release ID` command: `call` on the entry, then one line saying `done`."""

    def command(settings: config.Settings, args: argparse.Namespace) -> int:
        entry_id = _entry_id(args.id)
        _with_store(settings, lambda store: call(store, entry_id))
        print(f"{done} {entry_id.hex}")
        return 0

    return command


cmd_queue_delete = _queue_action("deleted", lambda store, entry_id: store.delete_queued(entry_id))
cmd_queue_hold = _queue_action("held", lambda store, entry_id: store.hold_queued(entry_id, True))
cmd_queue_release = _queue_action("released", lambda store, entry_id: store.hold_queued(entry_id, False))


# --------------------------------------------------------------------------- DKIM keys


def cmd_dkim_add(settings: config.Settings, args: argparse.Namespace) -> int:
    from cassmail.delivery import dkim

    domain = normalize_domain(args.domain)
    selector = args.selector or datetime.now(timezone.utc).strftime("s%Y%m")
    pem, _ = dkim.generate(args.bits)
    _with_store(settings, lambda s: s.set_dkim_key(domain, selector, pem))
    print(f"mail from {domain} is signed with selector {selector} from now on; publish this TXT record:")
    print(dkim.txt_record(DkimKey(domain, selector, pem)))
    return 0


def cmd_dkim_show(settings: config.Settings, args: argparse.Namespace) -> int:
    from cassmail.delivery import dkim

    domain = normalize_domain(args.domain)
    key = _with_store(settings, lambda s: s.get_dkim_key(domain))
    if key is None:
        raise CommandError(f"{domain} has no DKIM key (its mail is not signed): `cassmail dkim add {domain}`")
    print(dkim.txt_record(key))
    return 0


def cmd_dkim_del(settings: config.Settings, args: argparse.Namespace) -> int:
    domain = normalize_domain(args.domain)
    _with_store(settings, lambda s: s.delete_dkim_key(domain))
    print(f"mail from {domain} is no longer signed")
    return 0


def cmd_dkim_list(settings: config.Settings, args: argparse.Namespace) -> int:
    for key in _with_store(settings, lambda s: s.list_dkim_keys()):
        print(f"{key.domain}  selector={key.selector}")
    return 0


# --------------------------------------------------------------------------- local Cassandra


def _local_cluster(settings: config.Settings, nodes: int = 1, heap_mb: int = 1024) -> Any:
    launcher = load_launcher()
    return launcher, launcher.LocalCluster(
        REPO_ROOT / "var" / "cassandra", nodes, native_port=settings.store.cassandra.port, heap_mb=heap_mb
    )


def cmd_cassandra_up(settings: config.Settings, args: argparse.Namespace) -> int:
    launcher, cluster = _local_cluster(settings, args.nodes, args.heap_mb)
    started = time.monotonic()
    try:
        cluster.up()
    except launcher.LauncherError as exc:
        raise CommandError(str(exc)) from None
    print(f"Cassandra up on {', '.join(cluster.contact_points())} port {settings.store.cassandra.port} "
          f"in {time.monotonic() - started:.0f} s")
    cmd_schema_apply(settings, args)
    if settings.store.backend != "cassandra":
        print("to use it: export CASSMAIL_STORE_BACKEND=cassandra (or set store.backend in your config)")
    return 0


def cmd_cassandra_down(settings: config.Settings, args: argparse.Namespace) -> int:
    launcher, cluster = _local_cluster(settings)
    try:
        cluster.down()
    except launcher.LauncherError as exc:
        raise CommandError(str(exc)) from None
    print("Cassandra stopped")
    return 0


def cmd_cassandra_status(settings: config.Settings, args: argparse.Namespace) -> int:
    _, cluster = _local_cluster(settings)
    print(f"{'NODE':>4}  {'ADDRESS':<15}  {'PID':>7}  {'RUNNING':<7}  CQL")
    for node in cluster.status():
        print(f"{node['index']:>4}  {node['address']:<15}  {node['pid'] or '-':>7}  {str(node['running']):<7}  {node['cql']}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
