"""ppdiffusers_tome: Token Merging for Stable Diffusion (ToMe SD) on PaddlePaddle, for ppdiffusers pipelines.

>>> import ppdiffusers_tome                        # adds apply_tome/remove_tome to pipelines and models
>>> from ppdiffusers_tome.testing import tiny_sd_pipeline
>>> pipe = tiny_sd_pipeline().apply_tome(ratio=0.5)
>>> pipe = pipe.remove_tome()
>>> pipe = pipe.apply_cache(interval=3).remove_cache()   # step caching (DeepCache-style), composes with ToMe
"""

import importlib as _importlib
import os as _os
import sys as _sys
from typing import Any as _Any, List as _List, Optional as _Optional, Sequence as _Sequence

__version__ = "0.18.0"

from . import compat as _compat  # 0.14's import paths (ppdiffusers_tome.config, ...), until 0.17

_compat.install()


def _cli_args(
    argv: _Optional[_Sequence[str]] = None, orig_argv: _Optional[_Sequence[str]] = None
) -> _Optional[_List[str]]:
    """The arguments of the command line when this process is it (``ppdiffusers-tome ...`` or
    ``python -m ppdiffusers_tome ...``), else ``None``."""
    argv = list(_sys.argv if argv is None else argv)
    orig = list(getattr(_sys, "orig_argv", []) if orig_argv is None else orig_argv)
    if argv and _os.path.basename(argv[0]) == "ppdiffusers-tome":
        return argv[1:]
    if "-m" in orig and orig[orig.index("-m") + 1 : orig.index("-m") + 2] == ["ppdiffusers_tome"]:
        return orig[orig.index("-m") + 2 :]
    return None


def _cli_help_only(argv: _Optional[_Sequence[str]] = None, orig_argv: _Optional[_Sequence[str]] = None) -> bool:
    """Whether this process is the command line (``ppdiffusers-tome`` or ``python -m ppdiffusers_tome``) asked only
    for ``--help`` or ``--version``, or given no arguments, or for ``bench --calibrate`` without a GPU (which the
    command line refuses at once). Those need neither Paddle nor ppdiffusers, whose import takes seconds, so the
    package then skips it; every name below still imports on first use."""
    args = _cli_args(argv, orig_argv)
    if args is None:
        return False
    refused = "--calibrate" in args and not any("gpu" in arg for arg in args)
    return not args or refused or any(arg in ("-h", "--help", "--version") for arg in args)


_LAZY = {
    "apply_tome": "api", "install_methods": "api", "remove_tome": "api", "reset_tome": "api", "tome_config": "api",
    "tome_status": "api", "tome_stats": "api", "uninstall_methods": "api", "ToMeConfig": "tome.config",
    "apply_todo": "api", "remove_todo": "api", "ToDoConfig": "tome.todo",
    "DownsamplePlan": "ops.downsample", "MergePlan": "ops.global_plan",
    "bipartite_soft_matching_random2d": "ops.global_plan", "cache_info": "ops.cache", "clear_cache": "ops.cache",
    "clear_table_cache": "ops.cache", "table_cache_info": "ops.cache",
    "downsample_tokens": "ops.downsample", "apply_cache": "cache.step_cache", "remove_cache": "cache.step_cache",
    "reset_cache": "cache.step_cache", "cache_status": "cache.step_cache", "CacheConfig": "cache.step_cache",
    "StepPrograms": "cache.export", "ScheduledSteps": "cache.export",
}


def __getattr__(name: str) -> _Any:  # only reached when _cli_help_only() skipped the imports below
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(_importlib.import_module(f".{_LAZY[name]}", __name__), name)


if _cli_args() is not None:  # the command line, not a library import: Paddle's import warnings are not news
    from .quiet import ignore_import_warnings as _ignore_import_warnings

    _ignore_import_warnings()

if not _cli_help_only():
    import warnings as _warnings

    from .quiet import ignore_import_warnings as _ignore_import_warnings

    # Paddle's two import-time warnings (see quiet.py) are silenced for this import only: the filters are put back
    # as they were afterwards, so the application's own warning settings stay its own
    _quiet_import = _warnings.catch_warnings()
    _quiet_import.__enter__()
    _ignore_import_warnings()
    from .api import (
        apply_todo,
        apply_tome,
        install_methods,
        remove_todo,
        remove_tome,
        reset_tome,
        tome_config,
        tome_stats,
        tome_status,
        uninstall_methods,
    )
    from .cache.export import ScheduledSteps, StepPrograms
    from .cache.step_cache import CacheConfig, apply_cache, cache_status, remove_cache, reset_cache
    from .ops.cache import cache_info, clear_cache, clear_table_cache, table_cache_info
    from .ops.downsample import DownsamplePlan, downsample_tokens
    from .ops.global_plan import MergePlan, bipartite_soft_matching_random2d
    from .tome.config import ToMeConfig
    from .tome.todo import ToDoConfig

    _quiet_import.__exit__(None, None, None)

    install_methods()

__all__ = [
    "ToMeConfig",
    "ToDoConfig",
    "MergePlan",
    "DownsamplePlan",
    "downsample_tokens",
    "apply_tome",
    "remove_tome",
    "apply_todo",
    "remove_todo",
    "reset_tome",
    "tome_config",
    "tome_status",
    "tome_stats",
    "bipartite_soft_matching_random2d",
    "clear_table_cache",
    "table_cache_info",
    "clear_cache",
    "cache_info",
    "install_methods",
    "uninstall_methods",
    "CacheConfig",
    "apply_cache",
    "remove_cache",
    "reset_cache",
    "cache_status",
    "StepPrograms",
    "ScheduledSteps",
]
