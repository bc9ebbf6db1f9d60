"""`start_module_runs` (tests/trainer/main_ppo_runs.py), the module fixture helper that starts a test
file's end-to-end runs side by side: run through pytest itself (`pytester`), on runs that are plain
functions, so what it promises is checked without starting main_ppo: runs overlap, a run can wait for
an earlier one, a failed run fails only the tests that read it, and deselected tests start nothing."""

from __future__ import annotations

pytest_plugins = ["pytester"]

MODULE = """
import time
from pathlib import Path

import pytest

from tests.trainer.main_ppo_runs import start_module_runs

LOG = Path(__file__).with_name("log.txt")


def _timed(name, seconds):
    def run(tmp, cluster, started):
        with LOG.open("a") as log:
            log.write(f"start {name} {time.monotonic()}\\n")
        time.sleep(seconds)
        with LOG.open("a") as log:
            log.write(f"end {name} {time.monotonic()}\\n")
        return tmp

    return run


def _after_a(tmp, cluster, started):
    return ("after", started["a"].result().name)


def _broken(tmp, cluster, started):
    raise AssertionError("the run exited 1")


RUNS = {"a": _timed("a", 0.5), "b": _timed("b", 0.5), "after_a": _after_a, "broken": _broken, "c": _timed("c", 0)}
TEST_RUNS = {
    "test_a_and_b": ("a", "b"),
    "test_after_a": ("a", "after_a"),
    "test_broken": ("broken",),
    "test_c": ("c",),
}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    with start_module_runs(request, RUNS, TEST_RUNS, tmp_path_factory, cluster=None, max_concurrent=2) as started:
        yield started


def test_a_and_b(runs):
    assert runs["a"].result().name.startswith("a") and runs["b"].result().name.startswith("b")


def test_after_a(runs):
    assert runs["after_a"].result() == ("after", runs["a"].result().name)


def test_broken(runs):
    runs["broken"].result()


def test_c(runs):
    runs["c"].result()
"""


def _events(pytester) -> dict[str, float]:
    lines = (pytester.path / "log.txt").read_text().split("\n")
    return {" ".join(line.split()[:2]): float(line.split()[2]) for line in lines if line}


def test_runs_overlap_a_run_waits_for_another_and_a_failure_stays_with_its_test(pytester):
    pytester.makepyfile(test_module_runs=MODULE)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q", "-k", "not test_c")
    result.assert_outcomes(passed=2, failed=1, deselected=1)
    result.stdout.fnmatch_lines(["*test_broken*the run exited 1*"])
    events = _events(pytester)
    assert events["start b"] < events["end a"]  # two at a time: b started while a still ran
    assert "start c" not in events  # its only test was deselected


def test_a_test_list_naming_an_unknown_test_or_run_is_refused(pytester):
    pytester.makepyfile(test_module_runs=MODULE.replace('"test_c": ("c",)', '"test_d": ("d",)'))
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-q", "-k", "test_a_and_b")
    result.assert_outcomes(errors=1, deselected=3)
    assert "test_runs names tests that test_module_runs does not define: ['test_d']" in result.stdout.str()
