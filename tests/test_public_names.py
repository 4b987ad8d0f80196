"""Every public name of 0.8.1 and 0.11 still imports where it did, the public doors (``testing``, ``presets``) lead
to the tools' objects themselves, and ``testing.gpu_kernels`` switches the kernel family and nothing else."""

import importlib
import threading

import numpy as np
import paddle
import pytest

import ppdiffusers_tome
import ppdiffusers_tome.presets as presets
import ppdiffusers_tome.testing as testing
from ppdiffusers_tome.ops.runtime import device_kind, forced_kernels
from ppdiffusers_tome.tools import pipelines, presets as tool_presets, tiny

# (module, names) as 0.8.1 exported them: a user's import of any of them keeps working
NAMES_081 = {
    "ppdiffusers_tome": ["ToMeConfig", "MergePlan", "DownsamplePlan", "downsample_tokens", "apply_tome", "remove_tome",
                         "reset_tome", "tome_config", "tome_status", "tome_stats", "bipartite_soft_matching_random2d",
                         "clear_cache", "cache_info", "install_methods", "uninstall_methods", "__version__"],
    "ppdiffusers_tome.ops": ["DOWNSAMPLE_MODES", "cache_info", "clear_cache", "DownsamplePlan", "LocalMergePlan",
                               "MergePlan", "bipartite_soft_matching_random2d", "compute_dtype", "converting",
                               "device_kind", "downsample_tokens", "find_downsample", "grid_partition", "max_ratio",
                               "partition_table", "step_key", "tracing", "window_partition_table", "window_sides"],
    "ppdiffusers_tome.tome.config": ["ToMeConfig", "check_ratio", "ALLOWED_MAX_DOWNSAMPLE", "METHODS", "MAX_STRIDE",
                                "MAX_WINDOW", "MATCH_ORDERS", "SHARE_PLAN", "RatioSpec", "ratio_at", "tokens_to_merge"],
    "ppdiffusers_tome.api": ["apply_tome", "remove_builtin_tome", "remove_tome", "reset_tome", "tome_config",
                             "tome_models", "tome_status", "tome_stats", "install_methods", "uninstall_methods"],
    "ppdiffusers_tome.tome.patch": ["ModelPatch", "ToMeState", "ToMeStaticGraphError", "PATCH_LOCK", "find_blocks",
                               "get_patch"],
    # (0.8.1's StepHistory, the step history of recompute_every inside ToMeState, is gone: plans kept across steps
    # are PlanCache's, steps come from the step clock of generation.py; ToMeState names what ModelPatch.state is)
    "ppdiffusers_tome.tome.state": ["CallRecord", "ToMeState", "ToMeStaticGraphError", "timestep_values"],
    "ppdiffusers_tome.testing": ["TEXT_HIDDEN", "make_scheduler", "random_controlnet", "tiny_controlnet",
                                 "tiny_controlnet_pipeline", "tiny_dit_pipeline", "tiny_dit_transformer",
                                 "tiny_sd_pipeline", "tiny_sdxl_pipeline", "tiny_sdxl_unet", "tiny_text_encoder",
                                 "tiny_tokenizer", "tiny_unet", "tiny_vae", "write_tokenizer_files"],
    "ppdiffusers_tome.presets": ["preset_pipeline", "available_presets", "load_preset", "default_resolution",
                                 "load_local_pipeline", "preset_summary", "DEFAULT_PRESET"],
}

