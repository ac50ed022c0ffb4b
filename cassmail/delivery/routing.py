"""Where mail for a domain goes, as Postfix decides it: the transport map, then the relayhost,
then DNS (MX records in preference order, the domain's own A/AAAA when it has no MX, RFC 5321
5.1; a null MX, RFC 7505, refuses mail at once).

A route is a list of hosts to try in order, each with the addresses found for it, plus how
to talk to them (TLS level, AUTH for a relayhost). DNS is asked through dnspython's asyncio
resolver, pointed at `relay.nameservers` when set.
"""

from __future__ import annotations

import ipaddress
import random
from dataclasses import dataclass, field

import dns.asyncresolver
import dns.exception
import dns.name
import dns.nameserver
import dns.rdatatype
import dns.resolver

from cassmail.config import RelaySettings


class RouteError(Exception):
    """No route now. `permanent` ones bounce (with `status`, an enhanced code), others wait.
    `destination` and `kind` say where the mail was headed, as a Route's `key` and `kind` would."""

    def __init__(self, text: str, permanent: bool, status: str) -> None:
        super().__init__(text)
        self.permanent, self.status = permanent, status
        self.destination, self.kind = "", ""


@dataclass(frozen=True)
class Hop:
    """One host of a route: the name (for TLS and logs) and the addresses to try."""

    name: str
    port: int
    addresses: tuple[str, ...]


@dataclass(frozen=True)
class Route:
    """How to reach a destination. `key` names the destination (in logs, and with the TLS level
    in `channel`, for connection reuse and the per-destination limit): the next hop for a
    transport entry or the relayhost, else the domain."""

    key: str
    hops: tuple[Hop, ...]
    tls: str
    implicit_tls: bool = False
    username: str = ""
    password: str = field(default="", repr=False)
    kind: str = "mx"

    @property
    def channel(self) -> str:
        """What a transaction and a pooled connection are shared by: the destination at one TLS
        level. Two domains sent to one next hop under different TLS policies share neither, so
        a connection opened for "may" never carries mail that must go over "verify"."""
        return f"{self.key} tls={self.tls}"


def split_hop(text: str, default_port: int) -> tuple[str, int, bool]:
    """ "[host]:port" -> (host, port, False); "host" -> (host, default, True): whether to look up MX."""
    port = default_port
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest.startswith(":"):
            port = int(rest[1:])
        return host, port, False
    host, sep, tail = text.rpartition(":")
    if sep and tail.isdigit() and ":" not in host:
        return host, int(tail), True
    return text, port, True


def ascii_domain(domain: str) -> str:
    """A domain as DNS and a non-SMTPUTF8 peer want it (IDNA A-labels)."""
    try:
        return domain.encode("idna").decode("ascii")
    except UnicodeError:
        return domain


