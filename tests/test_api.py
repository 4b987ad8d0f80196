"""Public surface (ppdiffusers_tome/api.py): methods, precedence over the built-in port, idempotence, bad input,
atomicity, save/load."""

import filecmp
import os
import re

import numpy as np
import paddle
import pytest

import ppdiffusers_tome
from ppdiffusers_tome import api
from ppdiffusers_tome.core.registry import hooks_of, original_class
from ppdiffusers_tome.testing import tiny_controlnet_pipeline, tiny_sd_pipeline, tiny_unet
from ppdiffusers_tome.tome.patch import ModelPatch, find_blocks, get_patch
from tests.conftest import run
from tests.unet_calls import hook_counts, unet_inputs, unet_output


def test_methods_are_on_pipelines_and_models_and_call_this_package():
    from ppdiffusers import DiffusionPipeline, ModelMixin

    for owner in (DiffusionPipeline, ModelMixin):
        assert owner.__dict__["apply_tome"] is api._apply_method
        assert owner.__dict__["remove_tome"] is api._remove_method
    assert paddle.nn.Layer.__dict__.get("apply_tome") is not api._apply_method  # not on every layer


def test_pipe_unet_and_functional_forms_patch_the_same_way():
    pipe = tiny_sd_pipeline()
    assert pipe.apply_tome(ratio=0.4) is pipe
    assert ppdiffusers_tome.tome_config(pipe.unet).ratio == 0.4
    assert pipe.unet.apply_tome(ratio=0.3) is pipe.unet
    assert ppdiffusers_tome.tome_config(pipe.unet).ratio == 0.3
    assert ppdiffusers_tome.apply_tome(pipe, ratio=0.2) is pipe
    assert ppdiffusers_tome.tome_config(pipe.unet).ratio == 0.2
    assert ppdiffusers_tome.remove_tome(pipe) is pipe and ppdiffusers_tome.tome_config(pipe.unet) is None


def test_vae_and_text_encoder_are_never_patched():
    pipe = tiny_sd_pipeline().apply_tome()
    for name in ("vae", "text_encoder"):
        component = getattr(pipe, name)
        assert all(get_patch(m) is None for m in component.sublayers(include_self=True))
        assert all(hooks_of(m) is None and original_class(m) is type(m) for m in component.sublayers(include_self=True))
        assert all(not m._forward_pre_hooks for m in component.sublayers(include_self=True))


def test_remove_without_apply_is_a_no_op():
    pipe = tiny_sd_pipeline()
    before = hook_counts(pipe.unet)
    reference = unet_output(pipe.unet)
    assert pipe.remove_tome() is pipe
    assert pipe.unet.remove_tome() is pipe.unet
    assert hook_counts(pipe.unet) == before
    np.testing.assert_array_equal(unet_output(pipe.unet), reference)


def test_remove_gives_bit_identical_outputs():
    unet = tiny_unet()
    reference = unet_output(unet)
    ppdiffusers_tome.apply_tome(unet, ratio=0.6, merge_crossattn=True, merge_mlp=True, max_downsample=8)
    assert np.abs(unet_output(unet) - reference).max() > 1e-4
    ppdiffusers_tome.remove_tome(unet)
    np.testing.assert_array_equal(unet_output(unet), reference)


def builtin_apply(model, **kwargs):
    return paddle.nn.Layer.apply_tome(model, **kwargs)  # ppdiffusers' own port, still attached to nn.Layer


def test_builtin_patch_is_replaced_by_ours():
    unet, fresh = tiny_unet(), tiny_unet()
    builtin_apply(unet, ratio=0.5, use_rand=False)
    assert any(type(m).__name__.startswith("ToMe") for _, m in unet.named_sublayers())
    unet.apply_tome(ratio=0.5, use_rand=False)
    fresh.apply_tome(ratio=0.5, use_rand=False)
    assert not any(type(m).__name__.startswith("ToMe") for _, m in unet.named_sublayers())
    assert not any("_tome_info" in m.__dict__ for m in unet.sublayers(include_self=True))
    np.testing.assert_array_equal(unet_output(unet), unet_output(fresh))


