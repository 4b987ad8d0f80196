"""A line per test file as it finishes, for people watching a long run.

pytest's own progress is a row of dots with a percentage at the end of each screen line: during a file whose tests
each take a while the row does not move for minutes, and nothing says which file is running or how long the run has
taken so far. With this plugin every file (a test module or a module's doctests) ends with one line of its own::

    tests/tome/test_static_graph.py: 30 passed in 61.2 s  [1,402/1,714 tests, 82%; 9:48 elapsed]

with the counts pytest's summary uses (failed, passed, skipped, xfailed, xpassed, error). A run stopped early (``-x``,
``--maxfail``, Ctrl-C) still gets the line of the file it stopped in. Failure reports, the summary and the exit code
are pytest's own and unchanged. ``tests/conftest.py`` registers the plugin as ``file-progress``; ``-p
no:file-progress`` turns it off.
"""

from __future__ import annotations

import collections
import time

import pytest

NAME = "file-progress"
# the order of the counts in a line: pytest's summary order
ORDER = ("failed", "passed", "skipped", "xfailed", "xpassed", "error")


def file_of(nodeid: str) -> str:
    """The file part of a node id: ``tests/test_api.py::test_x[1]`` -> ``tests/test_api.py``."""
    return nodeid.split("::", 1)[0]


def clock(seconds: float) -> str:
    """``m:ss`` (or ``h:mm:ss``) of a duration."""
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


def summary_line(path: str, counts: "collections.Counter[str]", seconds: float, done: int, total: int,
                 elapsed: float, left: int = 0) -> str:
    """The line printed when the file ``path`` has finished (``left``: its tests that did not run)."""
    parts = [f"{counts[name]} {name}" for name in ORDER if counts[name]]
    parts += [f"{counts[name]} {name}" for name in sorted(counts) if name not in ORDER and counts[name]]
    text = f"{path}: {', '.join(parts) or 'nothing ran'} in {seconds:.1f} s"
    if left:
        text += f" (stopped: {left} of its tests did not run)"
    share = f"{100 * done // total}%" if total else "-"
    return f"{text}  [{done:,}/{total:,} tests, {share}; {clock(elapsed)} elapsed]"


class FileProgress:
    """Counts the reports of each file's tests and prints :func:`summary_line` when the file's last test is done.

    It reads only test reports and the end of each test, so it works the same in a plain run and in the controller
    of a distributed one (pytest-xdist: the workers' reports reach it; two files may be in flight at once, and a
    file's seconds are the sum of its tests' setup, call and teardown)."""

    def __init__(self, config: pytest.Config):
        self.config = config
        self.started = time.monotonic()
        self.total = 0
        self.done = 0
        self.per_file: "collections.Counter[str]" = collections.Counter()  # tests per file, from the collection
        self.finished: "collections.Counter[str]" = collections.Counter()  # tests of each file done so far
        self.seconds: "collections.Counter[str]" = collections.Counter()
        self.counts: "dict[str, collections.Counter[str]]" = {}  # files started and not yet reported
        self.final = None  # the last file's line, printed after pytest's own closing progress

    # hooks ---------------------------------------------------------------------------------------------------------
    def pytest_sessionstart(self) -> None:
        self.started = time.monotonic()

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if session.items:  # (empty in the controller of a distributed run: its workers collect)
            self.collected([item.nodeid for item in session.items])

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids) -> None:
        if not self.total:  # (every worker collects the same tests)
            self.collected(ids)

    def collected(self, nodeids) -> None:
        self.total = len(nodeids)
        self.per_file = collections.Counter(file_of(nodeid) for nodeid in nodeids)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        path = file_of(report.nodeid)
        counts = self.counts.setdefault(path, collections.Counter())
        self.seconds[path] += report.duration
        category = self.config.hook.pytest_report_teststatus(report=report, config=self.config)[0]
        if category:  # "" for a setup or teardown that passed
            counts[category] += 1

    @pytest.hookimpl(trylast=True)  # (after the terminal has written the test's progress)
    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        path = file_of(nodeid)
        self.done += 1
        self.finished[path] += 1
        if self.finished[path] >= self.per_file[path] and path in self.counts:
            line = self.line(path)
            if self.done >= self.total:
                self.final = line  # pytest ends the run's last row of dots with "[100%]" after this
            else:
                self.write(*line)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session):
        # outermost wrapper: the terminal has written its final progress when this resumes
        result = yield
        self.finish()
        return result

    def pytest_sessionfinish(self) -> None:
        self.finish()  # the files a stopped run (-x, --maxfail, Ctrl-C) was in

    # output --------------------------------------------------------------------------------------------------------
    def line(self, path: str) -> "tuple[str, bool]":
        """The line of the file ``path`` (which is then no longer in flight) and whether it failed."""
        counts = self.counts.pop(path)
        text = summary_line(path, counts, self.seconds[path], self.done, self.total,
                            time.monotonic() - self.started, left=max(self.per_file[path] - self.finished[path], 0))
        return text, bool(counts["failed"] or counts["error"])

    def finish(self) -> None:
        if self.final is not None:
            self.write(*self.final)
            self.final = None
        for path in list(self.counts):  # files a stopped run left unfinished
            self.write(*self.line(path))

    def write(self, line: str, failed: bool = False) -> None:
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        writer = getattr(reporter, "_tw", None)
        if writer is None:
            return
        if writer.width_of_current_line:  # a row of dots (or a test's own line) is still open: end it first
            writer.line()
        markup = {"red": True} if failed else {}
        if self.config.get_verbosity() < 0 or self.config.pluginmanager.has_plugin("dsession"):
            # -q: the next file's dots start on a line of their own; a distributed run's terminal does not end an
            # open line before the next test's
            writer.line(line, **markup)
        else:
            # pytest ends an open line itself before it names the next file (or test), and would print an
            # empty line after a finished one
            writer.write(line, flush=True, **markup)
            reporter.currentfspath = None


def register(config: pytest.Config) -> None:
    """Register the plugin for this run unless it is there already, blocked (``-p no:file-progress``), or this is
    a worker of a distributed run (its controller prints). Without pytest's terminal (``-p no:terminal``) it
    prints nothing."""
    manager = config.pluginmanager
    if manager.has_plugin(NAME) or manager.is_blocked(NAME) or hasattr(config, "workerinput"):
        return
    manager.register(FileProgress(config), NAME)
