"""0.14's import paths keep working for one release: each old module path gives the module that moved (the same
object) with a FutureWarning naming the new path, the two facades hold their old names, and a pickle that names an
old path loads."""

from __future__ import annotations

import importlib
import pickle
import sys
import warnings

import pytest

from ppdiffusers_tome import compat
from ppdiffusers_tome.tome.config import ToMeConfig

# the public names the two facades had in 0.14
MERGE_NAMES = ["DEFAULT_CACHE_BYTES", "DOWNSAMPLE_MODES", "DenseFeaturePlan", "DenseLocalPlan", "DownsamplePlan",
               "GroupMergePlan", "LocalMergePlan", "MergePlan", "bipartite_soft_matching_random2d", "cache_info",
               "clear_cache", "clear_table_cache", "compute_dtype", "converting", "device_kind", "downsample_tokens",
               "feature_partition_table", "find_downsample", "force_kernels", "grid_partition", "max_ratio",
               "partition_table", "similarity_dtype", "step_key", "table_cache_info", "tracing",
               "window_partition_table", "window_sides"]
JOINT_ATTENTION_NAMES = ["JointMathAttnProcessor", "attention_core", "downsampled_joint_attention", "joint_attention",
                         "joint_attention_layers", "math_attention", "remove_math_attention", "stock_attention",
                         "use_math_attention"]


def fresh_import(name: str):
    """Import ``name`` as if for the first time in this process, returning the module and the warnings raised."""
    saved = sys.modules.pop(name, None)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(name)
    finally:
        if saved is not None:
            sys.modules[name] = saved
    return module, [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]


@pytest.mark.parametrize("old,new", sorted(compat.MOVED.items()))
def test_an_old_module_path_is_the_moved_module_with_a_warning(old, new):
    module, messages = fresh_import(old)
    assert module is importlib.import_module(new)
    assert module.__name__ == new and module.__spec__.name == new  # the moved module keeps its own identity
    assert any(old in text and new in text and "until 0.17" in text for text in messages), messages


@pytest.mark.parametrize("old,names", [("ppdiffusers_tome.merge", MERGE_NAMES),
                                       ("ppdiffusers_tome.joint_attention", JOINT_ATTENTION_NAMES)])
def test_a_facade_holds_every_name_it_had(old, names):
    module, messages = fresh_import(old)
    missing = [name for name in names if not hasattr(module, name)]
    assert not missing
    assert messages and all(source in messages[0] for source in compat.FACADES[old])
    from ppdiffusers_tome.ops import MergePlan
    from ppdiffusers_tome.tome.joint_attention import attention_core

    assert getattr(module, "MergePlan", MergePlan) is MergePlan
    assert getattr(module, "attention_core", attention_core) is attention_core


def test_a_pickle_naming_an_old_path_loads():
    config = ToMeConfig(ratio=0.3, sx=4)
    data = pickle.dumps(config, protocol=2)  # protocol 2 names the class's module as text
    assert b"ppdiffusers_tome.tome.config" in data
    old = data.replace(b"ppdiffusers_tome.tome.config", b"ppdiffusers_tome.config")
    assert old != data
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        loaded = pickle.loads(old)
    assert type(loaded) is ToMeConfig and loaded == config


def test_paths_that_never_existed_still_fail():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("ppdiffusers_tome.no_such_module")
    assert compat.new_path("ppdiffusers_tome.api") is None