def test_remove_also_undoes_the_builtin_port():
    unet = tiny_unet()
    reference = unet_output(unet)
    before = hook_counts(unet)
    builtin_apply(unet, ratio=0.5)
    ppdiffusers_tome.remove_tome(unet)
    assert hook_counts(unet) == before
    assert all(type(m).__name__ == "BasicTransformerBlock" for _, m in find_blocks(unet))
    np.testing.assert_array_equal(unet_output(unet), reference)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(ratio=0.8), r"ratio must be in \[0, 0.75\)"),
        (dict(ratio=-0.5), r"ratio must be in"),
        (dict(sx=0), r"sx must be an integer >= 1"),
        (dict(sy=-2), r"sy must be an integer >= 1"),
        (dict(max_downsample=3), r"max_downsample must be 'auto' or one of \(1, 2, 4, 8\)"),
        (dict(method="todo", downsample_factor=16), r"downsample_factor must be an integer in \[2, 8\]"),
        (dict(ratio=(0.2, 0.9)), r"ratio end must be in \[0, 0.75\)"),
    ],
)
def test_bad_arguments_raise_and_leave_the_model_untouched(kwargs, message):
    pipe = tiny_sd_pipeline().apply_tome(ratio=0.3)
    before = hook_counts(pipe.unet)
    patch = get_patch(pipe.unet)
    with pytest.raises(ValueError, match=message):
        pipe.apply_tome(**kwargs)
    assert hook_counts(pipe.unet) == before and get_patch(pipe.unet) is patch


def test_objects_without_transformer_blocks_are_refused():
    pipe = tiny_sd_pipeline()
    before = hook_counts(pipe.vae)
    with pytest.raises(ValueError, match="AutoencoderKL is built from .*not ppdiffusers' BasicTransformerBlock"):
        ppdiffusers_tome.apply_tome(pipe.vae)
    with pytest.raises(ValueError, match=r"has no transformer blocks \(BasicTransformerBlock\)"):
        ppdiffusers_tome.apply_tome(pipe.text_encoder)
    with pytest.raises(ValueError, match="not to the VAE or a text encoder"):
        ppdiffusers_tome.apply_tome([pipe.unet, pipe.vae])
    assert hook_counts(pipe.vae) == before and get_patch(pipe.unet) is None


@pytest.mark.parametrize("thing", ["unet", 3, None, {"unet": 1}, [], ["unet"]])
def test_non_pipelines_and_non_models_are_refused_naming_the_function_called(thing):
    functions = [ppdiffusers_tome.apply_tome, ppdiffusers_tome.remove_tome, ppdiffusers_tome.reset_tome,
                 ppdiffusers_tome.tome_status, ppdiffusers_tome.tome_stats, ppdiffusers_tome.apply_cache,
                 ppdiffusers_tome.remove_cache, ppdiffusers_tome.reset_cache, ppdiffusers_tome.cache_status]
    for function in functions:
        with pytest.raises(ValueError, match=f"^{function.__name__} expects a ppdiffusers DiffusionPipeline"):
            function(thing)
    if isinstance(thing, list):
        with pytest.raises(ValueError, match="^tome_config expects a ppdiffusers DiffusionPipeline"):
            ppdiffusers_tome.tome_config(thing)
    else:  # (what is neither a pipeline nor a list has no config to report)
        assert ppdiffusers_tome.tome_config(thing) is None


def test_a_positional_interval_is_refused_with_the_call_written_as_the_caller_wrote_it():
    pipe = tiny_sd_pipeline()
    with pytest.raises(ValueError, match=r"the interval is a keyword: apply_cache\(pipe, interval=3\)\)"):
        ppdiffusers_tome.apply_cache(pipe, 3)
    with pytest.raises(ValueError, match=r"the interval is a keyword: pipe\.apply_cache\(interval=2\)\)"):
        pipe.apply_cache(2)
    assert ppdiffusers_tome.cache_status(pipe)["unet"] is None  # nothing was put on


