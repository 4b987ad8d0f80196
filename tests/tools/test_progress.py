"""The progress bar (ppdiffusers_tome/progress.py): log lines scroll above it instead of breaking it, and every
stream it borrowed is given back."""

import io
import logging
import sys

import pytest

from ppdiffusers_tome.tools.progress import ProgressBar


@pytest.fixture
def logged():
    """A logger writing to its own StringIO, as logging.basicConfig would to stderr."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("test_progress")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    yield logger, handler, stream
    logger.removeHandler(handler)


def screen(text):
    """What a terminal shows: carriage return goes back to the line start, ESC[K erases the rest of the line."""
    lines, line, col = [], [], 0
    i = 0
    while i < len(text):
        if text.startswith("\x1b[K", i):
            del line[col:]
            i += 3
            continue
        ch = text[i]
        if ch == "\r":
            col = 0
        elif ch == "\n":
            lines.append("".join(line))
            line, col = [], 0
        else:
            if col < len(line):
                line[col] = ch
            else:
                line.append(ch)
            col += 1
        i += 1
    return lines + ["".join(line)]


def test_log_lines_scroll_above_the_bar(logged):
    logger, handler, stream = logged
    with ProgressBar(total=3, desc="vanilla", unit="steps", stream=stream, enabled=True, min_interval=0) as bar:
        bar.update()
        assert handler.stream is not stream  # borrowed while the bar is open
        logger.info("first log line")
        bar.update()
        logger.info("second log line")
        assert screen(stream.getvalue())[-1].startswith("vanilla |################--------| 2/3 steps")
        bar.update()
    assert handler.stream is stream
    shown = screen(stream.getvalue())
    # each log line stands alone on its own line, and the bar was wiped at the end
    assert shown == ["first log line", "second log line", ""]


def test_stderr_writes_go_through_the_bar(monkeypatch):
    fake = io.StringIO()
    monkeypatch.setattr(sys, "stderr", fake)
    with ProgressBar(total=2, desc="bench", unit="runs", enabled=True, min_interval=0) as bar:
        assert sys.stderr is not fake
        bar.update()
        orphan = logging.getLogger("test_progress.orphan")  # no handler anywhere: logging's last resort,
        orphan.propagate = False                            # which writes to sys.stderr as it is at that moment
        orphan.warning("careful")
        print("plain", "line", file=sys.stderr)
    assert sys.stderr is fake
    shown = screen(fake.getvalue())
    assert shown == ["careful", "plain line", ""]


def test_streams_are_given_back_after_an_exception(logged):
    logger, handler, stream = logged
    saved = sys.stderr
    with pytest.raises(RuntimeError):
        with ProgressBar(total=5, stream=stream, enabled=True):
            raise RuntimeError("boom")
    assert handler.stream is stream and sys.stderr is saved


def test_off_a_terminal_the_bar_writes_nothing(logged):
    logger, handler, stream = logged
    with ProgressBar(total=2, desc="x", stream=stream) as bar:  # StringIO is not a terminal
        bar.update()
        logger.info("only this")
        bar.update(1)
        assert bar.count == 2
    assert stream.getvalue() == "only this\n" and handler.stream is stream


def test_leave_keeps_the_final_line_and_bad_total_is_refused():
    stream = io.StringIO()
    with ProgressBar(total=2, desc="done", unit="runs", stream=stream, enabled=True, leave=True) as bar:
        bar.update(2)
    assert screen(stream.getvalue())[0].startswith("done |########################| 2/2 runs")
    with pytest.raises(ValueError, match="total must be >= 0"):
        ProgressBar(total=-1)
