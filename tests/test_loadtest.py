"""The load-test tooling works end to end, in short bounded runs (seconds each): locust against a
real `cassmail serve`, postal and rabid against it, the report from their output, and the
comparison with a private Postfix and Dovecot. Speed itself is measured by the benchmarks, never
here: these tests check that the tools run, count what the server really did and clean up.

The node runs on the mbox store (no Cassandra needed: the store is not what these tests are about);
postal, rabid, Postfix and Dovecot are Debian packages, installed when missing like the other
test tools.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import REPO, backend_settings_for
from tests.nodes import Node, node_settings

LOADTEST = REPO / "loadtest"
sys.path.insert(0, str(LOADTEST))

from _common import parse_ranges, pid_age  # noqa: E402
from postal import LoadRun, Tick, _drained, drop_drained_tail, error_messages, parse_minute  # noqa: E402

PY = sys.executable
LOCUST = str(Path(sys.executable).parent / "locust")


def _tools(**wanted: bool) -> None:
    """Install postal/rabid (and the baseline servers) when missing, as `make test-tools` does."""
    from baseline import ensure_packages, missing_packages

    if not missing_packages(**wanted):
        return
    if os.geteuid() != 0 and os.environ.get("CI", "").lower() not in ("1", "true", "yes"):
        pytest.skip(f"needs Debian packages {missing_packages(**wanted)} (root installs them)")
    ensure_packages(**wanted)


@pytest.fixture(scope="module")
def mail_node(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A `cassmail serve` on the mbox store with SMTP, POP3 and IMAP (plaintext logins on loopback)."""
    settings = node_settings(backend_settings_for("mbox", request))
    node = Node(settings, tmp_path_factory.mktemp("loadnode"), submission={"enabled": False},
                lmtp={"enabled": False}, pop3={"allow_plaintext_auth": True, "auth_failure_delay": 0.0},
                imap={"allow_plaintext_auth": True, "auth_failure_delay": 0.0, "idle_poll": 0.3}).start()
    yield node
    assert node.stop() == 0
    assert "Traceback" not in node.log_text()


def _stats(path: Path) -> dict[tuple[str, str], dict[str, str]]:
    with open(path, newline="") as fh:
        return {(row["Type"], row["Name"]): row for row in csv.DictReader(fh)}