def test_a_failure_half_way_restores_the_previous_state(monkeypatch):
    pipe = tiny_controlnet_pipeline(num_controlnets=2)
    models = [pipe.unet, *pipe.controlnet.nets]
    before = [hook_counts(m) for m in models]
    pipe.apply_tome(ratio=0.3)
    patched = [hook_counts(m) for m in models]
    real_install = ModelPatch.install
    calls = []

    def failing_install(model, config, *args):
        calls.append(model)
        if len(calls) == 3 and config.ratio == 0.5:
            raise RuntimeError("simulated failure while patching the third model")
        return real_install(model, config, *args)

    monkeypatch.setattr(ModelPatch, "install", staticmethod(failing_install))
    with pytest.raises(RuntimeError, match="simulated"):
        pipe.apply_tome(ratio=0.5)
    assert [hook_counts(m) for m in models] == patched  # the ratio-0.3 patches are back, nothing else
    assert all(ppdiffusers_tome.tome_config(m).ratio == 0.3 for m in models)
    monkeypatch.setattr(ModelPatch, "install", staticmethod(real_install))
    pipe.remove_tome()
    assert [hook_counts(m) for m in models] == before


def test_multicontrolnet_is_patched_and_removed_net_by_net():
    pipe = tiny_controlnet_pipeline(num_controlnets=2)
    reference = run(pipe, image=[_control(), _control()])
    before = [hook_counts(net) for net in pipe.controlnet.nets]
    pipe.controlnet.apply_tome(ratio=0.5)
    assert all(get_patch(net) is not None for net in pipe.controlnet.nets)
    assert get_patch(pipe.unet) is None
    pipe.apply_tome(ratio=0.5)
    pipe.remove_tome()
    assert [hook_counts(net) for net in pipe.controlnet.nets] == before
    np.testing.assert_array_equal(run(pipe, image=[_control(), _control()]), reference)


def test_a_list_of_controlnets_can_be_patched():
    pipe = tiny_controlnet_pipeline(num_controlnets=2)
    nets = list(pipe.controlnet.nets)
    ppdiffusers_tome.apply_tome(nets, ratio=0.5)
    assert all(ppdiffusers_tome.tome_config(net).ratio == 0.5 for net in nets)
    ppdiffusers_tome.remove_tome(tuple(nets))
    assert all(get_patch(net) is None for net in nets)


def _control():
    from PIL import Image

    return Image.fromarray(np.random.default_rng(5).uniform(0, 255, (32, 32, 3)).astype("uint8"))


def test_save_pretrained_of_a_patched_model_writes_the_unpatched_files(tmp_path):
    unet = tiny_unet()
    unet.save_pretrained(str(tmp_path / "plain"))
    ppdiffusers_tome.apply_tome(unet, ratio=0.5)
    unet(*unet_inputs(unet))  # a call leaves runtime state behind; it must not be saved
    unet.save_pretrained(str(tmp_path / "patched"))
    plain, patched = sorted(os.listdir(tmp_path / "plain")), sorted(os.listdir(tmp_path / "patched"))
    assert plain == patched and plain
    match, mismatch, errors = filecmp.cmpfiles(tmp_path / "plain", tmp_path / "patched", plain, shallow=False)
    assert mismatch == [] and errors == [] and match == plain
    assert set(unet.state_dict()) == set(tiny_unet().state_dict())


def test_from_pretrained_of_a_local_tiny_pipeline_then_apply(tmp_path):
    from ppdiffusers import StableDiffusionPipeline

    original = tiny_sd_pipeline()
    reference = run(original)
    original.save_pretrained(str(tmp_path))
    loaded = StableDiffusionPipeline.from_pretrained(str(tmp_path), safety_checker=None)
    loaded.set_progress_bar_config(disable=True)
    np.testing.assert_allclose(run(loaded), reference, atol=1e-6)
    loaded.apply_tome(ratio=0.5)
    images = run(loaded)
    assert ppdiffusers_tome.tome_stats(loaded)["unet"]["merges"] > 0
    assert np.isfinite(images).all() and np.abs(images - reference).max() > 0
    loaded.remove_tome()
    np.testing.assert_allclose(run(loaded), reference, atol=1e-6)