# (module, names) that 0.11 added to its modules' __all__ and that still mean something. Left out, as internals of
# the forward hooks that 0.12's registry replaced: hooks.BlockHooks, SublayerHooks, HookRecord and HookCall (Paddle
# forward-hook records: now registry.Hook subclasses BlockHook and SublayerHook), and state.StepHistory.
NAMES_011 = {
    "ppdiffusers_tome": ["CacheConfig", "apply_cache", "remove_cache", "reset_cache", "cache_status", "StepPrograms",
                         "ScheduledSteps"],
    "ppdiffusers_tome.cache.step_cache": ["CacheConfig", "StepCache", "StepCacheError", "apply_cache", "cache_status",
                                    "get_cache", "remove_cache", "reset_cache"],
    "ppdiffusers_tome.cache.export": ["CachedStep", "FullStep", "ScheduledSteps", "StepPrograms"],
    "ppdiffusers_tome.tome.checkpoint": ["RecomputePlans", "ReentrantRecomputeError", "reentrant_recompute"],
    "ppdiffusers_tome.tome.config": ["POLICIES"],
    "ppdiffusers_tome.tome.hooks": ["TENSOR_TYPES"],
    "ppdiffusers_tome.tome.planner": ["Planner", "finest_block_level"],
    "ppdiffusers_tome.tome.policy": ["ASSUMED_BATCH", "MERGE_MIN_WORK", "POOL_MIN_RATIO", "POOL_MIN_WORK", "Decision",
                                "Policy", "pools_by_default"],
    "ppdiffusers_tome.ops": ["DEFAULT_CACHE_BYTES", "DenseFeaturePlan", "DenseLocalPlan", "GroupMergePlan",
                               "feature_partition_table", "force_kernels", "similarity_dtype"],
    "ppdiffusers_tome.testing": ["gpu_kernels"],
    "ppdiffusers_tome.tools.presets": ["DEFAULT_PRESET", "DTYPES", "available_memory_bytes", "available_presets",
                                       "check_attention_memory", "check_dtype", "default_resolution",
                                       "estimate_attention_bytes", "folder_layout", "load_local_pipeline",
                                       "load_preset", "make_scheduler", "preset_layout", "preset_pipeline",
                                       "preset_summary", "random_controlnet", "tiny_controlnet",
                                       "tiny_controlnet_pipeline", "tiny_dit_pipeline", "tiny_dit_transformer",
                                       "tiny_sd_pipeline", "tiny_sdxl_pipeline", "tiny_sdxl_unet", "tiny_text_encoder",
                                       "tiny_tokenizer", "tiny_unet", "tiny_vae", "write_tokenizer_files"],
}


@pytest.mark.parametrize("module", list(NAMES_081))
def test_every_public_name_of_0_8_1_still_imports(module):
    loaded = importlib.import_module(module)
    missing = [name for name in NAMES_081[module] if not hasattr(loaded, name)]
    assert not missing, f"{module} lost {missing}"


@pytest.mark.parametrize("module", list(NAMES_011))
def test_every_public_name_of_0_11_still_imports(module):
    loaded = importlib.import_module(module)
    missing = [name for name in NAMES_011[module] if not hasattr(loaded, name)]
    assert not missing, f"{module} lost {missing}"


def test_the_state_of_a_patch_is_still_a_tome_state():
    """0.11's ToMeState is the type of ``ModelPatch.state`` (the counters of tome_stats), in both its modules."""
    from ppdiffusers_tome.tome.patch import ModelPatch, ToMeState
    from ppdiffusers_tome.tome.state import ToMeState as StateToMeState

    patch = ModelPatch.install(testing.tiny_unet(), ppdiffusers_tome.ToMeConfig())
    assert ToMeState is StateToMeState and isinstance(patch.state, ToMeState) and patch.state is patch.counters
    assert patch.state.calls == 0 and patch.state.merges == 0
    patch.remove()


def test_the_public_doors_lead_to_the_tools_objects():
    for name in presets.__all__:
        assert getattr(presets, name) is getattr(tool_presets, name), name
    for name in testing.__all__:
        if name != "gpu_kernels":  # the tiny builders are tiny.py's and pipelines.py's, re-exported by presets too
            home = tiny if name in tiny.__all__ else pipelines
            assert getattr(testing, name) is getattr(home, name) is getattr(tool_presets, name), name
    builders = set(tiny.__all__) | set(pipelines.__all__) - {"assemble_pipeline"}
    assert builders <= set(testing.__all__) and builders - {"TEXT_HIDDEN"} <= set(presets.__all__)


