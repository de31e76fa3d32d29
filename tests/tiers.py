"""The suite's two tiers and its summary (issue 58), a plugin tests/conftest.py loads.

`make test` runs every test; `make test-fast` (`pytest -m "not slow"`) leaves out the tests marked `slow`: those that
run the script end to end, start other processes or build heavy fixtures (more than about 3 s on two cores, with
their module's shared runs), and keeps the unit and stage tests and one end-to-end run (test_e2e.py's static_prompt,
the README's command under `accelerate launch`): about 3 minutes. Tests mark themselves (`@pytest.mark.slow`, or a
module's `pytestmark`); the tests of files another change owns are marked here (NOT_FAST).

At the end of a session (CI's log included) a summary prints the wall time, how busy the workers were and the five
slowest tests, setup and teardown included, so that a change that adds minutes shows where."""

import time

import pytest

# file::test prefixes marked slow here rather than in their files
NOT_FAST = ("test_copy_runs.py::test_each_single_option_copy_trains_its_smallest_run",
            "test_copies.py::test_a_copy_holds_its_options", "test_copies.py::test_a_copy_neither_overwrites",
            "test_copies.py::test_an_edited_copy", "test_parts.py::test_a_default_run_executes_nothing_of_part_3",
            "test_parts.py::test_without_any_option_the_default_run_trains", "test_parts.py::test_each_option_deletes",
            "test_plan.py::",  # its plans share a module fixture of about 10 s
            "test_copies.py::",  # every copy written once a module: about 2 CPU-minutes
            "test_console.py::test_a_default_run_prints", "test_console.py::test_make_demo_prints",
            "test_console.py::test_no_run_asks_the_hub", "test_console.py::test_a_full_disk",
            "test_console.py::test_an_output_folder_removed",  # fresh interpreters or whole runs
            "test_int8.py::", "test_transformer_file.py::",  # runs of the script, 8-bit loads
            "test_lookup.py::test_the_code_identity_covers")  # a script edited at each covered place
STARTED = {}


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: an end-to-end or otherwise slow test, left out by `make test-fast`")


def pytest_sessionstart(session):
    STARTED["wall"] = time.time()


@pytest.hookimpl(tryfirst=True)  # before -m reads the markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        if f"{item.path.name}::{item.name}".startswith(NOT_FAST):
            item.add_marker(pytest.mark.slow)


def slowest(reports, count=5):
    """-> [(seconds, test)] of the `count` slowest tests, each test's setup, call and teardown together."""
    seconds = {}
    for report in reports:
        test = report.nodeid.split("@")[0]  # xdist's group suffix
        seconds[test] = seconds.get(test, 0.0) + report.duration
    return sorted(((s, test) for test, s in seconds.items()), reverse=True)[:count]


def pytest_terminal_summary(terminalreporter, config):
    # "": pytest files a passed setup or teardown (a module's shared run) under no outcome
    reports = [r for key in ("passed", "failed", "error", "skipped", "") for r in terminalreporter.stats.get(key, [])
               if hasattr(r, "duration") and getattr(r, "when", None)]
    if not reports or "wall" not in STARTED:
        return
    wall = time.time() - STARTED["wall"]
    workers = getattr(config.option, "numprocesses", None) or 1
    busy = sum(r.duration for r in reports) / (wall * workers)
    write = terminalreporter.write_line
    write(f"suite: {wall:.0f} s of wall time ({wall // 60:.0f}:{wall % 60:02.0f}) on {workers} worker(s), "
          f"{busy:.0%} busy; the five slowest tests (setup, call and teardown):")
    for seconds, test in slowest(reports):
        write(f"{seconds:8.1f} s  {test}")
