"""Every public name of 0.8.1 still imports where it did, the public doors (``testing``, ``presets``) lead to the
tools' objects themselves, and ``testing.gpu_kernels`` switches the kernel family and nothing else."""

import importlib
import threading

import numpy as np
import paddle
import pytest

import ppdiffusers_tome
import ppdiffusers_tome.presets as presets
import ppdiffusers_tome.testing as testing
from ppdiffusers_tome.ops.runtime import device_kind, forced_kernels
from ppdiffusers_tome.tools import presets as tool_presets

# (module, names) as 0.8.1 exported them: a user's import of any of them keeps working
NAMES_081 = {
    "ppdiffusers_tome": ["ToMeConfig", "MergePlan", "DownsamplePlan", "downsample_tokens", "apply_tome", "remove_tome",
                         "reset_tome", "tome_config", "tome_status", "tome_stats", "bipartite_soft_matching_random2d",
                         "clear_cache", "cache_info", "install_methods", "uninstall_methods", "__version__"],
    "ppdiffusers_tome.merge": ["DOWNSAMPLE_MODES", "cache_info", "clear_cache", "DownsamplePlan", "LocalMergePlan",
                               "MergePlan", "bipartite_soft_matching_random2d", "compute_dtype", "converting",
                               "device_kind", "downsample_tokens", "find_downsample", "grid_partition", "max_ratio",
                               "partition_table", "step_key", "tracing", "window_partition_table", "window_sides"],
    "ppdiffusers_tome.config": ["ToMeConfig", "check_ratio", "ALLOWED_MAX_DOWNSAMPLE", "METHODS", "MAX_STRIDE",
                                "MAX_WINDOW", "MATCH_ORDERS", "SHARE_PLAN", "RatioSpec", "ratio_at", "tokens_to_merge"],
    "ppdiffusers_tome.api": ["apply_tome", "remove_builtin_tome", "remove_tome", "reset_tome", "tome_config",
                             "tome_models", "tome_status", "tome_stats", "install_methods", "uninstall_methods"],
    "ppdiffusers_tome.patch": ["ModelPatch", "ToMeState", "ToMeStaticGraphError", "PATCH_LOCK", "find_blocks",
                               "get_patch"],
    "ppdiffusers_tome.state": ["CallRecord", "StepHistory", "ToMeState", "ToMeStaticGraphError", "timestep_values"],
    "ppdiffusers_tome.testing": ["TEXT_HIDDEN", "make_scheduler", "random_controlnet", "tiny_controlnet",
                                 "tiny_controlnet_pipeline", "tiny_dit_pipeline", "tiny_dit_transformer",
                                 "tiny_sd_pipeline", "tiny_sdxl_pipeline", "tiny_sdxl_unet", "tiny_text_encoder",
                                 "tiny_tokenizer", "tiny_unet", "tiny_vae", "write_tokenizer_files"],
    "ppdiffusers_tome.presets": ["preset_pipeline", "available_presets", "load_preset", "default_resolution",
                                 "load_local_pipeline", "preset_summary", "DEFAULT_PRESET"],
}


@pytest.mark.parametrize("module", list(NAMES_081))
def test_every_public_name_of_0_8_1_still_imports(module):
    loaded = importlib.import_module(module)
    missing = [name for name in NAMES_081[module] if not hasattr(loaded, name)]
    assert not missing, f"{module} lost {missing}"


def test_the_public_doors_lead_to_the_tools_objects():
    for name in presets.__all__:
        assert getattr(presets, name) is getattr(tool_presets, name), name
    for name in testing.__all__:
        if name != "gpu_kernels":
            assert getattr(testing, name) is getattr(tool_presets, name), name


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
