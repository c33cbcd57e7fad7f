"""VersionTable (adapters/versions.py): which version serves a name, replacement, retire and drop."""

from dataclasses import dataclass

import pytest

from adapters.versions import FAILED, LOADING, READY, VersionTable


@dataclass
class Request:
    name: str
    path: str
    revision: str | None = None

    @property
    def source(self):
        return self.path, self.revision


def _table():
    dropped = []
    return VersionTable("LoRA", on_drop=dropped.append), dropped


def _ready(table, name, path):
    version, created = table.version_for(Request(name, path))
    assert created
    version.state = READY
    table.take_over(version)
    return version


def test_the_same_source_finds_the_same_version_and_a_new_source_a_new_one():
    table, _ = _table()
    first, created = table.version_for(Request("a", "/v1"))
    again, created_again = table.version_for(Request("a", "/v1"))
    other, _ = table.version_for(Request("b", "/v1"))
    assert created and not created_again and again is first and first.state == LOADING
    assert other is not first and other.ref.version != first.ref.version and table.names() == ["a", "b"]


def test_a_replacement_takes_over_only_once_ready_and_inherits_the_pin():
    table, dropped = _table()
    old = _ready(table, "a", "/v1")
    old.pinned = True
    new, _ = table.version_for(Request("a", "/v2"))
    assert table.serving("a") is old and table.serving_versions() == {old}  # old serves while new loads
    assert table.version_for(Request("a", "/v1"))[0] is old  # the old source is still known
    new.state = READY
    table.take_over(new)
    assert table.serving("a") is new and new.pinned and not old.pinned and old.retired
    assert dropped == [old] and table.get(old.ref) is None


def test_a_held_retired_version_is_dropped_at_its_last_release():
    table, dropped = _table()
    old = _ready(table, "a", "/v1")
    old.holders = 2
    table.retire_name("a")
    assert table.serving("a") is None and table.get(old.ref) is old and dropped == []
    table.release(old.ref)
    assert dropped == []
    table.release(old.ref)
    assert dropped == [old] and table.get(old.ref) is None
    with pytest.raises(ValueError, match="without a matching acquire"):
        table.release(old.ref)


def test_a_failed_replacement_leaves_the_old_version_serving():
    table, dropped = _table()
    old = _ready(table, "a", "/v1")
    new, _ = table.version_for(Request("a", "/v2"))
    new.pinned, new.state = True, FAILED
    table.fall_back(new)
    assert table.serving("a") is old and not new.pinned and dropped == [new]
    assert table.version_for(Request("a", "/v1"))[0] is old


def test_a_held_failed_version_stays_until_released():
    table, dropped = _table()
    version, _ = table.version_for(Request("a", "/bad"))
    version.holders, version.state = 1, FAILED
    table.fall_back(version)
    assert table.serving("a") is version and dropped == []  # its requests all see the failure
    table.release(version.ref)
    assert dropped == [version] and table.serving("a") is None


def test_a_newer_source_retires_one_still_loading_and_takes_its_pin():
    table, dropped = _table()
    loading, _ = table.version_for(Request("a", "/v1"))
    loading.pinned = True
    newer, _ = table.version_for(Request("a", "/v2"))
    assert dropped == [loading] and loading.retired and newer.pinned and table.serving("a") is newer


def test_retire_name_reports_the_pin_and_forgets_every_version():
    table, dropped = _table()
    old = _ready(table, "a", "/v1")
    old.pinned = True
    new, _ = table.version_for(Request("a", "/v2"))
    assert table.retire_name("a") is True and set(dropped) == {old, new} and table.names() == []
    assert table.num_pinned() == 0 and table.retire_name("a") is False


def test_num_pinned_counts_live_versions():
    table, _ = _table()
    a, b = _ready(table, "a", "/a"), _ready(table, "b", "/b")
    a.pinned = b.pinned = True
    assert table.num_pinned() == 2
    table.retire(a)
    assert table.num_pinned() == 1 and list(table) == [b]
