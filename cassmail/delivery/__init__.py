"""Outbound mail: queue workers that take due messages from the store under leases and
deliver them to other domains.

`routing` finds where a domain's mail goes (transport map, relayhost, DNS MX with A/AAAA
fallback and null MX), `client` speaks SMTP to it (aiosmtplib: STARTTLS by policy, AUTH
at a relayhost, pooled connections per destination), `dkim` signs, `dsn` writes the
reports sent back to senders, `message` reads what delivery needs from a message, and
`worker` runs it all in each worker process of `cassmail serve`. Like the protocols, this
package knows the store only through the Store contract.
"""

from __future__ import annotations

from cassmail.delivery.worker import DeliveryWorker

__all__ = ["DeliveryWorker"]
