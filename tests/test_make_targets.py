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
