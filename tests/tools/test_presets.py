"""Presets (ppdiffusers_tome/presets.py): default resolutions, the attention-memory check that stops a run which
cannot fit before anything is built, and the one assembly path of the embedded models (the tiny test models are
presets too; ppdiffusers_tome.testing only re-exports them)."""

import json

import numpy as np
import paddle
import pytest
from ppdiffusers import UNet2DConditionModel
from ppdiffusers.models.attention_processor import Attention

from ppdiffusers_tome.presets import (
    available_memory_bytes,
    available_presets,
    check_attention_memory,
    default_resolution,
    estimate_attention_bytes,
    folder_layout,
    load_preset,
    preset_layout,
    preset_pipeline,
    preset_summary,
    tiny_controlnet_pipeline,
    tiny_sd_pipeline,
    tiny_sdxl_unet,
    tiny_unet,
    tiny_vae,
)
from ppdiffusers_tome.tools import presets

GIB = 1024**3


def measured_attention_elements(preset, resolution):
    """Run the preset's real UNet once (batch 2, as with classifier-free guidance) and return the largest
    ``rows x heads x N x N`` over its self-attention layers, read from the tensors that reach them."""
    config = load_preset(preset)
    paddle.seed(0)
    unet = UNet2DConditionModel(**config["unet"])
    unet.eval()
    vae_scale = 2 ** (len(config["vae"]["block_out_channels"]) - 1)
    seen = []

    def record(layer, args):
        hidden = args[0]
        seen.append(hidden.shape[0] * layer.heads * hidden.shape[1] ** 2)

    self_attention = [m for name, m in unet.named_sublayers() if name.endswith("attn1") and isinstance(m, Attention)]
    hooks = [m.register_forward_pre_hook(record) for m in self_attention]
    side = resolution // vae_scale
    sample = paddle.randn([2, 4, side, side])
    text = paddle.randn([2, 4, config["unet"]["cross_attention_dim"]])
    kwargs = {}
    if config.get("pipeline") == "sdxl":
        width = config["unet"]["projection_class_embeddings_input_dim"] - 6 * config["unet"]["addition_time_embed_dim"]
        kwargs["added_cond_kwargs"] = {"text_embeds": paddle.randn([2, width]), "time_ids": paddle.ones([2, 6])}
    with paddle.no_grad():
        unet(sample, paddle.to_tensor([10]), text, **kwargs)
    for hook in hooks:
        hook.remove()
    return max(seen)


@pytest.mark.parametrize("preset,resolution", [("tiny", 32), ("tiny", 72), ("tiny-sdxl", 40), ("tiny-sdxl", 72)])
def test_estimate_matches_the_attention_the_unet_really_runs(preset, resolution):
    # 72 px: latent 36, then 18 and 9 at the deeper levels (odd sizes round up, as a stride-2 convolution does)
    elements = measured_attention_elements(preset, resolution)
    assert estimate_attention_bytes(preset_layout(preset), resolution) == 2 * elements * 4  # scores + softmax, fp32
    assert estimate_attention_bytes(preset_layout(preset), resolution, dtype="float16") == 2 * elements * 2
    assert estimate_attention_bytes(preset_layout(preset), resolution, images=3) == 3 * 2 * elements * 4


def test_estimate_of_the_reported_oom():
    # the reported crash: tiny (2x VAE, 8 heads at the full latent) at 256 px has 16384 tokens: 32 GiB
    assert estimate_attention_bytes(preset_layout("tiny"), 256) == 2 * 2 * 8 * 16384**2 * 4 == 32 * GIB
    # SDXL attends from the 2x level on: 1024 px -> latent 128 -> 64 x 64 tokens with 10 heads
    assert estimate_attention_bytes(preset_layout("sdxl"), 1024) == 2 * 2 * 10 * 4096**2 * 4


def test_every_preset_has_a_default_resolution_that_fits_a_small_machine():
    for name in available_presets():
        size = default_resolution(name)
        assert size % 8 == 0 and size >= 32
        assert estimate_attention_bytes(preset_layout(name), size) <= 4 * GIB, name
        assert preset_summary(name)


def test_check_refuses_with_resolution_preset_and_a_size_that_fits():
    layout = preset_layout("tiny")
    with pytest.raises(ValueError) as error:
        check_attention_memory(layout, [64, 256], source="preset 'tiny'", available=8 * GIB)
    text = str(error.value)
    assert "preset 'tiny' at 256x256 px" in text and "32.0 GiB" in text and "8.0 GiB" in text
    assert "--resolution 128 or less" in text
    # the advice is the largest multiple of 32 within half the memory
    assert estimate_attention_bytes(layout, 128) <= 4 * GIB < estimate_attention_bytes(layout, 160)


