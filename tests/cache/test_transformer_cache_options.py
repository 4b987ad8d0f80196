"""The step cache's options and lifecycle on transformer-only models, as on UNets: ``start``, ``stop`` and
``full_steps`` choose the full steps of an SD3 pipeline call, ``reset_cache`` starts a directly called transformer at
step 0, threads keep separate histories, a copied transformer keeps its cache; and the refusals of what cannot be
done (a fused ``INFERENCE_OPTIMIZE`` SD3, a static graph of a cached transformer, step programs) name the reason."""


import numpy as np
import paddle
import pytest
from paddle.static import InputSpec

import ppdiffusers_tome
from ppdiffusers_tome.cache.export import StepPrograms
from ppdiffusers_tome.cache.step_cache import CacheConfig, StepCacheError, get_cache
from ppdiffusers_tome.core.registry import hooks_of
from ppdiffusers_tome.testing import tiny_sd3_pipeline, tiny_sd3_transformer
from tests.conftest import generator
from tests.test_sd3_model import NoisePredictor
from tests.thread_runs import alone_and_together
from tests.tome.test_sd3_tome import forward, transformer_inputs

STEPS = 6


def middle_block_steps(transformer):
    """Record the index (0-based, per model call) of the calls in which the middle block of a 3-block transformer
    computes (its first norm runs): at ``depth=1`` only full steps compute it (on a cached step the block is still
    called, and returns its input plus the kept contribution). Returns the record and the hook handles."""
    calls, ran = [0], []
    handles = [transformer.register_forward_post_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)),
               transformer.transformer_blocks[1].norm1.register_forward_pre_hook(lambda *_: ran.append(calls[0]))]
    return ran, handles


@pytest.mark.parametrize("options", [dict(interval=2, start=1, stop=5), dict(interval=3, start=2),
                                     dict(full_steps=(0, 3, 4))], ids=["start-stop", "start", "full-steps"])
def test_start_stop_and_full_steps_choose_the_full_steps_of_an_sd3_pipeline_call(options):
    pipe = tiny_sd3_pipeline().apply_cache(**options)
    ran, handles = middle_block_steps(pipe.transformer)
    for _ in range(2):  # every pipeline call starts at step 0
        images = pipe("a red cube", height=32, width=32, num_inference_steps=STEPS, generator=generator(0),
                      output_type="np").images
    for handle in handles:
        handle.remove()
    full = [step for step in range(STEPS) if CacheConfig(**options).is_full(step)]
    assert ran == full + [STEPS + step for step in full] and len(full) < STEPS
    status = ppdiffusers_tome.cache_status(pipe)["transformer"]
    assert (status["full_calls"], status["cached_calls"]) == (2 * len(full), 2 * (STEPS - len(full)))
    assert np.isfinite(images).all()


def test_reset_cache_starts_a_directly_called_transformer_at_step_0():
    model = tiny_sd3_transformer()
    inputs = [transformer_inputs(batch=2, seed=s, timestep=t) for s, t in enumerate((900.0, 600.0, 300.0))]
    vanilla = [forward(model, x) for x in inputs]
    ppdiffusers_tome.apply_cache(model, interval=3)
    ran, handles = middle_block_steps(model)
    first, cached = forward(model, inputs[0]), forward(model, inputs[1])
    ppdiffusers_tome.reset_cache(model)
    again = forward(model, inputs[2])  # step 0 again: a full step, which computes what the model computes
    for handle in handles:
        handle.remove()
    assert ran == [0, 2]
    np.testing.assert_array_equal(first, vanilla[0])
    np.testing.assert_array_equal(again, vanilla[2])
    assert np.abs(cached - vanilla[1]).max() > 1e-5
    assert ppdiffusers_tome.cache_status(model)["SD3Transformer2DModel"]["full_calls"] == 2


