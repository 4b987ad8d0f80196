"""tests/progress_plugin.py: a line per test file as it finishes (counts, seconds, tests done, time elapsed), with
pytest's own reports, summary and exit code left as they are. Each case runs pytest on two small files of its own
in a separate interpreter, with a conftest that registers the plugin as tests/conftest.py does."""

import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFTEST = """
from tests.progress_plugin import register


def pytest_configure(config):
    register(config)
"""
FIRST = """
def test_a():
    pass


def test_b():
    pass
"""
SECOND = """
import pytest


def test_passes():
    pass


def test_fails():
    assert 1 + 1 == 3


@pytest.mark.skip(reason="not today")
def test_is_skipped():
    pass
"""
# the line of a finished file: name, counts, seconds, tests done out of all, share, time elapsed
LINE = r"{file}: {counts} in \d+\.\d s{stopped}  \[{done}/5 tests, {share}%; \d+:\d\d elapsed\]"


@pytest.fixture
def suite(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_first.py").write_text(FIRST)
    (tmp_path / "test_second.py").write_text(SECOND)

    def run(*args):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, *filter(None, [os.environ.get("PYTHONPATH")])]))
        env.pop("PYTEST_ADDOPTS", None)
        done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--color=no", *args],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        return done.returncode, done.stdout.splitlines()

    return run


def line(file, counts, done, share, stopped=""):
    return re.compile(LINE.format(file=re.escape(file), counts=counts, done=done, share=share, stopped=stopped))


def matching(lines, pattern):
    return [text for text in lines if pattern.fullmatch(text)]


@pytest.mark.parametrize("verbosity", [["-q"], [], ["-v"]], ids=["quiet", "default", "verbose"])
def test_every_file_ends_with_a_line_of_its_counts_seconds_and_the_time_elapsed(suite, verbosity):
    code, lines = suite(*verbosity)
    first = line("test_first.py", "2 passed", 2, 40)
    second = line("test_second.py", "1 failed, 1 passed, 1 skipped", 5, 100)
    assert len(matching(lines, first)) == len(matching(lines, second)) == 1, "\n".join(lines)
    start, end = lines.index(matching(lines, first)[0]), lines.index(matching(lines, second)[0])
    assert start < end and "" not in lines[start:end], "\n".join(lines)  # in order, no empty line between
    # pytest's own report of the failure, its summary and its exit code are all there
    assert code == 1
    assert any(text.startswith("FAILED test_second.py::test_fails") for text in lines), "\n".join(lines)
    assert "assert (1 + 1) == 3" in "\n".join(lines)
    assert re.search(r"1 failed, 3 passed, 1 skipped in ", lines[-1]), lines[-1]


def test_a_run_stopped_by_the_first_failure_still_reports_the_file_it_stopped_in(suite):
    code, lines = suite("-q", "-x")
    stopped = line("test_second.py", "1 failed, 1 passed", 4, 80, stopped=r" \(stopped: 1 of its tests did not run\)")
    assert code == 1 and len(matching(lines, stopped)) == 1, "\n".join(lines)
    assert len(matching(lines, line("test_first.py", "2 passed", 2, 40))) == 1


def test_the_lines_can_be_turned_off(suite):
    code, lines = suite("-q", "-p", "no:file-progress")
    assert code == 1 and not [text for text in lines if "elapsed]" in text], "\n".join(lines)


@pytest.mark.parametrize("verbosity", [["-q"], []], ids=["quiet", "default"])
def test_a_distributed_run_prints_the_line_of_every_file_once_on_a_line_of_its_own(suite, verbosity):
    # pytest-xdist: the workers' reports reach the controller, which prints; the two files run side by side, so
    # how many tests were done when a file ended depends on which finished first
    code, lines = suite("-n", "2", "--dist", "loadfile", *verbosity)
    first = line("test_first.py", "2 passed", r"\d", r"\d+")
    second = line("test_second.py", "1 failed, 1 passed, 1 skipped", r"\d", r"\d+")
    assert len(matching(lines, first)) == len(matching(lines, second)) == 1, "\n".join(lines)
    assert sum("[5/5 tests, 100%;" in text for text in lines) == 1, "\n".join(lines)  # the last one counts all
    assert code == 1 and re.search(r"1 failed, 3 passed, 1 skipped in ", lines[-1]), lines[-1]
