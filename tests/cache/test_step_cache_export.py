"""The step cache exported as two static programs (``ppdiffusers_tome.cache.export``): the full and the cached step
convert, save and load, and on a fixed schedule give the eager step cache's outputs; the cached program holds no
deep block; a dynamic batch, SDXL's added conditioning and ToMe inside the programs; clear errors."""

import collections

import numpy as np
import paddle
import pytest
from paddle.static import InputSpec

import ppdiffusers_tome
from ppdiffusers_tome.cache.export import ScheduledSteps, StepPrograms
from ppdiffusers_tome.cache.step_cache import CacheConfig, deep_blocks, get_cache
from ppdiffusers_tome.testing import tiny_controlnet, tiny_sdxl_pipeline, tiny_unet
from ppdiffusers_tome.tools.measure import TransferCounter

STEPS = 5  # interval 3: full, cached, cached, full, cached


def step_unet():
    """A two-level UNet of 32 channels: level 0 (a cross-attention down block and up block) is the shallow branch;
    level 1 (plain down and up blocks), the mid block (with a transformer) and the downsampler of level 0 are deep.
    At the default ``layers="auto"`` (1) a cached step runs ``conv_in``, the last resnet + transformer pair of the
    last up block and the output layers; at ``layers=None`` all of level 0. Converting costs about the layers traced
    (SOT mode most), here half what the three-level tiny preset costs; the properties checked do not depend on the
    depth."""
    return tiny_unet(block_out_channels=(32, 32), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                     up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))


def step_inputs(batch, seed=0, context_dim=32, added=False):
    """The UNet inputs of STEPS denoising steps: latents that move from step to step, falling timesteps."""
    rng = np.random.default_rng(seed)
    latents = rng.standard_normal((batch, 4, 16, 16)).astype("float32")
    context = paddle.to_tensor(rng.standard_normal((batch, 5, context_dim)).astype("float32"))
    extra = []
    if added:  # SDXL: pooled text embeddings and the six size/crop ids
        extra = [paddle.to_tensor(rng.standard_normal((batch, 32)).astype("float32")),
                 paddle.to_tensor(np.tile([[64.0, 64.0, 0.0, 0.0, 64.0, 64.0]], (batch, 1)).astype("float32"))]
    return [[paddle.to_tensor(latents * (1.0 - 0.1 * i)), paddle.to_tensor([900 - 150 * i] * batch), context, *extra]
            for i in range(STEPS)]


def eager_outputs(unet, steps):
    ppdiffusers_tome.reset_cache(unet)
    with paddle.no_grad():
        return [unet(*args[:3], added_cond_kwargs=None if len(args) == 3 else
                     {"text_embeds": args[3], "time_ids": args[4]}).sample.numpy() for args in steps]


def scheduled_outputs(full, cached, config, steps):
    runner = ScheduledSteps(full, cached, config)
    with paddle.no_grad():
        outputs = [runner(*args)[0].numpy() for args in steps]
    assert (runner.full_calls, runner.cached_calls) == (2, 3)
    return outputs


def convert(programs, steps, full_graph, dynamic_batch=False):
    spec = [InputSpec([None if dynamic_batch else x.shape[0], *x.shape[1:]], x.dtype) for x in steps[0]]
    feature = programs.feature_spec(*steps[0], dynamic_batch=dynamic_batch)
    full = paddle.jit.to_static(programs.full, input_spec=spec, full_graph=full_graph)
    cached = paddle.jit.to_static(programs.cached, input_spec=[feature] + spec, full_graph=full_graph)
    return full, cached


Export = collections.namedtuple("Export", "unet programs steps vanilla eager scheduled folder")


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """``export(full_graph, tome, layers)``: :func:`step_unet` (with ToMe if ``tome``) cached with interval 3 and
    ``layers``, its vanilla
    and eager cached outputs on the STEPS steps of batch 2, its two programs converted for batch 2 and run on the
    fixed schedule, then saved. Each configuration is converted and saved once for the module, by the first test
    that asks for it; the tests only read what it holds."""
    built = {}

    def export(full_graph, tome, layers="auto"):
        if (full_graph, tome, layers) not in built:
            unet = step_unet()
            unet.eval()
            steps = step_inputs(2)
            with paddle.no_grad():
                vanilla = [unet(*args).sample.numpy() for args in steps]
            if tome:
                unet.apply_tome(ratio=0.5, use_rand=False)
            unet.apply_cache(interval=3, layers=layers)
            eager = eager_outputs(unet, steps)
            programs = StepPrograms(unet)
            full, cached = convert(programs, steps, full_graph)
            scheduled = scheduled_outputs(full, cached, programs.config, steps)
            folder = tmp_path_factory.mktemp("programs")
            paddle.jit.save(full, str(folder / "full"))
            paddle.jit.save(cached, str(folder / "cached"))
            built[full_graph, tome, layers] = Export(unet, programs, steps, vanilla, eager, scheduled, folder)
        return built[full_graph, tome, layers]

    return export


