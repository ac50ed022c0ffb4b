"""Sender authentication on the MX: SPF (RFC 7208) for MAIL FROM and HELO, every DKIM signature
(RFC 6376), the ARC chain (RFC 8617) and DMARC (RFC 7489), summed up in one
Authentication-Results header (RFC 8601).

The checks are the libraries': pyspf for SPF, dkimpy for DKIM and ARC, the `dmarc` package for
the DMARC record and its policy, the bundled public suffix list of `publicsuffixlist` for the
organisational domain (no list is fetched at run time). Those libraries block, so they run in a
thread; every DNS question they ask is answered by the node's asyncio resolver (the one outbound
routing uses, `relay.nameservers`) on the event loop, through `DnsBridge`. A DNS failure is a
`temperror`, never a pass.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import email.utils
import ipaddress
import logging
import random
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import dkim
import dmarc
import dns.asyncresolver
import dns.exception
import dns.name
import dns.rdataclass
import dns.rdatatype
import dns.resolver
import spf
from publicsuffixlist import PublicSuffixList

from cassmail.delivery.message import fields, header_section

log = logging.getLogger("cassmail.inbound")

#: dkimpy logs a bad signature or a missing key at ERROR: the sender's fault, already said in the
#: Authentication-Results reason, so not an error of this node (nor a line per hostile message).
_LIBRARY_LOG = logging.getLogger("dkimpy.cassmail")
_LIBRARY_LOG.propagate = False
_LIBRARY_LOG.addHandler(logging.NullHandler())

#: Threads of the library calls per worker process (three per message being checked).
THREADS = 64

#: Results of one method, as RFC 8601 names them.
PASS, FAIL, SOFTFAIL, NEUTRAL, NONE, TEMPERROR, PERMERROR = (
    "pass", "fail", "softfail", "neutral", "none", "temperror", "permerror")


#: What the libraries raise, beside their own exceptions, on input they did not expect (a
#: hostile message): the method's result is then permerror (or fail), never an internal error.
LIBRARY_INPUT_ERRORS: tuple[type[Exception], ...] = (ValueError, KeyError, IndexError, TypeError)


class DnsTemporary(Exception):
    """A DNS question got no answer (timeout, SERVFAIL, no server): the check cannot decide."""


class DnsBridge:
    """Blocking DNS for libraries running in a worker thread, answered on the event loop by the
    node's asyncio resolver. A question is bounded by the resolver's lifetime."""

    def __init__(self, resolver: dns.asyncresolver.Resolver, loop: asyncio.AbstractEventLoop) -> None:
        self.resolver, self.loop = resolver, loop
        self.wait = float(resolver.lifetime or 10.0) + 1.0

    async def resolve(self, name: str, rdtype: str) -> list[Any]:
        """The records of one type ([] for NXDOMAIN or no data), or DnsTemporary."""
        try:
            answer = await self.resolver.resolve(name, rdtype, raise_on_no_answer=False, search=False)
        except dns.resolver.NXDOMAIN:
            return []
        except (dns.resolver.NoNameservers, dns.exception.Timeout) as exc:
            raise DnsTemporary(f"{rdtype} {name}: {exc}") from None
        except (dns.exception.DNSException, ValueError):
            # A name that cannot be asked (a label over 63 octets, not IDNA): no such record.
            return []
        return list(answer.rrset) if answer.rrset is not None else []

    def resolve_blocking(self, name: str, rdtype: str) -> list[Any]:
        """`resolve` from a worker thread (never from the loop's own thread). An answer in the
        resolver's cache (thread-safe) is taken at once, without a trip to the loop."""
        cached = self._cached(name, rdtype)
        if cached is not None:
            return cached
        future = asyncio.run_coroutine_threadsafe(self.resolve(name, rdtype), self.loop)
        try:
            return future.result(self.wait)
        except TimeoutError:
            future.cancel()
            raise DnsTemporary(f"{rdtype} {name}: no answer in {self.wait:.0f} s") from None

    def _cached(self, name: str, rdtype: str) -> list[Any] | None:
        cache = self.resolver.cache
        if cache is None:
            return None
        try:
            key = (dns.name.from_text(name), dns.rdatatype.from_text(rdtype), dns.rdataclass.IN)
        except (dns.exception.DNSException, ValueError):
            return None
        answer = cache.get(key)
        if answer is None:
            return None
        return list(answer.rrset) if answer.rrset is not None else []

    def txt(self, name: bytes | str, timeout: float = 5) -> bytes | None:
        """dkimpy's `dnsfunc`: the first TXT record of a name, its strings joined."""
        text = name.decode("ascii", "replace") if isinstance(name, bytes) else name
        for record in self.resolve_blocking(text, "TXT"):
            return b"".join(record.strings)
        return None

    def spf_lookup(self, name: str, qtype: str, strict: bool = True, timeout: float = 30) -> list[tuple[Any, Any]]:
        """pyspf's `DNSLookup`: ((name, type), value) pairs in the shape its dnspython lookup gives."""
        try:
            records = self.resolve_blocking(name, qtype)
        except DnsTemporary as exc:
            raise spf.TempError(f"DNS {exc}") from None
        found: list[tuple[Any, Any]] = []
        for rdata in records:
            if qtype in ("A", "AAAA"):
                found.append(((name, qtype), rdata.address))
            elif qtype == "MX":
                found.append(((name, qtype), (rdata.preference, rdata.exchange)))
            elif qtype == "PTR":
                found.append(((name, qtype), rdata.target.to_text(True)))
            elif qtype in ("TXT", "SPF"):
                found.append(((name, qtype), rdata.strings))
        return found


#: The bridge of the check running in this thread (`SenderAuth._in_thread` copies the context in).
_bridge: contextvars.ContextVar[DnsBridge | None] = contextvars.ContextVar("cassmail_dns_bridge", default=None)
_library_lookup: Callable[..., Any] = spf.DNSLookup


def _spf_dns(name: str, qtype: str, strict: bool = True, timeout: float = 30) -> list[tuple[Any, Any]]:
    """pyspf asks DNS through its module function `DNSLookup` (pyspf 2.0.x, pinned): this one
    answers through the bridge of the check in progress, else as pyspf would."""
    bridge = _bridge.get()
    if bridge is None:
        return _library_lookup(name, qtype, strict, timeout)
    return bridge.spf_lookup(name, qtype, strict, timeout)


spf.DNSLookup = _spf_dns


class _OrgDomains:
    """The organisational domain (RFC 7489 3.2) from the public suffix list bundled with the
    package, in the shape the `dmarc` package asks for (`get_public_suffix`, which there means
    the registrable domain)."""

    def __init__(self) -> None:
        self.psl = PublicSuffixList(only_icann=True)

    def get_public_suffix(self, domain: str) -> str:
        return self.psl.privatesuffix(domain.lower().rstrip(".")) or domain.lower()


@functools.cache
def org_domains() -> _OrgDomains:
    """The list, parsed once per process on first use (a fifth of a second)."""
    return _OrgDomains()


@dataclass
class DkimResult:
    result: str
    domain: str = ""
    selector: str = ""
    b: str = ""
    reason: str = ""


@dataclass
class AuthOutcome:
    """Every method's result, the DMARC disposition and the header line that says so."""

    spf_mfrom: str = NONE
    spf_helo: str = NONE
    mfrom_domain: str = ""
    helo: str = ""
    sender: str = ""
    dkim: list[DkimResult] = field(default_factory=list)
    arc: str = NONE
    dmarc: str = NONE
    from_domain: str = ""
    policy: str = ""  # the DMARC disposition applied: "", "none", "quarantine" or "reject"
    dmarc_reason: str = ""

    def temporary(self) -> list[str]:
        """The methods whose DNS failed."""
        found = [name for name, value in (("spf", self.spf_mfrom), ("dmarc", self.dmarc), ("arc", self.arc))
                 if value == TEMPERROR]
        if any(d.result == TEMPERROR for d in self.dkim):
            found.append("dkim")
        return found

    def header(self, authserv_id: str) -> bytes:
        """One Authentication-Results field (RFC 8601), folded one method a line, of at most
        RESULTS_MAX bytes however many DKIM signatures the message carries: the SIZE advertised
        leaves room for it. When not all signatures fit, the passing ones come first and a
        comment says how many were left out (RFC 8601 lets a server report a subset)."""
        mfrom = f" smtp.mailfrom={_value(self.sender)}" if self.sender else f" smtp.mailfrom={_value(self.mfrom_domain)}" if self.mfrom_domain else ""
        head = [f"spf={self.spf_mfrom}{mfrom}"]
        if self.helo:
            head.append(f"spf={self.spf_helo} smtp.helo={_value(self.helo)}")
        dmarc_text = f"dmarc={self.dmarc}"
        if self.policy:
            dmarc_text += f" (p={self.policy})"
        if self.dmarc_reason:
            dmarc_text += f' reason="{_quoted(self.dmarc_reason)}"'
        if self.from_domain:
            dmarc_text += f" header.from={_value(self.from_domain)}"
        tail = [dmarc_text, f"arc={self.arc}"]
        signatures = [_dkim_text(d) for d in self.dkim]
        field = _results_field(authserv_id, head, signatures or ["dkim=none"], tail)
        if len(field) <= RESULTS_MAX:
            return field
        ordered = [_dkim_text(d) for d in sorted(self.dkim, key=lambda d: d.result != "pass")]
        for shown in range(len(ordered) - 1, -1, -1):
            left_out = len(ordered) - shown
            note = f"({left_out} more DKIM signature{'s' if left_out > 1 else ''} not reported)"
            reported = ordered[:shown]
            if reported:
                reported[-1] += " " + note
            else:
                reported = [f"dkim=none {note}"]
            field = _results_field(authserv_id, head, reported, tail)
            if len(field) <= RESULTS_MAX:
                return field
        return field  # only an authserv-id thousands of characters long gets here


#: The largest Authentication-Results field written. Every value in it is cut to VALUE_MAX bytes
#: and every reason to 200, so with a host name as authserv-id its fixed parts take under 1,500
#: bytes and at least two DKIM results of the largest kind (about 900 bytes) fit beside them.
RESULTS_MAX = 4096
#: Longest value (an address, a domain, a selector) written into the field, in bytes.
VALUE_MAX = 320


def _dkim_text(d: DkimResult) -> str:
    reason = f' reason="{_quoted(d.reason)}"' if d.reason else ""
    ident = f" header.d={_value(d.domain)} header.s={_value(d.selector)}" if d.domain else ""
    bfield = f" header.b={_value(d.b)}" if d.b else ""
    return f"dkim={d.result}{reason}{ident}{bfield}"


def _results_field(authserv_id: str, *groups: list[str]) -> bytes:
    parts = [part for group in groups for part in group]
    return (f"Authentication-Results: {authserv_id};\r\n\t" + ";\r\n\t".join(parts) + "\r\n").encode("utf-8")


_TOKEN = re.compile(r"^[A-Za-z0-9!#$%&'*+\-/=?^_`{|}~.@]+$")


def _value(text: str) -> str:
    """A value as RFC 8601 writes it: a token, else a quoted string; at most VALUE_MAX bytes (a
    longer one is no valid address or domain: it is cut)."""
    if _TOKEN.fullmatch(text):  # fullmatch: `$` alone would let a final line break through
        return text[:VALUE_MAX]
    return f'"{_quoted(text, VALUE_MAX)}"'


def _quoted(text: str, limit: int = 200) -> str:
    """The text as a quoted string's content: printable, no quote or backslash, at most `limit`
    bytes of UTF-8."""
    kept = "".join(c for c in text if c.isprintable() and c not in '"\\')
    return kept.encode("utf-8", "ignore")[:limit].decode("utf-8", "ignore")


# --------------------------------------------------------------------------- header helpers


def split_header(message: bytes) -> tuple[bytes, bytes]:
    """(the header section with its last line ending, as bytes like header_section's, the rest
    from the empty line on)."""
    end = len(header_section(message))
    if message[end - 1:end + 1] == b"\r\n":
        end += 1  # the CR of the last line's CRLF ends the section there: keep its LF with it
    return bytes(message[:end]), message[end:]


def header_fields(block: bytes) -> list[bytes]:
    """The raw fields of a header block, each with its folded lines and line ending."""
    fields: list[bytes] = []
    for line in block.splitlines(keepends=True):
        if line[:1] in (b" ", b"\t") and fields:
            fields[-1] += line
        else:
            fields.append(line)
    return fields


def strip_forged_results(message: bytes, authserv_id: str) -> tuple[bytes, int]:
    """The message without the Authentication-Results fields that claim our authserv-id (RFC 8601
    5: only this host may write them), and how many were removed; every other byte is kept. A
    message with no such field is given back as it is (the same object: nothing copied)."""
    if b"authentication-results" not in header_section(message).lower():
        return message, 0
    block, rest = split_header(message)
    kept: list[bytes] = []
    removed = 0
    ours = authserv_id.lower()
    for raw in header_fields(block):
        name, colon, value = raw.partition(b":")
        if colon and name.strip().lower() == b"authentication-results":
            text = re.sub(r"\([^)]*\)", "", value.decode("utf-8", "replace"))  # comments (CFWS) aside
            claimed = text.split(";", 1)[0].strip().split()
            if claimed and claimed[0].lower() == ours:
                removed += 1
                continue
        kept.append(raw)
    return (b"".join(kept) + rest, removed) if removed else (message, 0)


def from_domains(block: bytes) -> list[str]:
    """The domains of the From field's addresses (RFC 5322.From), lowercased, in order."""
    domains = []
    for _, address in email.utils.getaddresses(fields(block, "From")):
        domain = address.rpartition("@")[2].strip().lower().rstrip(".")
        if "@" in address and domain:
            domains.append(domain)
    return domains


# --------------------------------------------------------------------------- the checks


@dataclass
class AuthPolicy:
    """What the results decide, from [inbound]."""

    dmarc_reject: bool = True
    dmarc_quarantine: bool = True
    spf_reject_fail: bool = False


class SenderAuth:
    """Runs the checks of one message; one per listener, shared by its sessions."""

    def __init__(self, resolver: dns.asyncresolver.Resolver, dns_timeout: float) -> None:
        self.resolver = resolver
        self.dns_timeout = dns_timeout
        #: The library calls mostly wait for DNS answers: a pool of its own, larger than the
        #: loop's default (cores + 4), so slow DNS for one message does not hold up the others.
        self.threads = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="cassmail-auth")

    def _in_thread(self, call: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        """`call(*args)` in the pool, with this context (the DNS bridge) copied in."""
        context = contextvars.copy_context()
        return asyncio.get_running_loop().run_in_executor(self.threads, context.run, call, *args)

    async def check(self, message: bytes, ip: str, helo: str, sender: str) -> AuthOutcome:
        """Every method's result for a message from `ip` that said `helo` and MAIL FROM `sender`."""
        bridge = DnsBridge(self.resolver, asyncio.get_running_loop())
        token = _bridge.set(bridge)
        try:
            spf_task = self._in_thread(self._spf, ip, helo, sender)
            dkim_task = self._in_thread(self._dkim, message, bridge)
            arc_task = self._in_thread(self._arc, message, bridge)
            (spf_mfrom, spf_helo, mfrom_domain), dkims, arc = await asyncio.gather(spf_task, dkim_task, arc_task)
        finally:
            _bridge.reset(token)
        outcome = AuthOutcome(spf_mfrom=spf_mfrom, spf_helo=spf_helo, mfrom_domain=mfrom_domain,
                              helo=_helo_name(helo), sender=sender, dkim=dkims, arc=arc)
        await self._dmarc(outcome, split_header(message)[0], bridge)
        return outcome

    # SPF ----------------------------------------------------------------

    def _spf(self, ip: str, helo: str, sender: str) -> tuple[str, str, str]:
        """(MAIL FROM result, HELO result, the domain checked for MAIL FROM: the sender's, or
        the HELO name for the null sender, RFC 7208 2.4)."""
        name = _helo_name(helo)
        helo_result = NONE
        if name:
            helo_result = self._spf_query(ip, "", name)
        if sender:
            domain = sender.rpartition("@")[2].lower()
            return self._spf_query(ip, sender, name or domain), helo_result, domain
        return helo_result, helo_result, name

    def _spf_query(self, ip: str, sender: str, helo: str) -> str:
        try:
            query = spf.query(i=ip, s=sender, h=helo, timeout=self.dns_timeout, querytime=self.dns_timeout * 2)
            result, _code, _why = query.check()
        except (spf.PermError, *LIBRARY_INPUT_ERRORS) as exc:
            log.debug("spf %s: %s", sender or helo, exc)
            return PERMERROR
        return str(result) if result in (PASS, FAIL, SOFTFAIL, NEUTRAL, NONE, TEMPERROR, PERMERROR) else PERMERROR

    # DKIM and ARC -------------------------------------------------------

    def _dkim(self, message: bytes, bridge: DnsBridge) -> list[DkimResult]:
        if not _has_field(message, b"dkim-signature"):
            return []
        try:
            signed = dkim.DKIM(message, logger=_LIBRARY_LOG, timeout=int(self.dns_timeout))
        except dkim.DKIMException as exc:
            return [DkimResult(PERMERROR, reason=str(exc))]
        count = sum(1 for name, _ in signed.headers if name.lower() == b"dkim-signature")
        results = []
        for idx in range(count):
            signed.domain, signed.selector = None, b""
            signed.signature_fields = {}
            try:
                ok = signed.verify(idx=idx, dnsfunc=bridge.txt)
                result, reason = (PASS, "") if ok else (FAIL, "signature verification failed")
            except DnsTemporary as exc:
                result, reason = TEMPERROR, f"key lookup failed: {exc}"
            except dkim.ValidationError as exc:
                result, reason = FAIL, str(exc).split(" (")[0]
            except dkim.DKIMException as exc:
                result, reason = PERMERROR, str(exc)
            except LIBRARY_INPUT_ERRORS as exc:
                # dkimpy lets some malformed signatures through as Python errors (bad base64, ...).
                result, reason = PERMERROR, f"malformed signature ({type(exc).__name__})"
            fields = getattr(signed, "signature_fields", {}) or {}
            results.append(DkimResult(
                result, _text(fields.get(b"d", b"")).lower(), _text(fields.get(b"s", b"")),
                re.sub(r"\s+", "", _text(fields.get(b"b", b"")))[:8], reason[:120]))
        return results

    def _arc(self, message: bytes, bridge: DnsBridge) -> str:
        if not _has_field(message, b"arc-seal"):
            return NONE  # no chain: not worth dkimpy parsing the message
        try:
            cv, _results, _why = dkim.ARC(message, logger=_LIBRARY_LOG, timeout=int(self.dns_timeout)).verify(
                dnsfunc=bridge.txt)
        except DnsTemporary:
            return TEMPERROR
        except (dkim.DKIMException, *LIBRARY_INPUT_ERRORS):
            return FAIL
        if cv == dkim.CV_Pass:
            return PASS
        if cv == dkim.CV_None:
            return NONE
        return FAIL

    # DMARC --------------------------------------------------------------

    async def _dmarc(self, outcome: AuthOutcome, block: bytes, bridge: DnsBridge) -> None:
        domains = list(dict.fromkeys(from_domains(block)))
        if not domains:
            outcome.dmarc, outcome.dmarc_reason = NONE, "no From domain"
            return
        if len(domains) > 1:
            outcome.dmarc, outcome.dmarc_reason = PERMERROR, "more than one From domain"
            outcome.from_domain = domains[0]
            return
        domain = outcome.from_domain = domains[0]
        try:
            record, org = await self._dmarc_record(domain, bridge)
        except DnsTemporary:
            outcome.dmarc = TEMPERROR
            return
        if record is None:
            outcome.dmarc = NONE
            return
        try:
            policy = dmarc.DMARC(org_domains()).parse_record(record, domain, org)
        except (dmarc.RecordSyntaxError, *LIBRARY_INPUT_ERRORS) as exc:
            outcome.dmarc, outcome.dmarc_reason = PERMERROR, f"bad DMARC record: {exc}"
            return
        try:
            result = self._evaluate(policy, outcome)
        except LIBRARY_INPUT_ERRORS as exc:
            outcome.dmarc, outcome.dmarc_reason = PERMERROR, f"cannot evaluate ({type(exc).__name__})"
            return
        if result.result is dmarc.DMARCResult.PASS:
            outcome.dmarc = PASS
            return
        outcome.dmarc = FAIL
        disposition = result.disposition.value or "none"
        if disposition != "none" and policy.pct < 100 and random.randrange(100) >= policy.pct:
            # RFC 7489 6.6.4: outside the sampled share, the next lower policy applies.
            disposition = "quarantine" if disposition == "reject" else "none"
        outcome.policy = disposition

    @staticmethod
    def _evaluate(policy: Any, outcome: AuthOutcome) -> Any:
        """The `dmarc` package's verdict on the SPF and DKIM results (alignment, p/sp)."""
        spf_result = outcome.spf_mfrom if outcome.spf_mfrom in {r.value for r in dmarc.SPFResult} else NONE
        auth = dmarc.AuthResults(
            spf=dmarc.SPFAuthResult(outcome.mfrom_domain, dmarc.SPFResult(spf_result)) if outcome.mfrom_domain else None,
            dkim=[dmarc.DKIMAuthResult(d.domain, dmarc.DKIMResult(d.result)) for d in outcome.dkim if d.domain] or None,
        )
        return dmarc.DMARC(org_domains()).get_result(policy, auth_results=auth)

    async def _dmarc_record(self, domain: str, bridge: DnsBridge) -> tuple[str | None, str | None]:
        """The DMARC record of the From domain, else of its organisational domain (then also
        named): RFC 7489 6.6.3."""
        record = await self._dmarc_txt(domain, bridge)
        if record is not None:
            return record, None
        org = org_domains().get_public_suffix(domain)
        if org and org != domain:
            record = await self._dmarc_txt(org, bridge)
            if record is not None:
                return record, org
        return None, None

    async def _dmarc_txt(self, domain: str, bridge: DnsBridge) -> str | None:
        texts = [b"".join(r.strings).decode("utf-8", "replace") for r in await bridge.resolve(f"_dmarc.{domain}", "TXT")]
        records = [t for t in texts if re.match(r"v\s*=\s*DMARC1\s*(;|$)", t)]
        return records[0] if len(records) == 1 else None


def _has_field(message: bytes, name: bytes) -> bool:
    """Whether the header section may hold a field of that (lowercase) name: a cheap look before
    a library parses the whole message."""
    return name in split_header(message)[0].lower()


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _helo_name(helo: str) -> str:
    """The HELO name as an SPF identity: a domain, not an address literal or a bare word."""
    name = (helo or "").strip().rstrip(".").lower()
    if not name or "." not in name or name.startswith("["):
        return ""
    try:
        ipaddress.ip_address(name)
        return ""
    except ValueError:
        return name


def decide(outcome: AuthOutcome, policy: AuthPolicy) -> tuple[str, str]:
    """(verdict, SMTP reply): "reject", "tempfail", "junk" or "accept" (reply "").

    A DNS failure that leaves the verdict open is temporary: the DMARC record could not be read,
    or DMARC failed while an SPF or DKIM result that might have passed it is a temperror."""
    acting = policy.dmarc_reject or policy.dmarc_quarantine
    if outcome.dmarc == TEMPERROR and acting:
        return "tempfail", f"451 4.7.5 DNS lookup of the DMARC policy of {outcome.from_domain} failed, try again later"
    failed = outcome.dmarc == FAIL and outcome.policy in ("reject", "quarantine")
    undecided = outcome.spf_mfrom == TEMPERROR or any(d.result == TEMPERROR for d in outcome.dkim)
    if failed and undecided and acting:
        return "tempfail", "451 4.7.5 DNS lookups the DMARC verdict needs failed, try again later"
    if policy.spf_reject_fail:
        if outcome.spf_mfrom == FAIL:
            return "reject", f"550 5.7.23 SPF check failed for {outcome.mfrom_domain}"
        if outcome.spf_mfrom == TEMPERROR:
            return "tempfail", "451 4.7.24 SPF DNS lookup failed, try again later"
    if failed and outcome.policy == "reject" and policy.dmarc_reject:
        return "reject", f"550 5.7.1 Message rejected by the DMARC policy of {outcome.from_domain}"
    if failed and policy.dmarc_quarantine:
        return "junk", ""
    return "accept", ""
