"""Every `make NAME` the project's words tell a user to run is a target of the Makefile (requirements.txt once named
a venv target, which never existed)."""

import re

from tests.conftest import ROOT


def test_every_make_command_named_in_the_project_is_a_makefile_target():
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), flags=re.M))
    files = [*ROOT.glob("*.md"), *ROOT.glob("*.txt"), *ROOT.glob("*.py"), *(ROOT / "docs").glob("*.md"),
             *(ROOT / "tests").glob("*.py"), *(ROOT / "tests").glob("*.txt"), *(ROOT / "benchmarks").glob("*.*"),
             *(ROOT / "launch").glob("*.py")]
    named = {(path.name, name) for path in files for name in re.findall(r"`make ([a-z][\w-]*)",
                                                                           path.read_text(encoding="utf-8"))}
    assert {name for _, name in named} >= {"install", "test"}  # the scan reads the README's words
    assert [(path, name) for path, name in sorted(named) if name not in targets] == []


def test_the_suites_summary_counts_setup_call_and_teardown_of_each_test(monkeypatch):
    """tests/tiers.py's closing lines: a module's shared run is a passed setup, which pytest files under no outcome
    (""); left out, the slowest list and the busy share missed most of the suite's time."""
    from types import SimpleNamespace

    from tests import tiers

    def report(nodeid, when, duration):
        return SimpleNamespace(nodeid=nodeid, when=when, duration=duration)

    stats = {"": [report("t.py::a@group", "setup", 30.0), report("t.py::a@group", "teardown", 1.0)],
             "passed": [report("t.py::a@group", "call", 2.0), report("t.py::b", "call", 5.0)]}
    lines = []
    reporter = SimpleNamespace(stats=stats, write_line=lines.append)
    monkeypatch.setitem(tiers.STARTED, "wall", tiers.time.time() - 20.0)  # the session's own start stays
    tiers.pytest_terminal_summary(reporter, SimpleNamespace(option=SimpleNamespace(numprocesses=2)))
    assert lines[0].startswith("suite: 20 s of wall time (0:20) on 2 worker(s), 95% busy")
    assert [line.split() for line in lines[1:]] == [["33.0", "s", "t.py::a"], ["5.0", "s", "t.py::b"]]
