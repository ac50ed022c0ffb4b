"""The documentation cannot drift: the configuration reference is what the settings' own
definitions say, every setting says what it is for, every setting a document or the example
file names exists, every relative link in README.md and docs/ leads somewhere, and every
capability keyword the protocols advertise is in the support matrix."""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable
from pathlib import Path

from cassmail import config

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SECTIONS = {name for name, _ in config.settings_sections()}
TOP_SECTIONS = {f.name for f in dataclasses.fields(config.Settings)}


def setting_names() -> set[str]:
    """Every `section.key` (and every section) the settings define."""
    names = set(SECTIONS)
    for name, section in config.settings_sections():
        names |= {f"{name}.{f.name}" for f in dataclasses.fields(section)}
    return names


def test_the_configuration_reference_is_what_the_generator_writes_now() -> None:
    path = ROOT / config.REFERENCE_PATH
    assert path.exists(), f"{config.REFERENCE_PATH} is missing: run `{config.REFERENCE_COMMAND}`"
    assert path.read_text() == config.reference(), (
        f"{config.REFERENCE_PATH} is out of date with cassmail/config.py: run `{config.REFERENCE_COMMAND}` "
        "(python -m cassmail.config reference --write) and commit the result"
    )


def test_every_setting_has_a_comment_saying_what_it_is_for() -> None:
    assert config.undocumented_settings() == [], "give each of these fields a `#:` comment in cassmail/config.py"


def test_the_reference_lists_every_setting_and_nothing_else() -> None:
    text = (ROOT / config.REFERENCE_PATH).read_text()
    listed: set[str] = set()
    sections: list[str] = []
    for line in text.splitlines():
        if line.startswith("## "):
            sections = re.findall(r"`\[([\w.]+)\]`", line)
        elif match := re.match(r"\| `(\w+)` \|", line):
            listed |= {f"{section}.{match.group(1)}" for section in sections}
    keys = {name for name in setting_names() if name not in SECTIONS}
    assert listed == keys


def _not_a_setting(mention: str) -> bool:
    """A file name (`delivery.py`, `inbound.md`) or a code name (`auth.Logins`) that starts like a
    section: settings are lower-case words and no file name ends one."""
    last = mention.rsplit(".", 1)[1]
    return last in ("py", "md", "cql", "toml", "json", "txt") or not last.islower()


def test_the_example_config_names_only_settings_that_exist() -> None:
    """Keys set or commented out in cassmail.example.toml, its [section] headers (also commented
    ones) and every dotted setting its comments mention are real settings."""
    known, unknown = setting_names(), []
    section = ""
    for number, line in enumerate(config.example_path().read_text().splitlines(), 1):
        if match := re.match(r"\s*#?\s*\[([\w.]+)\]\s*$", line):
            section = match.group(1)
            if section not in SECTIONS:
                unknown.append(f"line {number}: [{section}]")
        elif match := re.match(r"\s*#?\s*(\w+)\s*=", line):
            if f"{section}.{match.group(1)}" not in known:
                unknown.append(f"line {number}: {section}.{match.group(1)}")
        if line.lstrip().startswith("#"):
            prose = re.sub(r'"[^"]*"', "", line)  # host names in quoted examples are not settings
            for mention in re.findall(r"(?<![\w./])((?:\w+\.)+\w+)", prose):
                if mention.split(".")[0] in TOP_SECTIONS and mention not in known and not _not_a_setting(mention):
                    unknown.append(f"line {number}: {mention}")
    assert unknown == []


def test_every_setting_the_documents_name_exists() -> None:
    """A `section.key` in backticks in README.md or docs/*.md is a real setting (or section)."""
    known, unknown = setting_names(), []
    for path in DOCUMENTS:
        for code in re.findall(r"`([^`\n]+)`", path.read_text()):
            for mention in re.findall(r"(?<![\w.\-/*])((?:\w+\.)+\w+)(?=$|[=\s,)\]])", code):
                if mention.split(".")[0] in TOP_SECTIONS and mention not in known and not _not_a_setting(mention):
                    unknown.append(f"{path.relative_to(ROOT)}: {mention}")
    assert unknown == []


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for a Markdown file's headings."""
    out, fenced = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (match := re.match(r"#{1,6}\s+(.*)", line)):
            slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
            out.add(slug)
    return out


def test_every_relative_link_in_the_readme_and_docs_resolves() -> None:
    broken = []
    for path in DOCUMENTS:
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked here
            file_part, _, fragment = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []


def advertised(function: Callable[..., object], pattern: str) -> set[str]:
    """The keywords a capability function puts in its answer, read from its source (the words of
    its byte or string literals), so a keyword added to the code is a keyword to document."""
    found = set()
    for literal in re.findall(pattern, inspect.getsource(function)):
        found |= {word.removesuffix("=%d") for word in literal.split() if re.fullmatch(r"[A-Z][A-Za-z0-9+=\-%]*", word)}
    return found


def test_every_advertised_capability_is_in_the_protocol_matrix() -> None:
    from cassmail.imap.session import Session
    from cassmail.pop3.server import Pop3Session
    from cassmail.smtp.handler import DeliveryHandler

    matrix = (ROOT / "docs" / "protocols.md").read_text()
    keywords = (advertised(Session.capabilities, r'b"([^"]+)"')
                | advertised(Pop3Session.listCapabilities, r'b"([^"]+)"')
                | advertised(DeliveryHandler.handle_EHLO, r'"250-([^"]+)"'))
    assert {"IMAP4rev1", "COMPRESS=DEFLATE", "APPENDLIMIT", "UIDL", "STLS", "ENHANCEDSTATUSCODES"} <= keywords
    assert sorted(k for k in keywords if k not in matrix) == [], "add these to docs/protocols.md"