def test_check_passes_what_fits_and_names_the_option():
    layout = preset_layout("tiny")
    check_attention_memory(layout, [64, 128], available=8 * GIB)  # 2 GiB at 128 px
    with pytest.raises(ValueError, match="Use --resolutions 128 or less"):
        check_attention_memory(layout, [256], source="x", option="--resolutions", available=8 * GIB)
    with pytest.raises(ValueError, match="Even 32 px does not fit"):
        check_attention_memory(layout, [256], source="x", available=1024)
    check_attention_memory(None, [100000], available=1024)  # no UNet layout known: nothing to check


def test_available_memory_is_read_from_meminfo():
    value = available_memory_bytes()
    with open("/proc/meminfo", encoding="ascii") as f:
        line = next(line for line in f if line.startswith("MemAvailable:"))
    assert value is not None and value > 0
    assert abs(value - int(line.split()[1]) * 1024) < GIB  # read twice, a moment apart


def test_folder_layout_reads_the_saved_configs(tmp_path):
    config = load_preset("tiny")
    (tmp_path / "unet").mkdir()
    (tmp_path / "vae").mkdir()
    (tmp_path / "unet" / "config.json").write_text(json.dumps(config["unet"]), encoding="utf-8")
    (tmp_path / "vae" / "config.json").write_text(json.dumps(config["vae"]), encoding="utf-8")
    assert folder_layout(str(tmp_path)) == preset_layout("tiny")
    assert folder_layout(str(tmp_path / "missing")) is None


# one home for the embedded models --------------------------------------------------------------------------------
def weights(pipe):
    """``{component.parameter: array}`` of every model in ``pipe`` (MultiControlNet nets included)."""
    return {f"{name}.{key}": value.numpy() for name, component in pipe.components.items()
            if isinstance(component, paddle.nn.Layer) for key, value in component.state_dict().items()}


def assert_same_weights(ours, theirs):
    assert ours.keys() == theirs.keys() and ours
    for key in ours:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)


@pytest.mark.parametrize("build,preset", [("tiny_sd_pipeline", "tiny"), ("tiny_controlnet_pipeline", "tiny-controlnet"),
                                          ("tiny_sdxl_pipeline", "tiny-sdxl")])
@pytest.mark.parametrize("seed", [0, 3])
def test_tiny_pipelines_are_their_presets(build, preset, seed):
    ours, theirs = getattr(presets, build)(seed=seed), preset_pipeline(preset, seed=seed)
    assert type(ours) is type(theirs) and type(ours.scheduler) is type(theirs.scheduler)
    assert ours.tokenizer.model_max_length == theirs.tokenizer.model_max_length == 77
    assert_same_weights(weights(ours), weights(theirs))


def test_tiny_models_are_the_preset_models():
    tiny, sdxl = preset_pipeline("tiny", seed=5), preset_pipeline("tiny-sdxl", seed=5)
    for model, part in ((tiny_unet(5), tiny.unet), (tiny_vae(6), tiny.vae), (tiny_sdxl_unet(5), sdxl.unet)):
        assert_same_weights({k: v.numpy() for k, v in model.state_dict().items()},
                            {k: v.numpy() for k, v in part.state_dict().items()})


def test_tiny_pipeline_variants_and_errors():
    inpaint = tiny_sd_pipeline("inpaint")
    assert type(inpaint).__name__ == "StableDiffusionInpaintPipeline" and inpaint.unet.config.in_channels == 9
    img2img = tiny_sd_pipeline("img2img", scheduler="EulerDiscreteScheduler")
    assert type(img2img).__name__ == "StableDiffusionImg2ImgPipeline"
    assert type(img2img.scheduler).__name__ == "EulerDiscreteScheduler"
    assert type(tiny_controlnet_pipeline(2).controlnet).__name__ == "MultiControlNetModel"
    with pytest.raises(ValueError, match="kind must be one of"):
        tiny_sd_pipeline("video")


@pytest.mark.parametrize("enabled_before", [True, False])
def test_loading_a_folder_hides_ppdiffusers_loading_bar_and_restores_its_setting(tmp_path, monkeypatch, enabled_before):
    import ppdiffusers
    from ppdiffusers.utils import logging as ppdiffusers_logging

    from ppdiffusers_tome.presets import load_local_pipeline, preset_pipeline

    folder = str(tmp_path / "tiny")
    preset_pipeline("tiny").save_pretrained(folder)
    seen = []
    real = ppdiffusers.DiffusionPipeline.from_pretrained

    def spy(*args, **kwargs):
        seen.append(ppdiffusers_logging.is_progress_bar_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(ppdiffusers.DiffusionPipeline, "from_pretrained", spy)
    (ppdiffusers_logging.enable_progress_bar if enabled_before else ppdiffusers_logging.disable_progress_bar)()
    try:
        load_local_pipeline(folder)
        assert seen == [False]  # no "Loading pipeline components..." bar during the load
        assert ppdiffusers_logging.is_progress_bar_enabled() is enabled_before  # the user's setting is kept
    finally:
        ppdiffusers_logging.enable_progress_bar()
