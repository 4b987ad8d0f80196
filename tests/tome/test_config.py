"""ToMeConfig: defaults as tomesd, and every argument validated with a message naming it and its range."""

import dataclasses

import pytest

from ppdiffusers_tome.tome.config import ToMeConfig


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


# huge strides, and values of the wrong kind (arrays, tensors, numpy scalars, ...)
def test_strides_are_bounded_with_a_message_naming_the_argument_and_range():
    from ppdiffusers_tome.tome.config import MAX_STRIDE

    assert MAX_STRIDE == 64
    config = ToMeConfig(sx=MAX_STRIDE, sy=MAX_STRIDE, ratio=0.9)  # the largest cell is allowed (and a high ratio)
    assert (config.sx, config.sy) == (64, 64)
    for name, value in [("sx", 65), ("sy", 10**4), ("sx", 10**6), ("sy", 2**40), ("sx", 10**400)]:
        with pytest.raises(ValueError, match=rf"^{name} must be an integer >= 1 and <= 64 .*; got {str(value)[:50]}"):
            ToMeConfig(**{name: value})


def _odd_values():
    import numpy as np
    import paddle

    return {
        "np_array_1": np.array([2]),
        "np_array_2": np.array([2, 1]),
        "np_array_0d": np.array(2),
        "np_str_array": np.array(["tome"]),
        "np_int": np.int64(2),
        "np_uint": np.uint8(3),
        "np_float": np.float32(0.25),
        "np_bool": np.bool_(True),
        "np_nan": np.float64("nan"),
        "tensor_int": paddle.to_tensor(2),
        "tensor_float": paddle.to_tensor(0.5),
        "tensor_vector": paddle.to_tensor([1, 2]),
        "tensor_bool": paddle.to_tensor(True),
        "list": [2],
        "list_of_lists": [[2]],
        "dict": {"value": 2},
        "none": None,
        "nan": float("nan"),
        "inf": float("inf"),
        "true": True,
        "false": False,
        "huge_int": 10**400,
        "big_int": 2**64,
        "negative_huge": -(10**400),
        "string_number": "2",
        "np_str": np.str_("todo"),
    }


FIELDS = [f.name for f in dataclasses.fields(ToMeConfig)]
PLAIN = (bool, int, float, str, tuple)


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("kind", sorted(_odd_values()))
def test_every_field_accepts_a_plain_equivalent_or_raises_a_value_error_naming_it(field, kind):
    value = _odd_values()[kind]
    kwargs = {field: value}
    if field in ("downsample_factor", "downsample_mode"):
        kwargs["method"] = "todo"  # where these options matter
    try:
        config = ToMeConfig(**kwargs)
    except ValueError as error:  # anything else (AssertionError, TypeError, OverflowError) fails the test
        message = str(error)
        assert message.startswith(field), message
        assert "\n" not in message and len(message) < 400, message  # one readable line, even for a tensor
        return
    stored = getattr(config, field)
    if stored is None:  # only match_window (global matching) and min_work (the policy's default) take None
        assert field in ("match_window", "min_work") and value is None
        return
    # accepted: then it is stored as the plain Python value, never as an array, a tensor or a numpy scalar
    assert type(stored) in PLAIN, (field, kind, type(stored))
    if isinstance(stored, tuple):
        assert all(type(v) in (int, float) for v in stored), stored


@pytest.mark.parametrize(
    "field,value,expected",
    [
        ("sx", "np_int", 2),
        ("sy", "np_uint", 3),
        ("seed", "np_int", 2),
        ("seed", "huge_int", 10**400),  # any integer seeds numpy's SeedSequence
        ("max_downsample", "np_int", 2),
        ("downsample_factor", "np_int", 2),
        ("recompute_every", "np_int", 2),
        ("recompute_every", "list", (2,)),
        ("recompute_every", "huge_int", 10**400),  # never recompute after the first step
        ("ratio", "np_float", 0.25),
        ("use_rand", "np_bool", True),
        ("merge_mlp", "np_bool", True),
        ("method", "np_str", "todo"),
    ],
)
def test_unambiguous_equivalents_are_accepted_as_plain_values(field, value, expected):
    config = ToMeConfig(**{field: _odd_values()[value]})
    stored = getattr(config, field)
    assert stored == expected and type(stored) is type(expected)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("max_downsample", "tensor_vector", r"^max_downsample must be 'auto' or one of \(1, 2, 4, 8\); got Tensor"),
        ("max_downsample", "np_array_2", r"^max_downsample must be 'auto' or one of .*; got array\(\[2, 1\]\)"),
        ("method", "tensor_vector", r"^method must be one of \('tome', 'todo'\); got Tensor"),
        ("method", "np_str_array", r"^method must be one of \('tome', 'todo'\); got array\(\['tome'\]"),
        ("downsample_mode", "np_array_2", r"^downsample_mode must be one of \('nearest', 'average'\)"),
        ("ratio", "huge_int", r"^ratio must be in \[0, 0.75\)"),
        ("ratio", "tensor_float", r"^ratio must be a number in \[0, 0.75\), a \(start, end\) pair or a callable"),
        ("ratio", "np_array_0d", r"pass a plain Python value"),
        ("sx", "tensor_int", r"^sx must be an integer >= 1 and <= 64 .*pass a plain Python value"),
        ("use_rand", "tensor_bool", r"^use_rand must be True or False"),
        ("seed", "nan", r"^seed must be an integer >= 0"),
        ("recompute_every", "np_array_2", r"^recompute_every must be an integer >= 1 or a non-empty list"),
    ],
)
def test_arrays_and_tensors_get_the_arguments_own_message(field, value, message):
    with pytest.raises(ValueError, match=message):
        ToMeConfig(**{field: _odd_values()[value]})


