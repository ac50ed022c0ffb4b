"""Settings: TOML file, then environment, then flags; every bad value stops start-up with one line naming the key."""

from __future__ import annotations

import dataclasses
import re

from pathlib import Path

import pytest

from cassmail import config
from cassmail.config import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cassmail.toml"
    path.write_text(text)
    return path


def test_defaults_need_no_file() -> None:
    settings = config.load(env={})
    assert settings.store.backend == "mbox" and settings.store.mbox.path == "./var/mail"
    assert settings.store.cassandra.contact_points == ["127.0.0.1"]
    assert settings.smtp.listen == "127.0.0.1:2525" and settings.submission.listen == "127.0.0.1:2587"
    assert settings.pop3.listen == "127.0.0.1:1110" and settings.imap.listen == "127.0.0.1:1143"
    assert settings.lmtp.enabled is False


def test_file_then_environment_then_flags(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        [store.cassandra]
        contact_points = ["10.0.0.1", "10.0.0.2"]
        keyspace = "from_file"
        replication_factor = 3
        write_consistency = "QUORUM"
        [smtp]
        listen = "0.0.0.0:25"
        """,
    )
    env = {"CASSMAIL_CONFIG": str(path), "CASSMAIL_STORE_CASSANDRA_KEYSPACE": "from_env", "CASSMAIL_SMTP_ENABLED": "false"}
    settings = config.load(env=env, overrides=["store.cassandra.keyspace=from_flag"])
    c = settings.store.cassandra
    assert c.contact_points == ["10.0.0.1", "10.0.0.2"] and c.replication_factor == 3 and c.write_consistency == "QUORUM"
    assert c.keyspace == "from_flag"
    assert settings.smtp.listen == "0.0.0.0:25" and settings.smtp.enabled is False


def test_environment_lists_and_tables_are_parsed() -> None:
    settings = config.load(
        env={
            "CASSMAIL_STORE_CASSANDRA_CONTACT_POINTS": "127.0.0.1, 127.0.0.2,127.0.0.3",
            "CASSMAIL_STORE_CASSANDRA_REPLICATION_STRATEGY": "NetworkTopologyStrategy",
            "CASSMAIL_STORE_CASSANDRA_DATACENTERS": "dc1=3, dc2=2",
            "CASSMAIL_STORE_CASSANDRA_REQUEST_TIMEOUT": "2.5",
        }
    )
    c = settings.store.cassandra
    assert c.contact_points == ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    assert c.datacenters == {"dc1": 3, "dc2": 2} and c.request_timeout == 2.5


@pytest.mark.parametrize(
    "text, message",
    [
        ("[store]\nbackend = 'sqlite'", "store.backend: must be cassandra, mbox or wheelfs"),
        ("[store.cassandra]\nreplication_factor = 'three'", "store.cassandra.replication_factor: must be an integer"),
        ("[store.cassandra]\nreplication_factor = 0", "store.cassandra.replication_factor: must be >= 1"),
        ("[store.cassandra]\nwrite_consistency = 'MOST'", "store.cassandra.write_consistency: must be one of"),
        ("[store.cassandra]\nserial_consistency = 'ONE'", "store.cassandra.serial_consistency: must be SERIAL or LOCAL_SERIAL"),
        ("[store.cassandra]\nkeyspace = 'bad-name'", "store.cassandra.keyspace: must be letters"),
        ("[store.cassandra]\nchunk_size = 16777216", "store.cassandra.chunk_size: must be between"),
        ("[store.cassandra]\nprotocol_version = 3", "store.cassandra.protocol_version: must be 4 or 5"),
        ("[store.cassandra]\nreplication_strategy = 'NetworkTopologyStrategy'", "store.cassandra.datacenters: NetworkTopologyStrategy needs"),
        ("[store.cassandra]\ncontact_points = '10.0.0.1'", "store.cassandra.contact_points: must be a list"),
        ("[smtp]\nlisten = 'localhost'", 'smtp.listen: must be "host:port"'),
        ("[smtp]\nlisten = ':25'", "smtp.listen: missing host"),
        ("[imap]\nlisten = '127.0.0.1:70000'", "imap.listen: port out of range"),
        ("[smtp]\nlisen = '127.0.0.1:25'", "smtp.lisen: unknown setting"),
        ("[smpt]\nlisten = '127.0.0.1:25'", "smpt: unknown setting"),
        ("[auth]\nscrypt_n = 1000", "auth.scrypt_n: must be a power of two"),
        ("[pop3]\nenabled = 'maybe'", "pop3.enabled: must be true or false"),
        ("[smtp]\nmax_command_rate = 5", "smtp.max_command_rate: must be 0 (no limit) or >= 10 commands per minute"),
        ("[lmtp]\nmax_connection_rate = -1", "lmtp.max_connection_rate: must be 0 (no limit) or >= 1"),
        ("[submission]\nrate_limit_exempt = ['10.0.0.0/8', 'localhost']", "submission.rate_limit_exempt[1]: must be an IP"),
        ("[smtp]\nrate_limit_exempt = '10.0.0.0/8'", "smtp.rate_limit_exempt: must be a list"),
        ("[pop3]\nmax_pipelined_bytes = 100", "pop3.max_pipelined_bytes: must be 1024..16777216 bytes"),
        ("store = 3", "store: must be a table"),
        ("[store\nbackend=", "invalid TOML"),
    ],
)
def test_invalid_settings_stop_with_one_line_naming_the_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        config.load(write(tmp_path, text), env={})
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_rate_limits_default_on_with_loopback_exempt_and_zero_turns_them_off() -> None:
    settings = config.load(env={})
    for listener in (settings.smtp, settings.submission, settings.lmtp):
        assert listener.max_command_rate == 600 and listener.max_connection_rate == 300
        assert listener.rate_limit_exempt == ["127.0.0.0/8", "::1/128"]
    assert settings.pop3.max_pipelined_bytes == 64 * 1024
    off = config.load(
        env={"CASSMAIL_SMTP_MAX_COMMAND_RATE": "0", "CASSMAIL_SMTP_RATE_LIMIT_EXEMPT": "[]"},
        overrides=["smtp.max_connection_rate=0", "submission.rate_limit_exempt=2001:db8::/32, 192.0.2.7"],
    )
    assert off.smtp.max_command_rate == 0 and off.smtp.max_connection_rate == 0 and off.smtp.rate_limit_exempt == []
    assert off.submission.rate_limit_exempt == ["2001:db8::/32", "192.0.2.7"]


def test_bad_environment_and_flag_values_name_their_key() -> None:
    with pytest.raises(ConfigError, match="store.cassandra.port: must be an integer"):
        config.load(env={"CASSMAIL_STORE_CASSANDRA_PORT": "ninety"})
    with pytest.raises(ConfigError, match="store.nope: unknown setting"):
        config.load(env={}, overrides=["store.nope=1"])
    with pytest.raises(ConfigError, match="must be"):
        config.load(env={}, overrides=["store.cassandra"])
    with pytest.raises(ConfigError, match="is a section"):
        config.load(env={}, overrides=["store.cassandra=1"])


@pytest.mark.parametrize(
    "name, message",
    [
        ("CASSMAIL_STORE_CASANDRA_PORT", "did you mean CASSMAIL_STORE_CASSANDRA_PORT?"),
        ("CASSMAIL_SMTP_LISEN", "did you mean CASSMAIL_SMTP_LISTEN?"),
        ("CASSMAIL_store_backend", "did you mean CASSMAIL_STORE_BACKEND?"),
        ("CASSMAIL_AUTH_SOMETHING_ELSE_ENTIRELY", "no setting of [auth] has this name"),
        ("CASSMAIL_STORE_CASSANDRA", "unknown setting"),  # a section, not a key
    ],
)
def test_an_unknown_setting_in_the_environment_is_refused_naming_the_variable(name: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        config.load(env={name: "29042"})
    assert str(err.value).startswith(f"{name}: unknown setting in the environment") and message in str(err.value)
    assert "\n" not in str(err.value)


def test_the_projects_own_variables_that_are_not_settings_are_left_alone() -> None:
    """Found with `grep -r CASSMAIL_`: the settings file, the local cluster, the launcher's cache,
    the tests, the load tests (their targets are bare section names) and docker compose's knobs."""
    env = {
        name: "x"
        for name in (
            "CASSMAIL_CONFIG", "CASSMAIL_CLUSTER", "CASSMAIL_CACHE", "CASSMAIL_TEST_CASSANDRA", "CASSMAIL_TEST_KEEP",
            "CASSMAIL_TEST_WHEELFS_CUES", "CASSMAIL_LOADTEST_PROFILE", "CASSMAIL_LOADTEST_USERS", "CASSMAIL_SMTP",
            "CASSMAIL_POP3", "CASSMAIL_IMAP", "CASSMAIL_RF", "CASSMAIL_KEYSPACE", "CASSMAIL_WORKERS",
            "CASSMAIL_PUBLISH_ADDRESS", "CASSMAIL_ALLOW_PLAINTEXT_AUTH", "CASSMAIL_READ_CONSISTENCY",
            "CASSMAIL_WRITE_CONSISTENCY", "CASSMAIL_MBOX_CRASH_AT",
        )
    }
    env.pop("CASSMAIL_CONFIG")  # would name a file
    env["CASSMAIL_STORE_CASSANDRA_PORT"] = "29042"
    assert config.load(env=env).store.cassandra.port == 29042


def test_a_missing_config_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found: .*nothere.toml"):
        config.load(tmp_path / "nothere.toml", env={})


def test_the_shipped_example_config_loads_and_matches_the_defaults() -> None:
    assert config.example_path().exists()
    settings = config.load(config.example_path(), env={})
    defaults = config.load(env={})
    # The example is a Cassandra node's file; everything else in it is the default.
    assert settings.store.backend == "cassandra" and defaults.store.backend == "mbox"
    settings.store.backend = defaults.store.backend
    assert settings == defaults


def test_the_shipped_example_config_names_every_setting() -> None:
    """Every key of every section is either set in the example or named in its comments (the
    keys all listeners share are described once), so an operator finds each one there."""
    text = config.example_path().read_text()
    section, named = "", set()
    for line in text.splitlines():
        if match := re.match(r"\s*#?\s*\[([\w.]+)\]", line):
            section = match.group(1)
        elif match := re.match(r"\s*#?\s*(\w+)\s*=", line):
            named.add(f"{section}.{match.group(1)}")
    comments = " ".join(line for line in text.splitlines() if line.lstrip().startswith("#"))

    def missing(obj: object, prefix: str) -> list[str]:
        out = []
        for f in dataclasses.fields(obj):
            value, key = getattr(obj, f.name), f"{prefix}.{f.name}".lstrip(".")
            if dataclasses.is_dataclass(value):
                out += missing(value, key)
            elif key not in named and not re.search(rf"\b{f.name}\b", comments):
                out.append(key)
        return out

    assert missing(config.Settings(), "") == []


def test_settings_written_as_toml_load_back_the_same(tmp_path: Path) -> None:
    settings = config.load(env={}, overrides=["store.backend=cassandra", "store.cassandra.contact_points=a,b",
                                              "imap.idle_poll=0.5", 'node.name=n "quoted"'])
    path = tmp_path / "written.toml"
    path.write_text(config.to_toml(settings))
    assert config.load(path, env={}) == settings


def test_outbound_settings_are_checked_and_the_mx_never_takes_trusted_networks() -> None:
    settings = config.load(env={}, overrides=[
        'relay.transport={ "partner.example" = "[127.0.0.1]:2526", ".internal.example" = "relay.internal.example" }',
        "relay.nameservers=127.0.0.1:5353,::1", "submission.trusted_networks=10.0.0.0/8",
    ])
    assert settings.relay.transport == {"partner.example": "[127.0.0.1]:2526", ".internal.example": "relay.internal.example"}
    assert settings.relay.nameservers == ["127.0.0.1:5353", "::1"]
    assert settings.submissions.implicit_tls and not settings.submissions.enabled  # needs a certificate
    for bad, key in (("smtp.trusted_networks=10.0.0.0/8", "smtp.trusted_networks"),
                     ('relay.transport={ "x.example" = "a b" }', "relay.transport.x.example"),
                     ("relay.nameservers=mx.example", "relay.nameservers[0]"), ("relay.tls=sometimes", "relay.tls"),
                     ("relay.relayhost_username=u", "relay.relayhost_username"),
                     ("delivery.max_backoff=1", "delivery.max_backoff"), ("submissions.enabled=true", "submissions.implicit_tls")):
        with pytest.raises(ConfigError, match=f"^{re.escape(key)}: "):
            config.load(env={}, overrides=[bad])
