"""cassmail: a horizontally scalable mail service (SMTP, POP3, IMAP) over Apache Cassandra."""

import sys as _sys

__version__ = "0.1.0"

# cassandra-driver imports its Twisted connection class whenever Twisted is installed (as it is
# here, for POP3), and with it `twisted.internet.reactor`: Twisted's default reactor, installed
# in every process that imports the driver, at about 0.4 s of CPU (a third of a `cassmail alias
# list`). cassmail never uses that class: the driver's import of it fails at once instead, and
# its `TwistedConnection` is None, which it allows (tests/test_cli.py checks both).
_sys.modules.setdefault("cassandra.io.twistedreactor", None)  # type: ignore[arg-type]
