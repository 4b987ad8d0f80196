"""ToDo's own settings and door: ``ToDoConfig`` checks each option by name, ``apply_tome(method="todo")`` is a
translating alias of ``apply_todo``, ToDo and ToMe share a model's slot, the policy's K/V pooling is ToDo's plan at
its defaults, and one set of action constants names what a block call does."""

import warnings

import numpy as np
import paddle
import pytest

import ppdiffusers_tome
from ppdiffusers_tome import ToDoConfig, ToMeConfig
from ppdiffusers_tome.testing import gpu_kernels, tiny_unet
from ppdiffusers_tome.tome.actions import Action
from ppdiffusers_tome.tome.decision import BlockDecision, Settings, decide_block, grid_of
from ppdiffusers_tome.tome.patch import find_blocks, get_patch
from ppdiffusers_tome.tome.policy import Policy
from ppdiffusers_tome.tome.todo import DEFAULT_TODO, technique_config
from tests.unet_calls import unet_inputs


@pytest.mark.parametrize("options, message", [
    (dict(factor=1), r"^factor must be an integer in \[2, 8\]; got 1$"),
    (dict(factor=2.0), r"^factor must be an integer in \[2, 8\]; got 2.0$"),
    (dict(factor=True), r"^factor must be an integer in \[2, 8\]; got True$"),
    (dict(mode="bilinear"), r"^mode must be one of \('nearest', 'average'\); got 'bilinear'$"),
    (dict(max_downsample=3), r"^max_downsample must be 'auto' or one of \(1, 2, 4, 8\); got 3$"),
    (dict(min_tokens=-1), r"^min_tokens must be an integer >= 0 \(downsample only where batch \* tokens reaches it\)"),
    (dict(policy="fast"), r"^policy must be one of \('auto', 'tomesd'\); got 'fast'$"),
    (dict(min_work=-5), r"^min_work must be None .* >= 0 \(downsample only in blocks where batch \* tokens\*\*2"),
    (dict(policy="tomesd", min_work=0), r"^min_work=0 is a threshold of policy='auto'; policy='tomesd' downsamples"),
])
def test_todo_config_names_the_argument_and_its_range(options, message):
    with pytest.raises(ValueError, match=message):
        ToDoConfig(**options)
    with pytest.raises(ValueError, match=message):  # the door checks before touching anything
        ppdiffusers_tome.apply_todo(tiny_unet(), **options)


def test_todo_config_stores_plain_values_and_translates_the_old_form():
    config = ToDoConfig(factor=np.int64(4), max_downsample=np.int64(2), min_tokens=np.int64(8))
    assert (type(config.factor), type(config.max_downsample), type(config.min_tokens)) == (int, int, int)
    old = ToMeConfig(method="todo", downsample_factor=4, downsample_mode="average", max_downsample=2, min_tokens=8,
                     policy="tomesd", ratio=0.9, sx=1)  # (ToMe's own options: not ToDo's)
    assert technique_config(old) == ToDoConfig(factor=4, mode="average", max_downsample=2, min_tokens=8,
                                               policy="tomesd")
    assert technique_config(ToMeConfig()) == ToMeConfig() and technique_config(config) is config


def test_apply_todo_and_the_alias_give_the_same_outputs_and_report_what_was_given():
    sample, timestep, context = unet_inputs(tiny_unet(), batch=2)
    outputs = []
    for apply in (lambda unet: ppdiffusers_tome.apply_todo(unet, factor=4, mode="average"),
                  lambda unet: ppdiffusers_tome.apply_tome(unet, method="todo", downsample_factor=4,
                                                           downsample_mode="average"),
                  lambda unet: unet.apply_todo(ToDoConfig(factor=4), mode="average")):
        unet = apply(tiny_unet())
        with paddle.no_grad():
            outputs.append(unet(sample, timestep, context).sample.numpy())
        assert get_patch(unet).runner.config == ToDoConfig(factor=4, mode="average")
        assert ppdiffusers_tome.tome_stats(unet)["UNet2DConditionModel"]["merges"] > 0
    np.testing.assert_array_equal(outputs[0], outputs[1])
    np.testing.assert_array_equal(outputs[0], outputs[2])
    # tome_config and tome_status report the config as it was given
    unet = ppdiffusers_tome.apply_tome(tiny_unet(), method="todo")
    assert ppdiffusers_tome.tome_config(unet).method == "todo"
    unet = ppdiffusers_tome.apply_todo(tiny_unet(), factor=4)
    assert ppdiffusers_tome.tome_config(unet) == ToDoConfig(factor=4)
    assert ppdiffusers_tome.tome_status(unet)["UNet2DConditionModel"]["settings"]["factor"] == 4


def test_apply_todo_refuses_another_config_and_unknown_options_by_name():
    with pytest.raises(ValueError, match=r"^config must be None or a ToDoConfig; got ToMeConfig"):
        ppdiffusers_tome.apply_todo(tiny_unet(), ToMeConfig())
    with pytest.raises(ValueError, match=r"the factor is a keyword: apply_todo\(model, factor=4\)"):
        ppdiffusers_tome.apply_todo(tiny_unet(), 4)
    with pytest.raises(ValueError, match=r"^apply_todo got unknown option\(s\) ratio; the options are the fields of "
                                         r"ToDoConfig: factor, mode, max_downsample, min_tokens, policy, min_work$"):
        ppdiffusers_tome.apply_todo(tiny_unet(), ratio=0.5)


