"""WheelFS cue paths: built and read by pure functions, checked against the paper's rules."""

from __future__ import annotations

import pytest

from cassmail import config
from cassmail.config import ConfigError
from cassmail.store.wheelfs_cues import Cue, CueError, build, parse_component, resolve, store_cues


def test_cues_are_components_in_the_order_given() -> None:
    cues = [Cue("EventualConsistency"), Cue("Site", "X"), Cue("KeepTogether"), Cue("RepSites", "2")]
    assert build(cues) == [".EventualConsistency", ".Site=X", ".KeepTogether", ".RepSites=2"]
    assert build(reversed(cues)) == [".RepSites=2", ".KeepTogether", ".Site=X", ".EventualConsistency"]


def test_a_later_cue_overrides_an_earlier_one() -> None:
    assert build([Cue("RepLevel", "2"), Cue("Site", "A"), Cue("RepLevel", "4")]) == [".RepLevel=4", ".Site=A"]
    path = ["mail", ".RepLevel=2", ".Site=A", "user", ".RepLevel=3", "INBOX"]
    resolved = resolve(path, creating=True)
    assert resolved.plain == ("mail", "user", "INBOX")
    assert resolved.cues["RepLevel"] == Cue("RepLevel", "3") and resolved.cues["Site"] == Cue("Site", "A")


def test_persistent_cues_count_only_when_the_object_is_created() -> None:
    path = [".EventualConsistency", ".Site=X", ".KeepTogether", ".RepLevel=2", ".SyncLevel=1", ".MaxTime=500", "box"]
    created = resolve(path, creating=True).cues
    assert set(created) == {"EventualConsistency", "Site", "KeepTogether", "RepLevel", "SyncLevel", "MaxTime"}
    accessed = resolve(path, creating=False).cues
    # placement and durability are fixed at creation; consistency and timing are per operation
    assert set(accessed) == {"EventualConsistency", "SyncLevel", "MaxTime"}
    assert Cue("EventualConsistency").persistent and Cue("EventualConsistency").transient
    assert Cue("RepLevel", "3").persistent and not Cue("RepLevel", "3").transient
    assert Cue("WholeFile").transient and not Cue("Hotspot").persistent


def test_rep_level_is_at_most_four_and_values_are_checked() -> None:
    assert Cue("RepLevel", "4").component() == ".RepLevel=4"
    for bad in (("RepLevel", "5"), ("RepLevel", "0"), ("RepSites", "two"), ("Site", None), ("KeepTogether", "1"),
                ("Site", "a/b"), ("Bogus", None)):
        with pytest.raises(CueError):
            Cue(*bad)
    with pytest.raises(ConfigError, match="store.wheelfs.rep_level: must be 1..4"):
        config.load(env={}, overrides=["store.wheelfs.rep_level=5"])
    with pytest.raises(ConfigError, match="store.wheelfs.sync_level"):
        config.load(env={}, overrides=["store.wheelfs.sync_level=4", "store.wheelfs.rep_level=3"])
    with pytest.raises(ConfigError, match="store.wheelfs.home_site"):
        config.load(env={}, overrides=["store.wheelfs.home_site=a/b"])


def test_ordinary_names_are_not_cues() -> None:
    assert parse_component("INBOX") is None
    assert parse_component(".hidden") is None
    assert parse_component("%2ERepLevel=3") is None  # how the store spells a mailbox named ".RepLevel=3"
    assert parse_component(".MaxTime=250") == Cue("MaxTime", "250")


def test_the_strong_tree_never_has_eventual_consistency_sync_level_or_max_time() -> None:
    settings = dict(home_site="X", keep_together=True, rep_sites=2, rep_level=3, sync_level=2, max_time=300)
    strong = build(store_cues(eventual=False, **settings))
    mail = build(store_cues(eventual=True, **settings))
    assert strong == [".Site=X", ".KeepTogether", ".RepSites=2", ".RepLevel=3"]
    assert mail == [".EventualConsistency", ".MaxTime=300", ".Site=X", ".KeepTogether", ".RepSites=2", ".RepLevel=3",
                    ".SyncLevel=2"]
    assert build(store_cues(eventual=True, eventual_consistency=False, keep_together=False)) == [".RepLevel=3"]


def test_the_shipped_example_config_documents_the_wheelfs_defaults() -> None:
    assert config.load(config.example_path(), env={}).store.wheelfs == config.load(env={}).store.wheelfs