def test_gpu_kernels_switch_the_kernel_family_in_every_thread_and_come_back():
    x = paddle.ones([1])
    seen = []
    with testing.gpu_kernels():
        worker = threading.Thread(target=lambda: seen.append(device_kind(x)))
        worker.start()
        worker.join()
        with testing.gpu_kernels():  # nests
            assert device_kind(x) == "gpu"
        assert device_kind(x) == "gpu" and forced_kernels() == "gpu"
    assert seen == ["gpu"] and device_kind(x) == "cpu" and forced_kernels() is None
    with pytest.raises(RuntimeError):
        with testing.gpu_kernels():
            raise RuntimeError("inside")
    assert forced_kernels() is None  # put back after an exception too


def test_gpu_kernels_change_the_plan_kind_and_not_the_result_in_float32():
    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((2, 64, 8)).astype("float32"))
    cpu = ppdiffusers_tome.bipartite_soft_matching_random2d(x, 8, 8, 2, 2, 32, generator=0)
    with testing.gpu_kernels():
        gpu = ppdiffusers_tome.bipartite_soft_matching_random2d(x, 8, 8, 2, 2, 32, generator=0)
    assert (cpu.kind, gpu.kind) == ("cpu", "gpu")
    np.testing.assert_allclose(gpu.unmerge(gpu.merge(x)).numpy(), cpu.unmerge(cpu.merge(x)).numpy(), rtol=1e-5,
                               atol=1e-6)


def test_the_old_path_builds_the_tiny_preset_and_runs_with_tome():
    # the package docstring's example: an old script, unchanged
    pipe = testing.tiny_sd_pipeline(seed=2)
    preset = presets.preset_pipeline("tiny", seed=2)
    ours, theirs = pipe.unet.state_dict(), preset.unet.state_dict()
    assert ours.keys() == theirs.keys()
    for key in ours:
        np.testing.assert_array_equal(ours[key].numpy(), theirs[key].numpy(), err_msg=key)
    sample = paddle.to_tensor(np.random.default_rng(0).standard_normal([2, 4, 16, 16]).astype("float32"))
    text = paddle.to_tensor(np.random.default_rng(1).standard_normal([2, 16, testing.TEXT_HIDDEN]).astype("float32"))
    with paddle.no_grad():
        vanilla = pipe.unet(sample, paddle.to_tensor(500), encoder_hidden_states=text).sample.numpy()
        pipe.apply_tome(ratio=0.5)
        merged = pipe.unet(sample, paddle.to_tensor(500), encoder_hidden_states=text).sample.numpy()
        assert ppdiffusers_tome.tome_status(pipe)["unet"]["active"] == "ppdiffusers_tome"
        pipe.remove_tome()
        again = pipe.unet(sample, paddle.to_tensor(500), encoder_hidden_states=text).sample.numpy()
    assert np.abs(merged - vanilla).max() > 1e-4  # ToMe acted on the tiny UNet
    np.testing.assert_array_equal(again, vanilla)


def test_the_cache_layouts_old_name_is_its_new_class():
    """0.14's ``cache_layout.Layout`` is 0.15's ``CacheLayout`` (renamed: ``ops.partition.Layout`` is the merge core's
    token grid), kept for one release under the old name."""
    from ppdiffusers_tome.cache.layout import CacheLayout, Layout, TransformerLayout, UNetLayout
    from ppdiffusers_tome.cache.whole_model import WholeModelLayout
    from ppdiffusers_tome.ops.partition import Layout as Grid

    assert Layout is CacheLayout and Grid is not CacheLayout
    assert all(issubclass(cls, CacheLayout) for cls in (UNetLayout, TransformerLayout, WholeModelLayout))
