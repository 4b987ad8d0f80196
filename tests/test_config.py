"""ToMeConfig: defaults as tomesd, and every argument validated with a message naming it and its range."""

import dataclasses

import pytest

from ppdiffusers_tome.config import ToMeConfig


def test_defaults_are_tomesds_except_the_automatic_level():
    config = ToMeConfig()
    assert (config.ratio, config.max_downsample, config.sx, config.sy) == (0.5, "auto", 2, 2)
    assert (config.use_rand, config.merge_attn, config.merge_crossattn, config.merge_mlp) == (True, True, False, False)
    assert (config.method, config.recompute_every, config.is_scheduled, config.caches_plans) == ("tome", 1, False, False)


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
        (dict(max_downsample=3), r"max_downsample must be 'auto' or one of \(1, 2, 4, 8\)"),
        (dict(max_downsample=16), r"max_downsample must be 'auto' or one of"),
        (dict(max_downsample="Auto"), r"max_downsample must be 'auto' or one of"),
        (dict(method="tomesd"), r"method must be one of \('tome', 'todo'\)"),
        (dict(method="todo", downsample_factor=1), r"downsample_factor must be an integer in \[2, 8\]"),
        (dict(method="todo", downsample_factor=2.0), r"downsample_factor must be an integer in \[2, 8\]"),
        (dict(method="todo", downsample_mode="bilinear"), r"downsample_mode must be one of \('nearest', 'average'\)"),
        (dict(method="todo", merge_mlp=True), r"merge_attn must be True and merge_crossattn and merge_mlp False"),
        (dict(method="todo", merge_attn=False), r"merge_attn must be True and merge_crossattn and merge_mlp False"),
        (dict(recompute_every=0), r"recompute_every must be an integer >= 1"),
        (dict(recompute_every=[]), r"recompute_every must be an integer >= 1 or a non-empty list"),
        (dict(recompute_every=[0, -3]), r"recompute_every must be an integer >= 1 or a non-empty list"),
        (dict(ratio=(0.6,)), r"ratio as a schedule must be a \(start, end\) pair"),
        (dict(ratio=(0.6, 0.8)), r"ratio end must be in \[0, 0.75\)"),
        (dict(ratio=(-0.1, 0.3)), r"ratio start must be in \[0, 0.75\)"),
        (dict(ratio=lambda p: 0.9 * p), r"ratio\(progress=0.9\) must be in \[0, 0.75\)"),
        (dict(ratio=lambda p: "half"), r"ratio\(progress=0\) must be a number"),
        (dict(ratio=lambda p: 0.3 if p < 0.5 else 1 / (p - 0.5)), r"ratio\(progress\) raised ZeroDivisionError at progress=0.5"),
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


def test_ratio_schedules_give_the_ratio_at_each_progress():
    pair = ToMeConfig(ratio=(0.6, 0.2))
    assert pair.ratio == (0.6, 0.2) and pair.is_scheduled
    assert [round(pair.ratio_at(p), 6) for p in (0.0, 0.25, 1.0, 1.5)] == [0.6, 0.5, 0.2, 0.2]
    assert pair.tokens_to_merge(1000, progress=0.5) == 400
    step = ToMeConfig(ratio=lambda p: 0.5 if p < 0.5 else 0.1)
    assert step.is_scheduled and (step.ratio_at(0.2), step.ratio_at(0.8)) == (0.5, 0.1)
    assert ToMeConfig(ratio=[0.3, 0.3]).ratio == (0.3, 0.3)  # a list is taken as a pair


def test_recompute_every_accepts_a_period_or_sorted_unique_steps():
    assert ToMeConfig(recompute_every=3).recompute_every == 3
    config = ToMeConfig(recompute_every=[10, 0, 5, 5])
    assert config.recompute_every == (0, 5, 10) and config.caches_plans
    assert not ToMeConfig(method="todo", recompute_every=3).caches_plans  # ToDo has no plans to cache