def load_programs(folder):
    return paddle.jit.load(str(folder / "full")), paddle.jit.load(str(folder / "cached"))


@pytest.mark.parametrize("full_graph, tome, layers", [(True, False, "auto"), (False, False, "auto"), (True, True, "auto")],
                         ids=["ast", "sot", "ast-tome"])
def test_the_two_programs_convert_save_load_and_give_the_eager_cache_outputs(exports, full_graph, tome, layers):
    done = exports(full_graph, tome, layers)
    assert ppdiffusers_tome.cache_status(done.unet)["UNet2DConditionModel"]["layers"] == (1 if layers else None)
    assert np.abs(done.eager[1] - done.vanilla[1]).max() > 1e-3  # step 1 is cached: it differs from vanilla
    for got, want in zip(done.scheduled, done.eager):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    loaded = load_programs(done.folder)
    for got, want in zip(scheduled_outputs(*loaded, done.programs.config, done.steps), done.eager):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_cached_program_holds_the_layers_that_run_only(exports, layers="auto"):
    done = exports(full_graph=True, tome=False, layers=layers)  # (the programs of the "ast" case above)
    unet = done.unet

    def size(params):
        return sum(int(np.prod(p.shape)) for p in params)

    deep = size(p for _, block in deep_blocks(unet, 1, layers) for p in block.parameters())
    downsampler = size(unet.down_blocks[0].downsamplers.parameters())  # kept like the deep blocks: dropped too
    first_level = size(unet.down_blocks[0].parameters()) - downsampler + size(unet.up_blocks[-1].parameters())
    assert deep > downsampler > 0
    full, cached = load_programs(done.folder)
    assert size(full.parameters()) == size(unet.parameters())
    assert size(cached.parameters()) == size(unet.parameters()) - deep
    # one layer: of the first level only the last up layer (its resnet and transformer) is in the cached program
    last_pair = size(unet.up_blocks[-1].resnets[-1].parameters()) + size(unet.up_blocks[-1].attentions[-1].parameters())
    shallow = size(unet.parameters()) - size(p for _, block in deep_blocks(unet, 1, None) for p in block.parameters())
    expected = shallow - first_level + last_pair if layers else shallow
    assert size(cached.parameters()) == expected


def sd15_layout_unet():
    """SD-1.5's block layout (2 layers per down block, 3 per up block) with narrow channels."""
    return tiny_unet(block_out_channels=(32, 32, 32, 32), layers_per_block=2,
                     down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
                     up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3)


