"""DKIM (RFC 6376) signing of outgoing mail with dkimpy, keys kept in the store.

A message is signed for the domain of its From: address when that domain has a key, else
for the envelope sender's domain when that one has (signing is optional per domain: no key,
no signature). Canonicalization is relaxed/relaxed, the algorithm rsa-sha256. Keys are made
by `cassmail dkim add DOMAIN`, which stores the private key and prints the TXT record to
publish at `<selector>._domainkey.<domain>`.
"""

from __future__ import annotations

import base64
import time

import dkim
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from cassmail.store.base import DkimKey, Store, StoreError

#: Header fields signed (those present); From is always among them.
SIGNED_HEADERS = (b"From", b"Sender", b"Reply-To", b"Subject", b"Date", b"Message-ID", b"To", b"Cc",
                  b"MIME-Version", b"Content-Type", b"Content-Transfer-Encoding", b"In-Reply-To", b"References")
#: Seconds a worker keeps a domain's key (or the fact it has none) before asking the store again.
KEY_CACHE_SECONDS = 60.0


def generate(bits: int = 2048) -> tuple[str, str]:
    """A new RSA key: (private key PEM, the public key as the TXT record's p= value)."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=bits)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption()).decode("ascii")
    return pem, public_value(pem)


def public_value(pem: str) -> str:
    key = serialization.load_pem_private_key(pem.encode("ascii"), password=None)
    der = key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return base64.b64encode(der).decode("ascii")


def txt_record(key: DkimKey) -> str:
    """The zone-file line an operator publishes for the key (long values split into strings of 255)."""
    value = f"v=DKIM1; k=rsa; p={public_value(key.private_key_pem)}"
    strings = " ".join(f'"{value[i:i + 255]}"' for i in range(0, len(value), 255))
    return f"{key.selector}._domainkey.{key.domain}. IN TXT ( {strings} )"


def sign(message: bytes, key: DkimKey) -> bytes:
    """The message with a DKIM-Signature field in front (CRLF line ends, as it is sent)."""
    present = {line.split(b":", 1)[0].strip().lower() for line in message.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
               if b":" in line and line[:1] not in (b" ", b"\t")}
    include = [h for h in SIGNED_HEADERS if h.lower() in present] or [b"From"]
    signature = dkim.sign(message, key.selector.encode("ascii"), key.domain.encode("idna"),
                          key.private_key_pem.encode("ascii"), canonicalize=(b"relaxed", b"relaxed"),
                          include_headers=include)
    return signature + message


class Keys:
    """A worker's view of the store's DKIM keys, cached briefly (one store read per domain a minute)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._cache: dict[str, tuple[float, DkimKey | None]] = {}

    async def get(self, domain: str | None) -> DkimKey | None:
        if not domain:
            return None
        now = time.monotonic()
        hit = self._cache.get(domain)
        if hit is not None and hit[0] > now:
            return hit[1]
        try:
            key = await self.store.get_dkim_key(domain)
        except StoreError:
            if hit is not None:
                return hit[1]
            raise
        except ValueError:  # not a domain name a store takes: nothing to sign with
            key = None
        self._cache[domain] = (now + KEY_CACHE_SECONDS, key)
        return key