class Router:
    def __init__(self, settings: RelaySettings) -> None:
        self.settings = settings
        self.resolver = make_resolver(settings)

    def tls_level(self, domain: str) -> str:
        return self.settings.tls_policy.get(domain, self.settings.tls)

    def transport(self, domain: str) -> str | None:
        """The transport map's next hop for a domain: an exact key, else the nearest ".parent" key."""
        table = self.settings.transport
        if domain in table:
            return table[domain]
        labels = domain.split(".")
        for i in range(1, len(labels)):
            hop = table.get("." + ".".join(labels[i:]))
            if hop is not None:
                return hop
        return None

    async def route(self, domain: str) -> Route:
        """The route for a recipient domain, or RouteError."""
        s = self.settings
        hop = self.transport(domain)
        key, kind = (hop, "transport") if hop is not None else (s.relayhost, "relayhost") if s.relayhost else (domain, "mx")
        try:
            if kind == "mx":
                return Route(domain, await self._mx(domain, s.port), self.tls_level(domain))
            host, port, lookup = split_hop(key, s.port if kind == "transport" else 25)
            hops = await (self._mx(host, port) if lookup else self._host(host, port))
        except RouteError as exc:
            exc.destination, exc.kind = key, kind
            raise
        if kind == "transport":
            return Route(key, hops, self.tls_level(domain), kind=kind)
        return Route(key, hops, s.relayhost_tls, s.relayhost_implicit_tls, s.relayhost_username, s.relayhost_password,
                     kind=kind)

    async def _mx(self, domain: str, port: int) -> tuple[Hop, ...]:
        name = ascii_domain(domain)
        try:
            answer = await self.resolver.resolve(name, "MX")
        except dns.resolver.NXDOMAIN:
            raise RouteError(f"domain {domain} does not exist (DNS: NXDOMAIN)", True, "5.1.2") from None
        except dns.resolver.NoAnswer:
            return await self._host(name, port)  # no MX: the domain itself is the implicit MX
        except (dns.exception.Timeout, dns.resolver.NoNameservers, dns.resolver.LifetimeTimeout) as exc:
            raise RouteError(f"MX lookup for {domain} failed: {exc}", False, "4.4.3") from None
        except dns.exception.DNSException as exc:
            raise RouteError(f"MX lookup for {domain} failed: {exc}", False, "4.4.3") from None
        records = sorted(answer, key=lambda r: (r.preference, random.random()))
        if len(records) == 1 and records[0].exchange == dns.name.root:
            raise RouteError(f"domain {domain} accepts no mail (null MX, RFC 7505)", True, "5.1.10")
        hops: list[Hop] = []
        failures: list[str] = []
        for record in records:
            if record.exchange == dns.name.root:
                continue
            host = record.exchange.to_text(omit_final_dot=True)
            try:
                hops.extend(await self._host(host, port))
            except RouteError as exc:
                failures.append(str(exc))
        if not hops:
            raise RouteError(f"no address for any MX of {domain}: {'; '.join(failures)}", False, "4.4.3")
        return tuple(hops)

    async def _host(self, host: str, port: int) -> tuple[Hop, ...]:
        """A host's addresses (A, then AAAA): an IP address is itself."""
        literal = host.strip("[]")
        try:
            ipaddress.ip_address(literal)
            return (Hop(literal, port, (literal,)),)
        except ValueError:
            pass
        addresses: list[str] = []
        missing = 0
        for rdtype in ("A", "AAAA"):
            try:
                answer = await self.resolver.resolve(host, rdtype)
                addresses.extend(r.to_text() for r in answer)
            except dns.resolver.NXDOMAIN:
                missing += 1
            except dns.resolver.NoAnswer:
                continue
            except dns.exception.DNSException as exc:
                raise RouteError(f"address lookup for {host} failed: {exc}", False, "4.4.3") from None
        if not addresses:
            if missing == 2:
                raise RouteError(f"host {host} does not exist (DNS: NXDOMAIN)", True, "5.1.2")
            raise RouteError(f"host {host} has no A or AAAA record", True, "5.1.2")
        return (Hop(host, port, tuple(addresses)),)


def make_resolver(settings: RelaySettings) -> dns.asyncresolver.Resolver:
    """The node's DNS resolver: `relay.nameservers` when set, else the system's, with the relay's
    timeouts. Outbound routing and the MX's sender authentication ask the same servers."""
    resolver = dns.asyncresolver.Resolver(configure=not settings.nameservers)
    if settings.nameservers:
        resolver.nameservers = [_nameserver(text) for text in settings.nameservers]
    resolver.lifetime = settings.dns_timeout
    resolver.timeout = min(settings.dns_timeout, 3.0)
    return resolver


def _nameserver(text: str) -> dns.nameserver.Do53Nameserver:
    """ "127.0.0.1", "127.0.0.1:5353", "::1" or "[::1]:5353"."""
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        return dns.nameserver.Do53Nameserver(host, int(rest[1:]) if rest.startswith(":") else 53)
    if text.count(":") == 1:
        host, _, port = text.partition(":")
        return dns.nameserver.Do53Nameserver(host, int(port))
    return dns.nameserver.Do53Nameserver(text, 53)