@pytest.mark.parametrize("kept, now", [(1, 7), (7, 10), (7, 1)])
def test_a_text_stream_of_another_length_than_the_kept_steps_runs_a_full_step(kept, now):
    """The kept contribution of the blocks between has the kept step's shape on both streams: a cached step whose
    text stream is longer or shorter is computed in full (a fallback), as one whose image stream differs is. Only
    the image stream was compared: a kept text difference of length 1 was broadcast onto the new text silently."""
    model = tiny_sd3_transformer()
    first = transformer_inputs(batch=2, text_tokens=kept, seed=0, timestep=900.0)
    second = transformer_inputs(batch=2, text_tokens=now, seed=1, timestep=600.0)
    vanilla = forward(model, second)
    ppdiffusers_tome.apply_cache(model, interval=3)
    forward(model, first)
    np.testing.assert_array_equal(forward(model, second), vanilla)  # step 1: full, as the model computes it
    status = ppdiffusers_tome.cache_status(model)["SD3Transformer2DModel"]
    assert (status["full_calls"], status["cached_calls"], status["fallbacks"]) == (2, 0, 1)


def test_a_transformer_with_too_few_blocks_is_refused_naming_its_blocks_in_a_pipeline_too():
    """PaddleMIX's own DiT test pipeline has a 2-block transformer: the pipeline-level refusal said the pipeline had
    no transformer-only model at all; the reason (too few blocks) was only in the model-level message."""
    from ppdiffusers import DiTPipeline

    from ppdiffusers_tome.testing import tiny_dit_pipeline, tiny_dit_transformer

    pipe = DiTPipeline(**dict(tiny_dit_pipeline().components, transformer=tiny_dit_transformer(num_layers=2)))
    reason = r"has 2 transformer_blocks; the step cache needs at least 3 .*depth=1"
    with pytest.raises(ValueError, match=r"DiTPipeline\.transformer \(Transformer2DModel\) " + reason):
        ppdiffusers_tome.apply_cache(pipe)
    with pytest.raises(ValueError, match=r"^Transformer2DModel " + reason):
        ppdiffusers_tome.apply_cache(pipe.transformer)
    assert hooks_of(pipe.transformer) is None  # nothing changed


def test_threads_keep_separate_histories_on_one_cached_transformer():
    model = ppdiffusers_tome.apply_cache(tiny_sd3_transformer(), interval=3)
    streams = [[transformer_inputs(batch=2, seed=10 * k + i, timestep=t) for i, t in enumerate((900.0, 700.0, 500.0))]
               for k in range(2)]

    alone, together = alone_and_together(lambda inputs: forward(model, inputs), streams,
                                         reset=lambda: ppdiffusers_tome.reset_cache(model))
    assert [len(out) for out in alone] == [3, 3]
    for a, b in zip(alone, together):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


# refusals ------------------------------------------------------------------------------------------------------------
def test_the_fused_inference_optimize_transformer_is_refused_by_name_by_apply_cache(monkeypatch):
    monkeypatch.setenv("INFERENCE_OPTIMIZE", "True")
    model = tiny_sd3_transformer(math_attention=False)
    pipe = tiny_sd3_pipeline(math_attention=False)
    monkeypatch.delenv("INFERENCE_OPTIMIZE")
    for target, name in ((model, "SD3Transformer2DModel"), (pipe, "StableDiffusion3Pipeline.transformer")):
        with pytest.raises(ValueError, match=f"{name} was built with .*INFERENCE_OPTIMIZE=True") as refused:
            ppdiffusers_tome.apply_cache(target, interval=3)
        assert "step cache" in str(refused.value) and "Unset INFERENCE_OPTIMIZE" in str(refused.value)
    assert hooks_of(model) is None and hooks_of(pipe.transformer) is None


def test_a_cached_transformer_refuses_a_static_graph_and_step_programs_naming_what_exports():
    transformer = ppdiffusers_tome.apply_cache(tiny_sd3_transformer(), interval=3)
    with pytest.raises(ValueError, match="SD3Transformer2DModel is a transformer-only model.*remove_cache"):
        StepPrograms(transformer)
    spec = [InputSpec([None, 16, 16, 16], "float32"), InputSpec([None, 7, 96], "float32"),
            InputSpec([None, 64], "float32"), InputSpec([None], "float32")]
    static = paddle.jit.to_static(NoisePredictor(transformer), input_spec=spec, full_graph=True)
    with pytest.raises(StepCacheError, match="transformer-only model.*remove_cache.*ToMe alone exports") as refused:
        paddle.jit.save(static, "/tmp/never_written_cached_sd3")
    assert "StepPrograms" not in str(refused.value)
    assert get_cache(transformer) is not None