@pytest.mark.parametrize("layers, kept", [(2, "Transformer2DModel"), (None, "CrossAttnUpBlock2D")])
def test_every_branch_of_sd15s_layout_runs_as_two_step_programs_with_the_eager_cache_outputs(layers, kept):
    """Eager step programs (the structure a conversion traces) on SD-1.5's layout at DeepCache's branch 1 and 2."""
    unet = sd15_layout_unet()
    unet.eval()
    steps = step_inputs(2)
    unet.apply_cache(interval=3, layers=layers)
    assert type(get_cache(unet).deep[-1][1]).__name__ == kept  # the layer whose output the cached program takes
    eager = eager_outputs(unet, steps)
    programs = StepPrograms(unet)
    for got, want in zip(scheduled_outputs(programs.full, programs.cached, programs.config, steps), eager):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_a_dynamic_batch_exports_once_and_runs_batches_1_and_3(tmp_path):
    """(With the whole first level, DeepCache's branch 2: the other exported branch.)"""
    unet = ppdiffusers_tome.apply_cache(step_unet(), interval=3, layers=None)
    programs = StepPrograms(unet)
    full, cached = convert(programs, step_inputs(2), full_graph=True, dynamic_batch=True)
    paddle.jit.save(full, str(tmp_path / "full"))
    paddle.jit.save(cached, str(tmp_path / "cached"))
    loaded = paddle.jit.load(str(tmp_path / "full")), paddle.jit.load(str(tmp_path / "cached"))
    for batch in (1, 3):
        steps = step_inputs(batch, seed=batch)
        for got, want in zip(scheduled_outputs(*loaded, programs.config, steps), eager_outputs(unet, steps)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_sdxl_added_conditioning_goes_through_both_programs():
    unet = tiny_sdxl_pipeline().unet
    unet.eval()
    unet.apply_cache(interval=3)
    steps = step_inputs(2, context_dim=unet.config.cross_attention_dim, added=True)
    eager = eager_outputs(unet, steps)
    programs = StepPrograms(unet)
    full, cached = convert(programs, steps, full_graph=True)
    for got, want in zip(scheduled_outputs(full, cached, programs.config, steps), eager):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_cache_and_its_programs_add_no_host_device_transfer_to_the_vanilla_forward():
    """Counted per call site on STEPS steps after a warm-up step; the UNet's own transformers make transfers (they
    are vanilla's), a cached step skips some of them (the mid block's), none is added."""
    unet = step_unet()
    steps = step_inputs(2)

    def transfers(call):
        with paddle.no_grad():
            call(*steps[0])
            with TransferCounter() as counter:
                for args in steps:
                    call(*args)
        return collections.Counter(counter.by_site())

    vanilla = transfers(unet)
    ppdiffusers_tome.apply_cache(unet, interval=3)
    ppdiffusers_tome.reset_cache(unet)
    eager = transfers(unet)
    programs = StepPrograms(unet)
    scheduled = transfers(ScheduledSteps(programs.full, programs.cached, programs.config))
    assert vanilla and not eager - vanilla and not scheduled - vanilla, (vanilla, eager, scheduled)
    assert sum(eager.values()) < sum(vanilla.values())  # cached steps skip the deep blocks' own transfers


def test_wrong_models_and_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="no step cache: call apply_cache"):
        StepPrograms(tiny_unet())
    net = ppdiffusers_tome.apply_cache(tiny_controlnet(tiny_unet()), interval=2)
    with pytest.raises(ValueError, match="no up blocks"):
        StepPrograms(net)
    with pytest.raises(ValueError, match="config must be a CacheConfig"):
        ScheduledSteps(lambda *a: None, lambda *a: None, {"interval": 3})
    assert ScheduledSteps(lambda *a: None, lambda *a: None, CacheConfig(interval=2)).step == 0


def test_tome_inside_the_step_programs_refuses_a_dynamic_latent_size_by_name(tmp_path):
    """ToMe plans on the token grid inside both programs: a dynamic latent height and width once gave a full program
    that ran unmerged, with no error."""
    from ppdiffusers_tome.tome.patch import ToMeStaticGraphError

    unet = step_unet()
    unet.apply_tome(ratio=0.5, use_rand=False)
    unet.apply_cache(interval=3)
    programs = StepPrograms(unet)
    steps = step_inputs(2)
    spec = [InputSpec([None, 4, None, None], "float32"), InputSpec([None], "int64"),
            InputSpec([None, 5, 32], "float32")]
    full = paddle.jit.to_static(programs.full, input_spec=spec, full_graph=True)
    with pytest.raises(ToMeStaticGraphError, match="dynamic latent height and width"):
        paddle.jit.save(full, str(tmp_path / "full"))
    feature = programs.feature_spec(*steps[0])
    feature = InputSpec([None, feature.shape[1], None, None], feature.dtype)
    cached = paddle.jit.to_static(programs.cached, input_spec=[feature] + spec, full_graph=True)
    with pytest.raises(ToMeStaticGraphError, match="dynamic latent height and width"):
        paddle.jit.save(cached, str(tmp_path / "cached"))


def test_scheduled_steps_run_a_full_step_when_the_latent_size_changes_as_the_eager_cache_does():
    """The eager cache compares the whole input shape with the kept step's; ScheduledSteps compared the batch only,
    so a cached step at another height and width reached Paddle's concat with the old feature (a deep error, or a
    program that runs on a mismatched feature). It now runs a full step, counted in ``fallbacks``."""
    from tests.unet_calls import unet_inputs

    unet = ppdiffusers_tome.apply_cache(step_unet(), interval=3)
    programs = StepPrograms(unet)
    steps = [unet_inputs(unet, hw=hw, seed=i) for i, hw in enumerate(((16, 16), (12, 20), (12, 20)))]
    with paddle.no_grad():
        eager = [unet(*args).sample.numpy() for args in steps]
        runner = ScheduledSteps(programs.full, programs.cached, programs.config)
        scheduled = [runner(*args)[0].numpy() for args in steps]
    for got, want in zip(scheduled, eager):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    status = ppdiffusers_tome.cache_status(unet)["UNet2DConditionModel"]
    assert (runner.full_calls, runner.cached_calls, runner.fallbacks) == (2, 1, 1) == \
        (status["full_calls"], status["cached_calls"], status["fallbacks"])