def test_stats_count_blocks_calls_and_merges():
    pipe = tiny_sd_pipeline().apply_tome(ratio=0.5)
    # "blocks": the blocks ToMe hooked: the 3 of the tiny UNet's 7 at its finest level (1x), the only ones that merge
    zero = {"blocks": 3, "calls": 0, "merges": 0, "plans_computed": 0, "plans_reused": 0, "plans_shared": 0, "blocks_skipped": 0,
                "blocks_pooled": 0}
    assert ppdiffusers_tome.tome_stats(pipe) == {"unet": zero}
    run(pipe, steps=2)
    after = {"blocks": 3, "calls": 2, "merges": 6, "plans_computed": 6, "plans_reused": 0, "plans_shared": 0, "blocks_skipped": 0,
                "blocks_pooled": 0}
    assert ppdiffusers_tome.tome_stats(pipe) == {"unet": after}


def test_uninstall_and_reinstall_methods():
    from ppdiffusers import ModelMixin

    api.uninstall_methods()
    try:
        assert ModelMixin.__dict__.get("apply_tome") is not api._apply_method
    finally:
        api.install_methods()
    assert ModelMixin.__dict__["apply_tome"] is api._apply_method


# "is ToMe on?": tome_config for pipelines, tome_status ----------------------------------------------------------
def test_tome_config_answers_for_pipelines_and_lists():
    pipe = tiny_controlnet_pipeline()
    assert ppdiffusers_tome.tome_config(pipe) is None
    pipe.apply_tome(ratio=0.4)
    expected = ppdiffusers_tome.ToMeConfig(ratio=0.4)
    assert ppdiffusers_tome.tome_config(pipe) == expected == ppdiffusers_tome.tome_config(pipe.unet)
    assert ppdiffusers_tome.tome_config([pipe.unet, pipe.controlnet]) == expected
    pipe.remove_tome()
    assert ppdiffusers_tome.tome_config(pipe) is None
    pipe.unet.apply_tome(ratio=0.2)  # only the UNet: the pipeline's answer is the UNet's
    assert ppdiffusers_tome.tome_config(pipe).ratio == 0.2
    pipe.controlnet.apply_tome(ratio=0.3)
    with pytest.raises(ValueError, match=r"different ToMe configs \(unet: .*ratio=0.2.*controlnet: .*ratio=0.3"):
        ppdiffusers_tome.tome_config(pipe)
    assert ppdiffusers_tome.tome_config("not a model") is None


def test_tome_status_tells_ours_from_the_builtin_port_with_settings():
    pipe = tiny_controlnet_pipeline()
    blocks = {name: len(find_blocks(getattr(pipe, name))) for name in ("unet", "controlnet")}
    # this package hooks the blocks at the finest level only (the ones that can merge): 3 of the UNet's 7 blocks
    # (down_blocks.0 and up_blocks.2 run at 1x), 1 of the ControlNet's 3 (down_blocks.0)
    finest = {name: len([n for n, _ in find_blocks(getattr(pipe, name)) if n.startswith(("down_blocks.0.", "up_blocks.2."))])
              for name in blocks}
    assert finest == {"unet": 3, "controlnet": 1} and blocks == {"unet": 7, "controlnet": 3}
    off = ppdiffusers_tome.tome_status(pipe)
    assert off == {name: {"active": None, "settings": None, "blocks": 0, "cache": None} for name in blocks}

    pipe.apply_tome(ratio=0.4, merge_crossattn=True)
    ours = ppdiffusers_tome.tome_status(pipe)
    for name, count in finest.items():
        assert ours[name]["active"] == "ppdiffusers_tome" and ours[name]["blocks"] == count > 0
        assert ours[name]["settings"] == ppdiffusers_tome.ToMeConfig(ratio=0.4, merge_crossattn=True).to_dict()
    pipe.remove_tome()

    api.uninstall_methods()  # what a script that never imported ppdiffusers_tome gets from pipe.apply_tome
    try:
        pipe.apply_tome(ratio=0.3)
    finally:
        api.install_methods()
    builtin = ppdiffusers_tome.tome_status(pipe)
    for name, count in blocks.items():
        assert builtin[name]["active"] == "builtin" and builtin[name]["blocks"] == count
        assert builtin[name]["settings"]["ratio"] == 0.3 and builtin[name]["settings"]["max_downsample"] == 1
    paddle.nn.Layer.remove_tome(pipe.unet)  # the port's own removal leaves _tome_info behind: still "off"
    assert ppdiffusers_tome.tome_status(pipe.unet)["UNet2DConditionModel"]["active"] is None

    unet = tiny_unet().apply_tome(ratio=0.5)
    builtin_apply(unet, ratio=0.2)  # the port calls model.remove_tome() first, which is ours: only the port is left
    status = ppdiffusers_tome.tome_status(unet)["UNet2DConditionModel"]
    assert status["active"] == "builtin" and status["settings"]["ratio"] == 0.2 and get_patch(unet) is None


