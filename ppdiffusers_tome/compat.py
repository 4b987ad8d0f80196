"""The import paths of 0.14 that moved in 0.15, kept working until 0.17 (0.15.0 announced 0.16).

0.15 put the modules of each technique in a folder of its own (``core/``, ``tome/``, ``cache/``). An old path still
imports, with a ``FutureWarning`` naming the new one: a moved module is the new module itself (the same object, so
its classes and functions are the same too), and the two facades ``ppdiffusers_tome.merge`` (the merge core's names,
now exported by :mod:`ppdiffusers_tome.ops`) and ``ppdiffusers_tome.joint_attention`` (now
:mod:`ppdiffusers_tome.sd3_attention` and :mod:`ppdiffusers_tome.tome.joint_attention`) are built from the modules
that hold their names now. Objects
pickled by 0.14 load through the same paths. This module imports nothing of the package until an old path is asked
for, and ``import ppdiffusers_tome`` installs it.

Names renamed in 0.16.0 (one meaning per word: one set of action constants, :class:`~ppdiffusers_tome.tome.actions.
Action`, and distinct names for what each function decides) are kept until 0.17 the same way, in
:data:`RENAMED` (module attributes, through the module's ``__getattr__``) and :data:`RENAMED_METHODS`.

>>> import warnings
>>> from ppdiffusers_tome.tome import patch
>>> with warnings.catch_warnings(record=True):  # a FutureWarning names the new path
...     warnings.simplefilter("always")
...     import ppdiffusers_tome.patch as old
>>> old is patch
True
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from typing import Dict, Optional, Sequence, Tuple

__all__ = ["MOVED", "FACADES", "RENAMED", "RENAMED_METHODS", "install", "new_path", "renamed", "renamed_method"]

# old module -> the module it is now
MOVED: Dict[str, str] = {
    "ppdiffusers_tome.registry": "ppdiffusers_tome.core.registry",
    "ppdiffusers_tome.calls": "ppdiffusers_tome.core.calls",
    "ppdiffusers_tome.generation": "ppdiffusers_tome.core.generation",
    "ppdiffusers_tome.targets": "ppdiffusers_tome.core.targets",
    "ppdiffusers_tome.config": "ppdiffusers_tome.tome.config",
    "ppdiffusers_tome.decision": "ppdiffusers_tome.tome.decision",
    "ppdiffusers_tome.policy": "ppdiffusers_tome.tome.policy",
    "ppdiffusers_tome.planner": "ppdiffusers_tome.tome.planner",
    "ppdiffusers_tome.state": "ppdiffusers_tome.tome.state",
    "ppdiffusers_tome.hooks": "ppdiffusers_tome.tome.hooks",
    "ppdiffusers_tome.patch": "ppdiffusers_tome.tome.patch",
    "ppdiffusers_tome.checkpoint": "ppdiffusers_tome.tome.checkpoint",
    "ppdiffusers_tome.step_cache": "ppdiffusers_tome.cache.step_cache",
    "ppdiffusers_tome.cache_layout": "ppdiffusers_tome.cache.layout",
    "ppdiffusers_tome.cache_export": "ppdiffusers_tome.cache.export",
}

# old module whose names now live in several modules -> those modules, in the order a name is looked up
FACADES: Dict[str, Tuple[str, ...]] = {
    "ppdiffusers_tome.merge": ("ppdiffusers_tome.ops",),
    "ppdiffusers_tome.joint_attention": ("ppdiffusers_tome.sd3_attention", "ppdiffusers_tome.tome.joint_attention"),
}

# module -> {old name: (module now holding it, its name there, dotted for an attribute of a class)}
_DECISION, _ACTIONS = "ppdiffusers_tome.tome.decision", "ppdiffusers_tome.tome.actions"
RENAMED: Dict[str, Dict[str, Tuple[str, str]]] = {
    _DECISION: {"decide": (_DECISION, "decide_block"), "OFF": (_ACTIONS, "Action.OFF"),
                "SKIPPED": (_ACTIONS, "Action.SKIP"), "POOLED": (_ACTIONS, "Action.POOL"),
                "TODO": (_ACTIONS, "Action.TODO"), "MERGE": (_ACTIONS, "Action.MERGE")},
}
# (class, old method name) -> the method's name now
RENAMED_METHODS: Dict[Tuple[str, str], str] = {("Policy", "decide"): "choose_plan",
                                                ("Policy", "decide_shape"): "choose_plan_for"}
_RENAMED_WHEN = "since ppdiffusers_tome 0.16.0; the old name works until 0.17"


def renamed(module: str, name: str) -> object:
    """What the old name ``name`` of ``module`` is now (with a ``FutureWarning`` naming the new one), for the
    module's ``__getattr__``; ``AttributeError`` for a name that was never there.

    >>> import warnings
    >>> with warnings.catch_warnings(record=True):
    ...     warnings.simplefilter("always")
    ...     renamed("ppdiffusers_tome.tome.decision", "SKIPPED")
    'skip'
    """
    if name not in RENAMED.get(module, {}):
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    home, new = RENAMED[module][name]
    warnings.warn(f"{module}.{name} is {home}.{new} {_RENAMED_WHEN}", FutureWarning, stacklevel=3)
    value: object = importlib.import_module(home)
    for part in new.split("."):
        value = getattr(value, part)
    return value


def renamed_method(obj: object, owner: str, old: str) -> object:
    """``obj``'s method under its new name for the old name ``old`` of class ``owner`` (a ``FutureWarning`` names
    the new one)."""
    new = RENAMED_METHODS[(owner, old)]
    warnings.warn(f"{owner}.{old} is {owner}.{new} {_RENAMED_WHEN}", FutureWarning, stacklevel=3)
    return getattr(obj, new)


def new_path(old: str) -> Optional[str]:
    """Where the 0.14 module ``old`` is now (several modules joined by " and " for a facade), or None if it did not
    move.

    >>> new_path("ppdiffusers_tome.patch"), new_path("ppdiffusers_tome.api")
    ('ppdiffusers_tome.tome.patch', None)
    """
    if old in MOVED:
        return MOVED[old]
    if old in FACADES:
        return " and ".join(FACADES[old])
    return None


def _facade(name: str, sources: Sequence[str]) -> types.ModuleType:
    """A module named ``name`` holding the public names of ``sources`` (the first source wins a clash)."""
    module = types.ModuleType(name, f"0.14's {name}, kept for one release: its names are now in {', '.join(sources)}.")
    names = []
    for source in reversed(sources):
        imported = importlib.import_module(source)
        public = getattr(imported, "__all__", [n for n in vars(imported) if not n.startswith("_")])
        for attribute in public:
            setattr(module, attribute, getattr(imported, attribute))
            names.append(attribute)
    module.__all__ = sorted(set(names))
    return module


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths only (every other import goes to the finders after it) and loads them as the new ones."""

    def __init__(self) -> None:
        self._own_specs: Dict[str, importlib.machinery.ModuleSpec] = {}

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001 - the finder protocol's signature
        if fullname in MOVED or fullname in FACADES:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):  # noqa: ANN001
        warnings.warn(f"{spec.name} moved to {new_path(spec.name)} in ppdiffusers_tome 0.15; the old path works "
                      "until 0.17", FutureWarning, stacklevel=2)
        if spec.name in MOVED:
            module = importlib.import_module(MOVED[spec.name])
            self._own_specs[module.__name__] = module.__spec__  # the import system sets the old path's spec on it
            return module
        return _facade(spec.name, FACADES[spec.name])

    def exec_module(self, module):  # noqa: ANN001 - a moved module is complete: it only gets its own spec back
        if module.__name__ in self._own_specs:
            module.__spec__ = self._own_specs[module.__name__]


_FINDER = _OldPaths()


def install() -> None:
    """Put the finder of the old paths first on ``sys.meta_path`` (once; ``import ppdiffusers_tome`` calls this).

    >>> install(); install()
    >>> sum(isinstance(finder, _OldPaths) for finder in sys.meta_path)
    1
    """
    if not any(isinstance(finder, _OldPaths) for finder in sys.meta_path):
        sys.meta_path.insert(0, _FINDER)