def _domains(node: Node) -> list[str]:
    out = subprocess.run([str(Path(PY).parent / "cassmail"), "--config", str(node.config), "domain", "list"],
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.split()


# --------------------------------------------------------------------------- parsing and arithmetic


def test_postal_minute_lines_are_parsed_and_a_wrapped_data_column_is_corrected() -> None:
    assert parse_minute("time,messages,data(K),errors,connections,SSL connections") is None
    m = parse_minute("07:41,569,4511,0,187,0")
    assert (m.clock, m.messages, m.kib, m.errors, m.connections, m.wraps) == ("07:41", 569, 4511, 0, 187, 0)
    # 5,219 messages of ~1.1 MB in a minute: postal's 32-bit counter printed 1.48 GB.
    wrapped = parse_minute("10:02,5219,1445312,0,600,0", mean_size=1_100_000)
    assert wrapped.wraps == 1 and wrapped.bytes == 1445312 * 1024 + (1 << 32)


def test_a_refusal_postal_prints_on_two_lines_is_one_error() -> None:
    reply = "Server error:451 4.3.0 Mail system temporarily unavailable, try again later\r\n.\n"
    assert error_messages(reply * 3 + "Can't connect to 127.0.0.1 port 2525.\n") == [
        "Server error:451 4.3.0 Mail system temporarily unavailable, try again later."] * 3 + [
        "Can't connect to 127.0.0.1 port 2525."]


def test_a_run_drops_the_warm_up_interval_and_averages_the_last_ones() -> None:
    run = LoadRun("postal", "x", "50K-500K", interval=60, average_last=2)
    counts = [0, 100, 400, 700, 1000]  # 100/min while warming up, then 300/min
    run.ticks = [Tick(60.0 * i, n, {"cassmail": 30.0 * i}, 100.0 * i) for i, n in enumerate(counts)]
    assert run.rates() == [100, 300, 300, 300]
    assert run.window() == (2, 4)
    assert run.stat() == (300, 0)
    assert run.cores("cassmail") == pytest.approx(0.5)
    run.server_before, run.server_after = (0, 0), (1000, 200_000_000)
    assert run.mb_per_s() == pytest.approx(300 * 200_000 / 60e6)
    assert LoadRun.from_json(json.loads(json.dumps(run.to_json()))).stat() == run.stat()


def test_rabid_is_stopped_only_after_two_intervals_without_a_message() -> None:
    ticks = [Tick(float(i), n, {}, 0.0) for i, n in enumerate([0, 10, 20, 20])]
    assert not _drained(ticks)
    assert _drained(ticks + [Tick(4.0, 20, {}, 0.0)])
    assert not _drained([Tick(float(i), 0, {}, 0.0) for i in range(5)])  # nothing ever came: not "drained"
    # with what the mailboxes held known: empty as soon as that much was taken
    assert _drained(ticks[:3], messages=20) and not _drained(ticks[:2], messages=20)
    assert parse_ranges("200K-2M, 50K") == [(200_000, 2_000_000), (50_000, 50_000)]


@pytest.mark.parametrize("counts, messages, kept", [
    # emptied before the deadline, then stopped: the idle intervals and the emptying one go
    ([0, 100, 200, 300, 330, 330, 330], None, [0, 100, 200, 300]),
    # emptied just before the deadline: its one idle interval goes too
    ([0, 100, 200, 300, 310, 310], None, [0, 100, 200, 300]),
    # the last messages taken in the last interval: seen only knowing what the mailboxes held
    ([0, 100, 200, 300, 310], 310, [0, 100, 200, 300]),
    ([0, 100, 200, 300, 310], None, [0, 100, 200, 300, 310]),
    # still busy at the deadline: every interval is kept
    ([0, 100, 200, 300, 400], 500, [0, 100, 200, 300, 400]),
    # nothing ever came: nothing to measure, nothing dropped
    ([0, 0, 0, 0], None, [0, 0, 0, 0]),
])
def test_a_retrieval_that_emptied_the_mailboxes_is_measured_while_mail_was_there(counts, messages, kept) -> None:
    run = LoadRun("rabid", "s", "50K", 15.0, 5)
    run.ticks = [Tick(15.0 * i, n, {}, 0.0) for i, n in enumerate(counts)]
    drop_drained_tail(run, messages)
    assert [t.messages for t in run.ticks] == kept
    assert bool(run.notes) == (kept != counts)


# --------------------------------------------------------------------------- the tools against a node


@pytest.fixture(scope="module")
def postal_results(mail_node: Node, tmp_path_factory: pytest.TempPathFactory) -> Path:
    _tools(postal=True)
    out = tmp_path_factory.mktemp("postal")
    cmd = [PY, str(LOADTEST / "postal.py"), "--config", str(mail_node.config),
           "--smtp", f"127.0.0.1:{mail_node.port('smtp')}", "--pop3", f"127.0.0.1:{mail_node.port('pop3')}",
           "--users", "20", "--sizes", "2K-20K", "--seconds", "4", "--interval", "1", "--threads", "4",
           "--processes", "4", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def test_postal_and_rabid_runs_count_what_the_server_stored_and_deleted(postal_results: Path, mail_node: Node) -> None:
    runs = {r.tool: r for r in (LoadRun.from_json(json.loads(p.read_text()))
                                for p in (postal_results / "json").glob("run-*.json"))}
    assert set(runs) == {"postal", "rabid"}
    postal, rabid = runs["postal"], runs["rabid"]
    assert postal.total > 0 and postal.errors == 0
    # Every message postal saw accepted (its log) is in the store: nothing acknowledged was lost.
    gained = postal.server_after[0] - postal.server_before[0]
    assert gained >= postal.total
    assert postal.stat()[0] > 0 and postal.mb_per_s() > 0
    assert {"postal"} <= set(postal.ticks[-1].cpu)
    deleted = rabid.server_before[0] - rabid.server_after[0]
    assert rabid.total > 0 and deleted > 0
    # The users created for the run were removed again.
    assert not [d for d in _domains(mail_node) if d.startswith("loadtest-")]


@pytest.fixture(scope="module")
def locust_results(mail_node: Node, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("locust")
    env = {**os.environ, "CASSMAIL_SMTP": f"127.0.0.1:{mail_node.port('smtp')}",
           "CASSMAIL_POP3": f"127.0.0.1:{mail_node.port('pop3')}", "CASSMAIL_CONFIG": str(mail_node.config),
           "CASSMAIL_LOADTEST_NUSERS": "30", "CASSMAIL_LOADTEST_SIZES": "2K-20K"}
    env.pop("CASSMAIL_IMAP", None)
    cmd = [LOCUST, "-f", str(LOADTEST / "locustfile.py"), "--headless", "-u", "4", "-r", "4", "-t", "5s",
           "--csv", str(out / "locust"), "--csv-full-history", "--only-summary", "--exit-code-on-error", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def test_locust_reports_smtp_and_pop3_requests_from_a_real_node(locust_results: Path, mail_node: Node) -> None:
    stats = _stats(locust_results / "locust_stats.csv")
    send = stats[("SMTP", "send")]
    assert int(send["Request Count"]) > 0 and int(send["Failure Count"]) == 0
    assert 2_000 <= float(send["Average Content Size"]) <= 20_000  # sizes drawn from the range
    login = stats[("POP3", "login")]
    assert int(login["Request Count"]) > 0 and int(login["Failure Count"]) == 0
    assert ("IMAP", "login") not in stats  # no CASSMAIL_IMAP: that user class does not run
    assert float(stats[("", "Aggregated")]["50%"]) > 0
    # The domain and users the locustfile created in the store are gone after the test stopped.
    assert not [d for d in _domains(mail_node) if d.startswith("locust-")]


def test_the_report_has_tables_and_plots(postal_results: Path, locust_results: Path, tmp_path: Path) -> None:
    done = subprocess.run([PY, str(LOADTEST / "report.py"), str(postal_results), str(locust_results),
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    text = (tmp_path / "report.md").read_text()
    assert "| postal | cassmail" in text and "| rabid  | cassmail" in text
    assert "| SMTP | send" in text and "p99 ms" in text
    for name in ("throughput.png", "cpu.png", "latency.png", "locust.png"):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000, name
        assert f"]({name})" in text


# --------------------------------------------------------------------------- the baseline


@pytest.fixture
def open_tmp():
    """A temporary directory the postfix, dovecot and nobody users can enter (pytest's are 0700)."""
    path = Path(tempfile.mkdtemp(prefix="cassmail-baseline-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_locust_imap_users_log_in_select_fetch_and_idle_on_cassmail(mail_node: Node, tmp_path: Path) -> None:
    env = {**os.environ, "CASSMAIL_SMTP": f"127.0.0.1:{mail_node.port('smtp')}",
           "CASSMAIL_IMAP": f"127.0.0.1:{mail_node.port('imap')}", "CASSMAIL_CONFIG": str(mail_node.config),
           "CASSMAIL_LOADTEST_NUSERS": "10", "CASSMAIL_LOADTEST_PROFILE": "mixed", "CASSMAIL_LOADTEST_IDLE": "0.5"}
    env.pop("CASSMAIL_POP3", None)
    cmd = [LOCUST, "-f", str(LOADTEST / "locustfile.py"), "--headless", "-u", "4", "-r", "4", "-t", "5s",
           "--csv", str(tmp_path / "locust"), "--only-summary"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    stats = _stats(tmp_path / "locust_stats.csv")
    for name in ("login", "select", "search", "idle", "logout"):
        row = stats[("IMAP", name)]
        assert int(row["Request Count"]) > 0 and int(row["Failure Count"]) == 0, (name, row)
    assert float(stats[("IMAP", "idle")]["50%"]) >= 400  # it really waited in IDLE
    assert int(stats[("SMTP", "send")]["Failure Count"]) == 0


def test_locust_imap_users_log_in_select_fetch_and_idle_on_dovecot(open_tmp: Path) -> None:
    _tools(postal=False, postfix=True, dovecot=True)
    from baseline import Dovecot, Postfix

    tmp_path = open_tmp
    users = [f"u{i}@baseline.example" for i in range(10)]
    postfix = Postfix(tmp_path, "baseline.example", users)
    dovecot = Dovecot(tmp_path, postfix.mail, users, "pw")
    try:
        postfix.configure()
        postfix.start()
        dovecot.configure()
        dovecot.start()
        (tmp_path / "users.txt").write_text("".join(f"{u} pw\n" for u in users))
        env = {**os.environ, "CASSMAIL_SMTP": f"127.0.0.1:{postfix.port}",
               "CASSMAIL_IMAP": f"127.0.0.1:{dovecot.imap_port}", "CASSMAIL_LOADTEST_USERS": str(tmp_path / "users.txt"),
               "CASSMAIL_LOADTEST_PROFILE": "mixed", "CASSMAIL_LOADTEST_IDLE": "0.5"}
        env.pop("CASSMAIL_POP3", None)
        cmd = [LOCUST, "-f", str(LOADTEST / "locustfile.py"), "--headless", "-u", "4", "-r", "4", "-t", "5s",
               "--csv", str(tmp_path / "locust"), "--only-summary"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    finally:
        dovecot.stop()
        postfix.stop()
    stats = _stats(tmp_path / "locust_stats.csv")
    for name in ("login", "select", "search", "idle", "logout"):
        row = stats[("IMAP", name)]
        assert int(row["Request Count"]) > 0 and int(row["Failure Count"]) == 0, name
    assert float(stats[("IMAP", "idle")]["50%"]) >= 400  # it really waited in IDLE
    assert int(stats[("SMTP", "send")]["Failure Count"]) == 0
    assert ("POP3", "login") not in stats


def test_compare_runs_the_baseline_and_cassmail_and_prints_ratios(tmp_path: Path) -> None:
    _tools(postal=True, postfix=True, dovecot=True)
    out = tmp_path / "compare"
    cmd = [PY, str(LOADTEST / "compare.py"), "--targets", "baseline,mbox", "--sizes", "2K-10K", "--seconds", "3",
           "--interval", "1", "--average-last", "2", "--users", "10", "--threads", "2", "--processes", "2",
           "--dovecot-hash", "BLF-CRYPT:5", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    assert "| postal | Postfix+Dovecot" in done.stdout and "| postal | cassmail (mbox)" in done.stdout
    # Dovecot checks the POP3 logins against a slow hash too, and rabid's sessions log in.
    assert re.search(r"POP3 logins: cassmail's users hold scrypt hashes \(N=2\^10, one check [\d.]+ ms here\), "
                     r"Dovecot's \{BLF-CRYPT\} cost 5 \([\d.]+ ms\)", done.stdout), done.stdout[:3000]
    [rabid] = [line.split("|") for line in done.stdout.splitlines() if line.startswith("| rabid  | Postfix+Dovecot")]
    assert int(rabid[7].replace(",", "")) > 0 and int(rabid[8]) == 0, rabid
    assert "Postfix+Dovecot msgs/min" in done.stdout  # the ratio table
    text = (out / "report.md").read_text()
    assert "Compared with Postfix+Dovecot" in text and (out / "throughput.png").exists()
    assert "Dovecot: stopped" in done.stdout and "Postfix: stopped" in done.stdout


def test_imap_mix_answers_every_command_on_dovecot_and_cassmail_and_prints_the_ratios(
        tmp_path: Path, cassandra_endpoint: tuple[str, int]) -> None:
    """Two rounds, the targets taking turns (the second in reverse order), added up per target."""
    _tools(postal=False, dovecot=True)
    host, port = cassandra_endpoint
    figures = tmp_path / "mix.json"
    # Every type in a deck of 13, so two short sessions draw each one several times.
    weights = ",".join(f"{k}={2 if k == 'append' else 1}" for k in (
        "fetch-flags", "fetch-headers", "fetch-body", "store", "search-unseen", "search-subject", "noop", "append",
        "copy", "expunge", "status", "idle"))
    cmd = [PY, str(LOADTEST / "bench_imap_mix.py"), "--set", f"store.cassandra.contact_points={host}",
           "--set", f"store.cassandra.port={port}", "--clients", "2", "--seconds", "1", "--warmup", "0.5",
           "--rounds", "2", "--login-seconds", "1", "--messages", "20", "--sizes", "2K-20K", "--weights", weights,
           "--dovecot-hash", "BLF-CRYPT:5", "--quiet-max", "0", "--json", str(figures)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    data = json.loads(figures.read_text())
    assert list(data["mix"]) == ["dovecot", "mbox", "cassandra"]
    assert [[r["target"] for r in turn] for turn in data["rounds"]] == [
        ["dovecot", "mbox", "cassandra"], ["cassandra", "mbox", "dovecot"]]
    for target, mix in data["mix"].items():
        rounds = [r for turn in data["rounds"] for r in turn if r["target"] == target]
        assert sum(r["commands"] for r in rounds) == sum(t["count"] for t in mix["types"].values()) > 0
        assert mix["seconds"] == pytest.approx(sum(r["seconds"] for r in rounds)), (target, mix["seconds"], rounds)
        for kind, tally in mix["types"].items():
            assert tally["count"] > 0 and tally["errors"] == 0, (target, kind, tally)
        assert mix["cpu"]["server"] > 0 and mix["reconnects"] == 0, (target, mix)
    # The same mailboxes, byte for byte, on every target: 2 x 20 messages.
    assert len({(m["messages"], m["bytes"]) for m in data["mix"].values()}) == 1
    assert data["mix"]["mbox"]["messages"] == 40
    schemes = [(r["target"], r["scheme"].split()[0]) for r in data["logins"]]
    assert schemes == [("dovecot", "{PLAIN}"), ("dovecot", "{BLF-CRYPT}"), ("mbox", "scrypt"), ("mbox", "scrypt"),
                       ("cassandra", "scrypt"), ("cassandra", "scrypt")]
    assert all(r["sessions"] > 0 and r["errors"] == 0 for r in data["logins"]), data["logins"]
    out = done.stdout
    assert "| **all commands**" in out and "cassmail Cassandra / Dovecot" in out  # the command table, its ratios
    assert "Dovecot mean / p50 / p99 ms" in out and "server+Cassandra CPU ms/command" in out
    assert "| round | order" in out and "|     2 | cassmail Cassandra, cassmail mbox, Dovecot |" in out
    assert "| Dovecot            | {BLF-CRYPT} cost 5" in out and "sessions/s" in out  # the logins, apart
    assert "Dovecot: stopped" in out and "dropped keyspace bench_imap_mix_" in out


def test_the_inbound_benchmark_counts_what_each_configuration_stored(tmp_path: Path) -> None:
    """bench_inbound.py's smallest run: cassmail with the checks off and with authentication
    and rspamd, each with every accepted message stored."""
    cmd = [PY, str(LOADTEST / "bench_inbound.py"), "--targets", "off,rspamd", "--seconds", "3", "--warmup", "1",
           "--connections", "2", "--users", "5", "--pool", "20", "--workers", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in done.stdout.splitlines() if line.startswith("| cassmail")}
    assert set(rows) == {"cassmail off", "cassmail auth+rspamd"}, done.stdout
    for name, cells in rows.items():
        stored, accepted = (int(x.replace(",", "")) for x in cells[4].split(" / "))
        assert stored == accepted > 0, (name, cells)
        assert cells[3] == "0", (name, cells)  # nothing refused
    assert "the rate of cassmail off" in done.stdout


def test_the_idle_benchmark_pushes_every_change_to_every_idle_session(tmp_path: Path) -> None:
    """bench_idle.py's smallest run on mbox: 20 idle sessions on node A over 10 users, changes
    made on node B reach each session of their user, and node A's costs are measured."""
    figures = tmp_path / "idle.json"
    cmd = [PY, str(LOADTEST / "bench_idle.py"), "--targets", "mbox", "--users", "10", "--sessions", "20",
           "--messages", "1", "--workers", "1", "--base-seconds", "0", "--settle", "0", "--idle-seconds", "0.5",
           "--changes", "2", "--rate", "8", "--flow-seconds", "0.5", "--json", str(figures)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-3000:]
    [level] = json.loads(figures.read_text())["targets"]["mbox"]["levels"]
    assert level["opened"] == 20 and not level["open_errors"] and level["dropped"] == 0
    assert level["idle_noise"] == 0  # nothing changed: no session heard anything
    assert level["idle"]["cores"] is not None and level["idle"]["rss"] > 0
    for kind in ("delivery", "flags"):
        lat = level["latency"][kind]
        assert (lat["changes"], lat["informed"], lat["missed"]) == (1, 2, 0), lat  # a user has 2 sessions
    flow = level["flow_latency"]
    assert flow["changes"] >= 3 and flow["informed"] == 2 * flow["changes"] and flow["missed"] == 0, flow
    assert "| mbox: idle" in done.stdout and "sessions informed" in done.stdout


def test_a_process_age_is_the_time_since_it_started_and_none_once_it_is_gone() -> None:
    """What tells the benchmarks that the Cassandra node has only just started (its label)."""
    import time

    child = subprocess.Popen(["sleep", "30"])
    try:
        time.sleep(1.2)
        age = pid_age(child.pid)
        assert age is not None and 1.1 <= age < 10
    finally:
        child.kill()
        child.wait()
    assert pid_age(child.pid) is None