# half precision on a CPU: a warning at apply_tome, with the reason and where to go ------------------------------
def test_apply_tome_on_half_weights_on_a_cpu_warns_once_with_the_recipe(monkeypatch):
    import warnings

    from ppdiffusers_tome.presets import preset_pipeline

    monkeypatch.setattr(api, "_warned_half_on_cpu", False)
    pipe = preset_pipeline("tiny", dtype="float16")
    with pytest.warns(UserWarning) as record:
        pipe.apply_tome(ratio=0.5)
    (warning,) = [w for w in record if "float16" in str(w.message)]
    text = str(warning.message)
    assert "unet holds float16 weights on the CPU" in text and "is not registered" in text
    assert api.GPU_INSTALL_HINT in text and "float32" in text
    assert warning.filename == __file__  # points at the caller's line, not at this package
    assert api.tome_config(pipe).ratio == 0.5  # a warning, not a refusal (a GPU-branch test may do this on purpose)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe.apply_tome(ratio=0.3)  # once per process
        api.apply_tome(pipe.unet, ratio=0.3)


def test_apply_tome_in_float32_on_a_cpu_does_not_warn(monkeypatch):
    import warnings

    from ppdiffusers_tome.presets import preset_pipeline

    monkeypatch.setattr(api, "_warned_half_on_cpu", False)
    pipe = preset_pipeline("tiny")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe.apply_tome(ratio=0.5)
    assert api._warned_half_on_cpu is False


def test_the_install_recipe_named_in_half_precision_messages_exists_in_both_readmes():
    from ppdiffusers_tome.api import GPU_INSTALL_HINT

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    readme = open(os.path.join(root, "README.md"), encoding="utf-8").read()
    readme_cn = open(os.path.join(root, "README_cn.md"), encoding="utf-8").read()
    english, chinese = re.findall(r'"([^"]+)"', GPU_INSTALL_HINT)
    assert f"\n## {english}\n" in readme and f"\n## {chinese}\n" in readme_cn  # the sections the hint names
    for text in (readme, readme_cn):
        section = text.split(f"\n## {english if text is readme else chinese}\n", 1)[1].split("\n## ", 1)[0]
        assert "paddlepaddle-gpu" in section


def test_tome_status_returns_the_users_schedule_even_when_it_cannot_be_copied():
    import threading

    class LockedSchedule:
        """A valid ratio schedule holding a lock (copy.deepcopy and pickle refuse it)."""

        def __init__(self):
            self.lock = threading.Lock()

        def __call__(self, progress):
            with self.lock:
                return 0.6 - 0.3 * progress

    def plain(progress):
        return 0.5

    for schedule in (LockedSchedule(), plain):
        unet = ppdiffusers_tome.apply_tome(tiny_unet(), ratio=schedule)
        settings = ppdiffusers_tome.tome_status(unet)["UNet2DConditionModel"]["settings"]
        assert settings["ratio"] is schedule  # the user's own object, not a copy
        assert settings == dict(ppdiffusers_tome.tome_config(unet).__dict__)
        unet_output(unet)  # and the schedule works


