"""A one-line progress bar on stderr that log lines do not break.

While a :class:`ProgressBar` is open, every logging ``StreamHandler`` that writes to the bar's stream, and
``sys.stderr`` itself (``warnings``, ``print(file=sys.stderr)``), write through a small proxy: it wipes the bar
before the text goes out and draws the bar again below it once the text ends a line. Log lines therefore scroll
above the bar instead of being glued to it. Everything is put back when the bar closes, also after an exception.

The bar is drawn only when its stream is a terminal (or when ``enabled=True``); otherwise it counts silently and
the log lines are all there is, which keeps files and CI logs clean. Output written straight to the file
descriptor by C++ code (Paddle's glog) does not pass through Python: it can start on the bar's line, and the bar
is drawn again below it at the next update.

>>> import io
>>> out = io.StringIO()
>>> with ProgressBar(total=4, desc="demo", unit="steps", stream=out, enabled=True) as bar:
...     bar.update(2)
...     bar.line()[:41]
'demo |############------------| 2/4 steps'
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import IO, Any

__all__ = ["ProgressBar"]

_ERASE_LINE = "\x1b[K"  # ANSI: erase from the cursor to the end of the line (the bar is drawn on terminals only)


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class _BarStream:
    """A stream proxy that wipes the bar before writing and redraws it after a completed line."""

    def __init__(self, stream: IO[str], bar: ProgressBar):
        self._stream = stream
        self._bar = bar

    def write(self, text: str) -> int:
        with self._bar._lock:
            self._bar._wipe()
            written = self._stream.write(text)
            if text.endswith("\n"):
                self._bar._draw(force=True)
        return written

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ... of the real stream
        return getattr(self._stream, name)


class ProgressBar:
    """``total`` units of work shown as ``desc |#####-----| 5/10 unit 0:12 < 0:12`` on one line of ``stream``
    (default ``sys.stderr``). Call :meth:`update` as work completes; use as a context manager (or call
    :meth:`close`). ``enabled=None`` draws only on a terminal. ``leave=False`` wipes the bar when it closes."""

    def __init__(
        self,
        total: int,
        desc: str = "",
        unit: str = "it",
        stream: IO[str] | None = None,
        enabled: bool | None = None,
        leave: bool = False,
        width: int = 24,
        min_interval: float = 0.1,
    ):
        if total < 0:
            raise ValueError(f"total must be >= 0; got {total}")
        self.total, self.desc, self.unit, self.leave, self.width = int(total), desc, unit, leave, width
        self.count = 0
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = bool(isatty and isatty()) if enabled is None else bool(enabled)
        self.min_interval = min_interval
        self._start = time.perf_counter()
        self._last_draw = 0.0
        self._drawn = 0  # characters of the bar currently on screen
        self._lock = threading.RLock()
        self._proxy = _BarStream(self.stream, self)
        self._swapped: list[tuple[logging.StreamHandler, IO[str]]] = []
        self._saved_stderr: IO[str] | None = None
        self._open = False
        if self.enabled:
            self._install()
            self._open = True
            self._draw(force=True)

    # the text ---------------------------------------------------------------------------------------------------
    def line(self) -> str:
        """The bar as it is drawn now (without the carriage return)."""
        elapsed = time.perf_counter() - self._start
        if self.total:
            filled = min(self.width, self.width * self.count // self.total)
            bar = "|" + "#" * filled + "-" * (self.width - filled) + "| "
            left = elapsed / self.count * (self.total - self.count) if self.count else 0.0
            eta = f" < {_clock(left)}" if 0 < self.count < self.total else ""
            counts = f"{self.count}/{self.total} {self.unit}"
        else:
            bar, eta, counts = "", "", f"{self.count} {self.unit}"
        return f"{self.desc + ' ' if self.desc else ''}{bar}{counts} {_clock(elapsed)}{eta}"

    def _wipe(self) -> None:
        if self._drawn:
            self.stream.write("\r" + _ERASE_LINE)
            self._drawn = 0

    def _draw(self, force: bool = False) -> None:
        if not self._open:
            return
        now = time.perf_counter()
        if not force and now - self._last_draw < self.min_interval:
            return
        text = self.line()
        self.stream.write("\r" + text + _ERASE_LINE)
        self.stream.flush()
        self._drawn, self._last_draw = len(text), now

    # progress ---------------------------------------------------------------------------------------------------
    def update(self, n: int = 1) -> None:
        """Count ``n`` more units done and redraw (at most every ``min_interval`` seconds, always at the end)."""
        with self._lock:
            self.count += n
            self._draw(force=self.count >= self.total)

    def set_description(self, desc: str) -> None:
        """Change the text in front of the bar."""
        with self._lock:
            self.desc = desc
            self._draw(force=True)

    # streams ----------------------------------------------------------------------------------------------------
    def _install(self) -> None:
        loggers = [logging.getLogger()] + [
            logger for logger in logging.Logger.manager.loggerDict.values() if isinstance(logger, logging.Logger)
        ]
        for logger in loggers:
            for handler in logger.handlers:
                if isinstance(handler, logging.StreamHandler) and handler.stream is self.stream:
                    self._swapped.append((handler, handler.stream))
                    handler.setStream(self._proxy)
        if sys.stderr is self.stream:
            self._saved_stderr, sys.stderr = sys.stderr, self._proxy

    def _uninstall(self) -> None:
        for handler, stream in self._swapped:
            if handler.stream is self._proxy:
                handler.setStream(stream)
        self._swapped.clear()
        if self._saved_stderr is not None and sys.stderr is self._proxy:
            sys.stderr = self._saved_stderr
        self._saved_stderr = None

    def close(self) -> None:
        """Draw the final state (``leave=True``) or wipe the bar, and give the streams back. Idempotent."""
        with self._lock:
            if not self._open:
                return
            if self.leave:
                self._draw(force=True)
                self.stream.write("\n")
                self._drawn = 0
            else:
                self._wipe()
            self.stream.flush()
            self._open = False
            self._uninstall()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