def test_todo_and_tome_share_a_models_slot_and_remove_todo_leaves_tome():
    unet = ppdiffusers_tome.apply_tome(tiny_unet(), ratio=0.4)
    ppdiffusers_tome.remove_todo(unet)  # ToMe is not ToDo: it stays
    assert ppdiffusers_tome.tome_config(unet) == ToMeConfig(ratio=0.4)
    unet.apply_todo()  # replaces ToMe
    assert ppdiffusers_tome.tome_config(unet) == ToDoConfig()
    assert unet.remove_todo() is unet and ppdiffusers_tome.tome_config(unet) is None
    unet = ppdiffusers_tome.apply_tome(tiny_unet(), method="todo")
    assert ppdiffusers_tome.remove_todo(unet) is unet and get_patch(unet) is None  # the alias is ToDo too


def test_the_policys_pooling_is_todos_plan_at_its_defaults():
    unet = tiny_unet()
    settings = Settings(ToMeConfig(min_work=0), unet, find_blocks(unet))
    pooled = decide_block(settings, 256, 2, grid_of(settings, (16, 16), 256), 1, "gpu", 0.5)
    todo = Settings(ToDoConfig(policy="tomesd"), unet, find_blocks(unet))
    downsampled = decide_block(todo, 256, 2, grid_of(todo, (16, 16), 256), 1, "gpu", 0.5)
    assert (pooled.action, downsampled.action) == (Action.POOL, Action.TODO)
    assert pooled.downsample == downsampled.downsample == (DEFAULT_TODO.factor, DEFAULT_TODO.mode) == (2, "nearest")
    assert Settings(ToDoConfig(factor=4, mode="average"), unet, find_blocks(unet)).downsample == (4, "average")
    # and the same plan runs: the pooled UNet's output is ToDo's at its defaults
    sample, timestep, context = unet_inputs(unet, batch=2)
    outputs = []
    for apply in (lambda m: ppdiffusers_tome.apply_tome(m, min_work=0), lambda m: ppdiffusers_tome.apply_todo(m, min_work=0)):
        model = apply(tiny_unet())
        with gpu_kernels(), paddle.no_grad():
            outputs.append(model(sample, timestep, context).sample.numpy())
    assert ppdiffusers_tome.tome_stats(model)["UNet2DConditionModel"]["merges"] > 0
    np.testing.assert_array_equal(outputs[0], outputs[1])


def test_one_set_of_action_constants_and_the_old_names_warn_and_point_to_it():
    unet = tiny_unet()
    actions = set()
    for options, kernels, tokens in ((dict(), "cpu", 256), (dict(merge_attn=False), "cpu", 256),
                                     (dict(), "gpu", 256), (dict(min_work=0), "gpu", 256),
                                     (dict(method="todo", policy="tomesd"), "gpu", 256), (dict(), "cpu", 64)):
        settings = Settings(ToMeConfig(**options), unet, find_blocks(unet))
        actions.add(decide_block(settings, tokens, 2, grid_of(settings, (16, 16), tokens), 1, kernels, 0.5).action)
        actions.add(Policy(ToMeConfig(**options)).choose_plan_for(kernels, 2, tokens).action)
    assert actions == set(Action.ALL)
    assert BlockDecision(Action.MERGE, "merge", "").action == "merge"  # plain strings, as tome_status shows them
    import ppdiffusers_tome.tome.decision as decision

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = (decision.decide, decision.OFF, decision.SKIPPED, decision.POOLED, decision.TODO, decision.MERGE)
        chosen = Policy(ToMeConfig()).decide_shape("gpu", 2, 256)
    assert old == (decide_block, Action.OFF, Action.SKIP, Action.POOL, Action.TODO, Action.MERGE)
    assert chosen.action == Action.SKIP
    assert len(caught) == 7 and all(w.category is FutureWarning for w in caught)
    assert "ppdiffusers_tome.tome.decision.SKIPPED is ppdiffusers_tome.tome.actions.Action.SKIP" in str(caught[2].message)
    with pytest.raises(AttributeError):
        decision.no_such_name  # noqa: B018
    from ppdiffusers_tome.tome import policy

    assert not {"MERGE", "POOL", "SKIP"} & set(vars(policy))  # the policy's own copy is gone


def test_the_remove_method_resolves_its_models_once_and_returns_them(monkeypatch):
    """``pipe.remove_tome(only_return_self=False)`` (the signature of ppdiffusers' built-in method) returns the models
    it took ToMe off, resolved once."""
    import ppdiffusers_tome.api as api
    from ppdiffusers_tome.testing import tiny_controlnet_pipeline

    pipe = tiny_controlnet_pipeline().apply_tome(ratio=0.5)
    resolved = []
    real = api._targets
    monkeypatch.setattr(api, "_targets", lambda *args, **kwargs: resolved.append(kwargs["what"]) or real(*args, **kwargs))
    same, models = pipe.remove_tome(only_return_self=False)
    assert same is pipe and models == [pipe.unet, pipe.controlnet] and resolved == ["remove_tome"]
    assert ppdiffusers_tome.tome_config(pipe) is None
