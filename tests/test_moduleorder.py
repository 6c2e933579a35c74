"""The order test files go to the xdist workers (tests/support/moduleorder.py):
longest first by the last full run's seconds, estimated for a file without a
record, and the record merged with a run's reports."""

from __future__ import annotations

from dataclasses import dataclass

from support.moduleorder import longest_first, merged


@dataclass
class Item:
    nodeid: str


def items(*nodeids: str) -> list[Item]:
    return [Item(n) for n in nodeids]


def ids(found) -> list[str]:
    return [i.nodeid for i in found]


def test_files_go_longest_first_and_keep_their_tests_order():
    got = longest_first(items("a.py::1", "a.py::2", "b.py::1", "c.py::1", "c.py::2"),
                        {"a.py": 3.0, "b.py": 50.0, "c.py": 10.0})
    assert ids(got) == ["b.py::1", "c.py::1", "c.py::2", "a.py::1", "a.py::2"]


def test_a_file_without_a_record_counts_the_average_test():
    # 2 s a test on average (a: 2 tests in 4 s; b: 1 in 2 s): new.py's 3 tests are 6 s
    got = longest_first(items("a.py::1", "a.py::2", "b.py::1", "n.py::1", "n.py::2", "n.py::3"),
                        {"a.py": 4.0, "b.py": 2.0})
    assert ids(got)[:3] == ["n.py::1", "n.py::2", "n.py::3"]


def test_without_a_record_the_most_tests_go_first():
    got = longest_first(items("a.py::1", "b.py::1", "b.py::2", "c.py::1"), {})
    assert ids(got) == ["b.py::1", "b.py::2", "a.py::1", "c.py::1"]


def test_a_run_replaces_the_record_of_the_files_it_ran_only():
    old = {"a.py": 5.0, "b.py": 7.0}
    new = merged(old, [("a.py::1", 0.5), ("a.py::1", 1.0), ("a.py::2", 0.25), ("c.py::1", 2.0)])
    assert new == {"a.py": 1.75, "b.py": 7.0, "c.py": 2.0}
