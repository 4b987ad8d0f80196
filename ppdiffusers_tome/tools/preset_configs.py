"""The shipped pipeline configs (``tools/configs/*.json``): their names and their contents. Nothing else of the
tools is imported here, so the presets and the tiny builders can both read the configs."""

from __future__ import annotations

import json
import os
from typing import Any

__all__ = ["CONFIG_DIR", "available_presets", "load_preset"]

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def available_presets() -> list[str]:
    """Names of the shipped pipeline configs.

    >>> "sd15-narrow" in available_presets()
    True
    """
    return sorted(name[: -len(".json")] for name in os.listdir(CONFIG_DIR) if name.endswith(".json"))


def load_preset(name: str) -> dict[str, Any]:
    """The config dict of preset ``name`` (see :func:`available_presets`)."""
    names = available_presets()
    if name not in names:
        raise ValueError(f"preset must be one of {names}; got {name!r}")
    with open(os.path.join(CONFIG_DIR, name + ".json"), encoding="utf-8") as f:
        return json.load(f)
