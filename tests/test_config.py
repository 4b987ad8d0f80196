"""ToMeConfig: defaults as tomesd, and every argument validated with a message naming it and its range."""

import dataclasses

import pytest

from ppdiffusers_tome.config import ToMeConfig


def test_defaults_are_tomesds():
    config = ToMeConfig()
    assert (config.ratio, config.max_downsample, config.sx, config.sy) == (0.5, 1, 2, 2)
    assert (config.use_rand, config.merge_attn, config.merge_crossattn, config.merge_mlp) == (True, True, False, False)


def test_config_is_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ToMeConfig().ratio = 0.3


def test_tokens_to_merge_truncates():
    assert ToMeConfig(ratio=0.5).tokens_to_merge(4096) == 2048
    assert ToMeConfig(ratio=0.3).tokens_to_merge(1000) == 300
    assert ToMeConfig(ratio=0.3).tokens_to_merge(3) == 0


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(ratio=0.75), r"ratio must be in \[0, 0.75\)"),
        (dict(ratio=-0.1), r"ratio must be in \[0, 0.75\)"),
        (dict(ratio=float("nan")), r"ratio must be a number"),
        (dict(ratio="0.5"), r"ratio must be a number"),
        (dict(ratio=True), r"ratio must be a number"),
        (dict(ratio=0.8, sx=2, sy=1), r"ratio must be in \[0, 0.5\) for sx=2, sy=1"),
        (dict(sx=0), r"sx must be an integer >= 1"),
        (dict(sy=1.5), r"sy must be an integer >= 1"),
        (dict(max_downsample=3), r"max_downsample must be one of \(1, 2, 4, 8\)"),
        (dict(max_downsample=16), r"max_downsample must be one of"),
        (dict(use_rand="yes"), r"use_rand must be True or False"),
        (dict(merge_mlp=1), r"merge_mlp must be True or False"),
        (dict(seed=-1), r"seed must be an integer >= 0"),
    ],
)
def test_bad_values_name_the_argument_and_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ToMeConfig(**kwargs)


def test_ratio_zero_is_always_allowed_and_larger_strides_allow_more():
    assert ToMeConfig(ratio=0.0, sx=1, sy=1).ratio == 0.0
    assert ToMeConfig(ratio=0.85, sx=3, sy=3).ratio == 0.85
    assert isinstance(ToMeConfig(ratio=0).ratio, float)