def test_a_rollback_is_not_stopped_by_a_forward_that_began_meanwhile(monkeypatch):
    """Rolling back takes the new patches off by force: a forward that started on an already patched model (here:
    every model reports one) must not leave that model with the new patch and the others with the old one."""
    pipe = tiny_controlnet_pipeline(num_controlnets=2)
    models = [pipe.unet, *pipe.controlnet.nets]
    pipe.apply_tome(ratio=0.3)
    patched = [hook_counts(m) for m in models]
    real_install, calls = ModelPatch.install, []

    def busy(self):
        raise RuntimeError("a forward of this model is running")

    def failing_install(model, config, *args):
        calls.append(model)
        if len(calls) == 3:
            monkeypatch.setattr(ModelPatch, "check_idle", busy)
            raise RuntimeError("simulated failure while patching the third model")
        return real_install(model, config, *args)

    monkeypatch.setattr(ModelPatch, "install", staticmethod(failing_install))
    with pytest.raises(RuntimeError, match="simulated"):  # the original error, not one from the rollback
        pipe.apply_tome(ratio=0.5)
    monkeypatch.undo()
    assert [hook_counts(m) for m in models] == patched
    assert all(ppdiffusers_tome.tome_config(m).ratio == 0.3 for m in models)


def test_warnings_point_past_this_package_only():
    assert api._ours("ppdiffusers_tome") and api._ours("ppdiffusers_tome.tome.patch")
    assert not api._ours("ppdiffusers_tome_demo") and not api._ours("__main__")


# apply_tome(obj, config=None, **options) --------------------------------------------------------------------------
def test_apply_tome_takes_a_config_whose_fields_the_options_replace():
    config = ppdiffusers_tome.ToMeConfig(ratio=0.3, merge_mlp=True, seed=5)
    pipe = tiny_sd_pipeline()
    assert ppdiffusers_tome.apply_tome(pipe, config=config, ratio=0.5) is pipe
    applied = ppdiffusers_tome.tome_config(pipe)
    assert applied == ppdiffusers_tome.ToMeConfig(ratio=0.5, merge_mlp=True, seed=5)
    assert config.ratio == 0.3  # the caller's config is not changed
    unet = ppdiffusers_tome.apply_tome(tiny_unet(), config)  # positionally, and without options: as it is
    assert ppdiffusers_tome.tome_config(unet) == config
    pipe.unet.apply_tome(config, seed=6)  # the method takes it too
    assert ppdiffusers_tome.tome_config(pipe.unet) == ppdiffusers_tome.ToMeConfig(ratio=0.3, merge_mlp=True, seed=6)


def test_tome_config_round_trips_to_bit_identical_outputs():
    pipe = tiny_sd_pipeline()
    vanilla = run(pipe, steps=3)
    pipe.apply_tome(ratio=0.4, merge_crossattn=True, recompute_every=2, seed=3)
    other = tiny_sd_pipeline()
    assert ppdiffusers_tome.apply_tome(other, config=ppdiffusers_tome.tome_config(pipe)) is other
    assert ppdiffusers_tome.tome_config(other) == ppdiffusers_tome.tome_config(pipe)
    patched = run(pipe, steps=3)
    assert np.abs(patched - vanilla).max() > 1e-4  # ToMe changes the images, so equality below means something
    np.testing.assert_array_equal(run(other, steps=3), patched)
    unet = ppdiffusers_tome.apply_tome(tiny_unet(), config=ppdiffusers_tome.tome_config(pipe.unet))  # model level
    reference = ppdiffusers_tome.apply_tome(tiny_unet(), ratio=0.4, merge_crossattn=True, recompute_every=2, seed=3)
    np.testing.assert_array_equal(unet_output(unet), unet_output(reference))


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda pipe: ppdiffusers_tome.apply_tome(pipe, ratio=0.5, ration=0.3), r"unknown option\(s\) ration;"),
        (lambda pipe: ppdiffusers_tome.apply_tome(pipe, max_downsampling=2, use_random=True),
         r"unknown option\(s\) max_downsampling, use_random;"),
        (lambda pipe: pipe.apply_tome(merge_attention=False), r"unknown option\(s\) merge_attention;"),
        (lambda pipe: ppdiffusers_tome.apply_tome(pipe, 0.5), r"the ratio is a keyword: apply_tome\(pipe, ratio=0.5\)\)"),
        (lambda pipe: pipe.apply_tome(0.4), r"the ratio is a keyword: pipe\.apply_tome\(ratio=0.4\)\)"),  # as called
        (lambda pipe: pipe.unet.apply_tome(0.5), r"the ratio is a keyword: model\.apply_tome\(ratio=0.5\)\)"),
        (lambda pipe: ppdiffusers_tome.apply_tome(pipe, config={"ratio": 0.5}), r"config must be None or a ToMeConfig; got dict"),
    ],
    ids=["misspelt", "two_unknown", "method", "positional_ratio", "method_positional_ratio", "model_method_ratio",
         "dict_config"],
)
def test_unknown_options_and_a_positional_ratio_are_refused_by_name(call, message):
    pipe = tiny_sd_pipeline().apply_tome(ratio=0.3)
    patch, before = get_patch(pipe.unet), hook_counts(pipe.unet)
    with pytest.raises(ValueError, match=message):
        call(pipe)
    assert get_patch(pipe.unet) is patch and hook_counts(pipe.unet) == before
    assert ppdiffusers_tome.tome_config(pipe).ratio == 0.3


