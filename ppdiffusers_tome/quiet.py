"""Quiet output for the command line and the examples: other libraries' import noise off, our log lines plain.

Importing Paddle prints two warnings that say nothing about this package or the user's run (``No ccache found``:
only relevant when compiling custom C++ operators; ``Setuptools is replacing distutils``: setuptools' shim), and
``paddle.distributed`` puts a handler with a timestamp, level and file:line prefix on the *root* logger, so every
INFO line of ours came out as ``[2026-...] [    INFO] commands.py:80 - ...``. The command line (and each example,
before it imports Paddle) calls :func:`ignore_import_warnings`; :func:`configure_logging` replaces the root handler.
A library import of ``ppdiffusers_tome`` silences the two warnings only while it runs (when it is the first to import
Paddle) and leaves the filters as it found them, and it leaves logging alone: both belong to the application.

Only the standard library is imported here, so the package's ``__init__`` can use it before Paddle is imported.
"""

from __future__ import annotations

import logging
import re
import warnings
from typing import Tuple, Type

# (start of the message, category) of each warning silenced; matched exactly, nothing broader
THIRD_PARTY_WARNINGS: Tuple[Tuple[str, Type[Warning]], ...] = (
    ("No ccache found", UserWarning),  # paddle.utils.cpp_extension, at ``import paddle``
    ("Setuptools is replacing distutils", UserWarning),  # setuptools' _distutils_hack, at ``import paddle``
)


def ignore_import_warnings() -> None:
    """Ignore the import-time warnings of :data:`THIRD_PARTY_WARNINGS` (call it before Paddle is imported)."""
    for message, category in THIRD_PARTY_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)


def configure_logging(level: int = logging.INFO) -> None:
    """Log lines as plain messages on stderr at ``level``: a plain format for the stream handler already on the root
    logger (Paddle's timestamped one) or a new one; the INFO lines of ppdiffusers' and PaddleNLP's own loggers
    (``Loading weights file ...`` for every component of a loaded pipeline) stay out, their warnings still show."""
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(logging.StreamHandler())
    for handler in root.handlers:  # plain stream handlers only: a test runner's capturing handlers stay as they are
        if type(handler) is logging.StreamHandler:
            handler.setFormatter(logging.Formatter("%(message)s"))
    root.setLevel(level)
    for name in ("ppdiffusers", "PaddleNLP"):
        logging.getLogger(name).setLevel(max(level, logging.WARNING))
