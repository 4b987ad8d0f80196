"""``bench --calibrate``: refused clearly without a GPU; its logic (what is timed under which settings, the
break-even, the line to paste) checked on the CPU with a stand-in timer."""

import math

import numpy as np
import paddle
import pytest

import ppdiffusers_tome
from ppdiffusers_tome.testing import tiny_sd_pipeline, tiny_sdxl_pipeline
from ppdiffusers_tome.tome.policy import POOL_MIN_WORK
from ppdiffusers_tome.tools import presets
from ppdiffusers_tome.tools.bench.calibrate import CANDIDATES, as_dict, break_even, calibrate, format_calibration
from ppdiffusers_tome.tools.bench.commands import denoiser_forward, finest_tokens
from ppdiffusers_tome.tools.cli import main


@pytest.mark.parametrize("device, message", [
    ("cpu", "--calibrate measures where merging starts to pay on a GPU, so it needs --device gpu"),
    ("gpu", "--device gpu needs a CUDA build of PaddlePaddle"),
])
def test_calibrate_is_refused_without_a_gpu_before_anything_is_built(device, message, capsys, monkeypatch, tmp_path):
    def never(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr(presets, "preset_pipeline", never)
    monkeypatch.setattr(presets, "load_local_pipeline", never)
    code = main(["bench", "--calibrate", "--preset", "tiny", "--device", device, "--output", str(tmp_path)])
    assert code == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def stand_in_timer(pipe, sizes, gains_from):
    """A timer that runs the forward once and answers as a GPU would: vanilla 1 s; the policy's plan 1.25 s below
    ``gains_from`` (batch x tokens^2) and 0.8 s from there; tomesd's plan always 1.1 s. It records the settings each
    candidate ran with."""
    seen = []

    def timer(forward):
        out = forward()
        assert np.isfinite(out.sample.numpy()).all()
        status = ppdiffusers_tome.tome_status(pipe)["unet"]
        settings = status["settings"] if status["active"] else None
        seen.append((sizes[-1], None if settings is None else (settings["policy"], settings["min_work"])))
        if settings is None:
            return 1.0
        if settings["policy"] == "tomesd":
            return 1.1
        return 0.8 if sizes[-1] >= gains_from else 1.25

    return timer, seen


def test_calibrate_times_vanilla_and_each_candidate_at_every_size_and_finds_the_break_even():
    pipe = tiny_sd_pipeline()
    sizes = []

    def forward_for(size, images):
        forward = denoiser_forward(pipe, size, images, seed=0)
        sizes.append(2 * images * finest_tokens(pipe, size) ** 2)
        return forward

    # (the stand-in timer decides what gains, so the forwards can be small: 256 and 1024 tokens)
    works = {(size, images): 2 * images * finest_tokens(pipe, size) ** 2 for size in (32, 64) for images in (1, 2)}
    gains_from = works[64, 1]  # the policy's plan gains from 64 px with one image on
    timer, seen = stand_in_timer(pipe, sizes, gains_from)
    points = calibrate(pipe, [32, 64], [1, 2], forward_for, timer, lambda size: finest_tokens(pipe, size))
    assert [(p.resolution, p.images, p.unet_batch) for p in points] == [(32, 1, 2), (32, 2, 4), (64, 1, 2), (64, 2, 4)]
    assert [p.work for p in points] == [works[p.resolution, p.images] for p in points]
    # per size: vanilla, then every candidate with its settings, nothing left applied afterwards
    expected_settings = [None, ("auto", 0), ("tomesd", None)]
    assert [settings for _, settings in seen] == expected_settings * 4 and list(CANDIDATES) == ["policy", "tomesd"]
    assert ppdiffusers_tome.tome_status(pipe)["unet"]["active"] is None
    losing = max(p.work for p in points if p.work < gains_from)
    found = break_even(points)
    assert found == round(math.sqrt(losing * gains_from)) and losing < found < gains_from
    text = format_calibration(points)
    assert f"pipe.apply_tome(ratio=0.5, min_work={found})" in text and f"{POOL_MIN_WORK:.3g}" in text
    assert "0.80x" in text and "1.25" in text  # the policy's speed-ups and times, side by side
    record = as_dict(points)
    assert record["break_even"] == found and record["points"][0]["speedup"]["tomesd"] == pytest.approx(1 / 1.1)


def test_calibrate_says_so_when_the_plan_never_gains():
    pipe = tiny_sd_pipeline()
    sizes = []
    timer, _ = stand_in_timer(pipe, sizes, gains_from=math.inf)

    def forward_for(size, images):
        sizes.append(0)
        return denoiser_forward(pipe, size, images, seed=0)

    points = calibrate(pipe, [64], [1], forward_for, timer, lambda size: finest_tokens(pipe, size))
    assert break_even(points) is None and "gained at no measured size" in format_calibration(points)


def test_calibrate_takes_tome_off_even_when_a_forward_fails():
    pipe = tiny_sd_pipeline()

    def failing(forward):
        if ppdiffusers_tome.tome_status(pipe)["unet"]["active"]:
            raise RuntimeError("out of memory")
        return 1.0

    with pytest.raises(RuntimeError, match="out of memory"):
        calibrate(pipe, [64], [1], lambda size, n: denoiser_forward(pipe, size, n, 0), failing, lambda size: 64)
    assert ppdiffusers_tome.tome_status(pipe)["unet"]["active"] is None


def test_the_calibrated_tokens_are_those_of_the_finest_level_with_transformer_blocks():
    sd = tiny_sd_pipeline()
    assert finest_tokens(sd, 128) == (128 // sd.vae_scale_factor) ** 2  # SD: transformer blocks at the latent grid
    sdxl = tiny_sdxl_pipeline()
    latent = 128 // sdxl.vae_scale_factor
    assert finest_tokens(sdxl, 128) == (latent // 2) ** 2  # SDXL: its first level has none
    with paddle.no_grad():
        assert denoiser_forward(sdxl, 128, 1, seed=0)().sample.shape[0] == 2  # (one image: UNet batch 2)