# after the last remove_*: no class of ppdiffusers or of the model stays changed -----------------------------------
def _classes_of_ppdiffusers():
    from ppdiffusers import DiffusionPipeline, ModelMixin, StableDiffusionPipeline, UNet2DConditionModel
    from ppdiffusers.models.attention import BasicTransformerBlock, FeedForward
    from ppdiffusers.models.attention_processor import Attention
    from ppdiffusers.models.transformer_2d import Transformer2DModel

    return [DiffusionPipeline, StableDiffusionPipeline, ModelMixin, UNet2DConditionModel, Transformer2DModel,
            BasicTransformerBlock, Attention, FeedForward, paddle.nn.Layer]


def check_nothing_stays_changed(last):
    """The body of the test below, run in a fresh process (where no other patched model holds the generation boundary):
    ToMe with recompute_every and the step cache on a pipeline, then both removed, ``last`` last."""
    from ppdiffusers import DiffusionPipeline

    from ppdiffusers_tome.core import generation

    classes = _classes_of_ppdiffusers()
    before = {cls: dict(cls.__dict__) for cls in classes}
    progress_bar = DiffusionPipeline.__dict__["progress_bar"]
    assert generation.holders() == 0 and progress_bar.__module__.startswith("ppdiffusers.")  # ppdiffusers' own
    pipe = tiny_sd_pipeline()
    vanilla = run(pipe, steps=3)

    def layers():
        return {(name, sub): layer for name in ("unet", "vae", "text_encoder")
                for sub, layer in getattr(pipe, name).named_sublayers(include_self=True)}

    layer_classes = {key: type(layer) for key, layer in layers().items()}

    pipe.apply_tome(ratio=0.5, recompute_every=2)  # both remember across steps: both hold the generation boundary
    pipe.apply_cache(interval=2)
    assert DiffusionPipeline.__dict__["progress_bar"] is not progress_bar  # (so the checks below can fail)
    assert [key for key, layer in layers().items() if type(layer) is not layer_classes[key]]
    assert np.abs(run(pipe, steps=3) - vanilla).max() > 1e-4
    first = "remove_tome" if last == "remove_cache" else "remove_cache"
    getattr(pipe, first)()
    assert DiffusionPipeline.__dict__["progress_bar"] is not progress_bar  # the other technique still uses it
    getattr(pipe, last)()

    assert DiffusionPipeline.__dict__["progress_bar"] is progress_bar and generation.holders() == 0
    for cls in classes:
        assert dict(cls.__dict__) == before[cls], cls.__name__
    for key, layer in layers().items():
        assert type(layer) is layer_classes[key] and hooks_of(layer) is None, key
    np.testing.assert_array_equal(run(pipe, steps=3), vanilla)


def test_after_the_last_remove_no_class_of_ppdiffusers_or_of_the_model_stays_changed():
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, *filter(None, [os.environ.get("PYTHONPATH")])]))
    code = ("import paddle; paddle.set_device('cpu')\n"
            "from tests.test_api import check_nothing_stays_changed\n"
            "for last in ('remove_cache', 'remove_tome'):\n"
            "    check_nothing_stays_changed(last)\n"
            "    print('ok', last)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["ok", "remove_cache", "ok", "remove_tome"], done.stdout
