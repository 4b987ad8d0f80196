"""Checks every technique's settings share: what counts as an integer, a bool or a choice, and how a bad value is
shown in an error message."""

from __future__ import annotations

import numbers
from typing import Any, Optional, Sequence

import numpy as np

__all__ = ["as_bool", "as_choice", "is_int", "shown"]


def is_int(value: Any) -> bool:
    """A Python or numpy integer, not a bool: what every integer option of the package accepts (ToMe's and the step
    cache's alike).

    >>> import numpy as np
    >>> is_int(3), is_int(np.int64(3)), is_int(True), is_int(3.0)
    (True, True, False, False)
    """
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def as_bool(value: Any) -> Optional[bool]:
    """``value`` as a plain bool if it is a Python or numpy bool, else None (0/1 and tensors are not bools)."""
    return bool(value) if isinstance(value, (bool, np.bool_)) else None


def as_choice(value: Any, choices: Sequence[str]) -> Optional[str]:
    """``value`` as a plain str if it is one of ``choices`` (no comparison with arrays or tensors), else None."""
    return str(value) if isinstance(value, str) and value in choices else None


def shown(value: Any) -> str:
    """``repr(value)`` on one line and at most ~100 characters, plus a hint for arrays and tensors, for messages."""
    try:
        text = " ".join(repr(value).split())
    except Exception:  # noqa: BLE001 - a broken __repr__ must not hide the real error
        text = f"<{type(value).__name__}>"
    if len(text) > 100:
        text = text[:97] + "..."
    if hasattr(value, "shape") and hasattr(value, "dtype"):  # numpy array, paddle Tensor
        text += " (pass a plain Python value, not an array or a Tensor)"
    return text
