"""cassmail: a horizontally scalable mail service (SMTP, POP3, IMAP) over Apache Cassandra."""

__version__ = "0.1.0"