def test_a_callable_ratio_returning_odd_values_is_refused_by_name():
    import numpy as np

    with pytest.raises(ValueError, match=r"^ratio\(progress=0\) must be in \[0, 0.75\)"):
        ToMeConfig(ratio=lambda p: 10**400)
    with pytest.raises(ValueError, match=r"^ratio\(progress=0\) must be a number in \[0, 0.75\); got array"):
        ToMeConfig(ratio=lambda p: np.array([0.5, 0.5]))
    assert ToMeConfig(ratio=lambda p: np.float32(0.5)).ratio_at(0.5) == 0.5


# ToDo does not use ratio/sx/sy/use_rand/recompute_every, so it does not hold the ratio to the stride
# limit; they are still checked for their type, so garbage fails with a message naming the argument
def test_todo_ignores_the_stride_limit_of_the_ratio_but_still_checks_its_type():
    assert ToMeConfig(method="todo", ratio=0.9).ratio == 0.9  # above 1 - 1/(sx*sy) = 0.75: ToDo does not use it
    assert ToMeConfig(method="todo", ratio=0.9, sx=1, sy=1).ratio == 0.9
    assert ToMeConfig(method="todo", ratio=(0.95, 0.8)).ratio == (0.95, 0.8)
    calls = []
    schedule = lambda p: calls.append(p) or 5.0  # noqa: E731 - out of range, but ToDo never calls it
    assert ToMeConfig(method="todo", ratio=schedule).ratio is schedule and calls == []
    with pytest.raises(ValueError, match=r"ratio must be in \[0, 0.75\)"):
        ToMeConfig(method="tome", ratio=0.9)  # ToMe keeps the limit
    for value, where in [(1.0, ""), (-0.1, ""), (float("nan"), ""), ("0.5", ""), (True, ""), ((0.5, 1.5), " end")]:
        with pytest.raises(ValueError, match=rf"^ratio{where} must be a number in \[0, 1\) \(method='todo' does not"):
            ToMeConfig(method="todo", ratio=value)
    for kwargs, message in [
        (dict(sx=0), r"^sx must be an integer >= 1 and <= 64"),
        (dict(sy=2.5), r"^sy must be an integer >= 1 and <= 64"),
        (dict(use_rand="yes"), r"^use_rand must be True or False"),
        (dict(recompute_every=0), r"^recompute_every must be an integer >= 1"),
        (dict(recompute_every=[-1]), r"^recompute_every must be an integer >= 1 or a non-empty list"),
    ]:
        with pytest.raises(ValueError, match=message):
            ToMeConfig(method="todo", **kwargs)


def test_a_todo_patch_with_a_ratio_above_the_stride_limit_runs_as_todo_does():
    import numpy as np
    import paddle

    from ppdiffusers_tome import apply_tome, remove_tome
    from ppdiffusers_tome.testing import tiny_unet

    unet = tiny_unet()
    sample = paddle.to_tensor(np.random.default_rng(0).standard_normal([2, 4, 16, 16]).astype("float32"))
    text = paddle.to_tensor(np.random.default_rng(1).standard_normal([2, 16, 32]).astype("float32"))

    def forward():
        with paddle.no_grad():
            return unet(sample, paddle.to_tensor(500), encoder_hidden_states=text).sample.numpy()

    apply_tome(unet, method="todo", downsample_factor=2)
    plain = forward()
    apply_tome(unet, method="todo", downsample_factor=2, ratio=(0.9, 0.1), sx=1, sy=1, recompute_every=[0, 3])
    ignored = forward()
    remove_tome(unet)
    np.testing.assert_array_equal(ignored, plain)  # the unused options change nothing
    assert np.abs(forward() - plain).max() > 1e-4  # and ToDo did act: vanilla differs
