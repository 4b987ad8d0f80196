"""ppdiffusers' built-in ToMe port: a failure half-way through apply_tome leaves it (and this package's earlier
patch) exactly as it was; a success replaces it on every model."""

import numpy as np
import paddle
import pytest

import ppdiffusers_tome
from ppdiffusers_tome.testing import tiny_unet
from ppdiffusers_tome.tome.patch import ModelPatch, get_patch

# items 1, 5, 6, 7, 9: threads, a retry after a fault, early exceptions, non-finite timesteps ----------------------
from tests.unet_calls import hook_counts, hook_shape, hook_tables, unet_output


# rollback with ppdiffusers' built-in port -------------------------------------------------------------------------
def builtin_apply(model, **kwargs):
    return paddle.nn.Layer.apply_tome(model, **kwargs)  # ppdiffusers' own port, still attached to nn.Layer


def builtin_snapshot(model):
    """Everything the built-in port put on ``model``: block classes, ``_tome_info`` objects, hook handles."""
    layers = model.sublayers(include_self=True)
    infos = [layer.__dict__.get("_tome_info") for layer in layers]
    return {
        "classes": [type(layer) for layer in layers],
        "infos": [id(info) if info is not None else None for info in infos],
        "handles": [list(info["hooks"]) if info is not None else None for info in infos],
        "args": [dict(info["args"]) if info is not None else None for info in infos],
        "hooks": hook_tables(model),
    }


def fail_install_on(monkeypatch, victim):
    real_install = ModelPatch.install.__func__

    def install(cls, model, *args, **kwargs):
        if model is victim:
            raise RuntimeError("install failed half-way")
        return real_install(cls, model, *args, **kwargs)

    monkeypatch.setattr(ModelPatch, "install", classmethod(install))


@pytest.mark.parametrize("second_has_builtin", [False, True])
def test_a_failure_half_way_leaves_the_builtin_port_exactly_as_it_was(monkeypatch, second_has_builtin):
    first, second = tiny_unet(), tiny_unet(seed=1)
    vanilla = unet_output(first)
    builtin_apply(first, ratio=0.5, use_rand=False)
    if second_has_builtin:
        builtin_apply(second, ratio=0.6, use_rand=False)
    with_builtin = unet_output(first)
    assert np.abs(with_builtin - vanilla).max() > 1e-4  # the built-in port is active
    assert any(type(m).__name__.startswith("ToMe") for m in first.sublayers())
    before = [builtin_snapshot(first), builtin_snapshot(second)]
    second_before = unet_output(second)

    fail_install_on(monkeypatch, second)
    with pytest.raises(RuntimeError, match="install failed half-way"):
        ppdiffusers_tome.apply_tome([first, second], ratio=0.4)

    assert get_patch(first) is None and get_patch(second) is None
    assert [builtin_snapshot(first), builtin_snapshot(second)] == before  # same classes, objects and hooks
    np.testing.assert_array_equal(unet_output(first), with_builtin)  # the built-in hooks still feed it sizes
    np.testing.assert_array_equal(unet_output(second), second_before)
    paddle.nn.Layer.remove_tome(first)  # and the built-in port can still take itself off
    np.testing.assert_array_equal(unet_output(first), vanilla)


def test_a_failure_half_way_puts_back_this_packages_patch_and_keeps_a_builtin_one(monkeypatch):
    ours, builtin, failing = tiny_unet(), tiny_unet(), tiny_unet(seed=1)
    ppdiffusers_tome.apply_tome(ours, ratio=0.3, seed=2)
    ours_output = unet_output(ours)
    builtin_apply(builtin, ratio=0.5, use_rand=False)
    builtin_output, snapshot = unet_output(builtin), builtin_snapshot(builtin)

    fail_install_on(monkeypatch, failing)
    with pytest.raises(RuntimeError, match="install failed half-way"):
        ppdiffusers_tome.apply_tome([ours, builtin, failing], ratio=0.6)

    assert ppdiffusers_tome.tome_config(ours).ratio == 0.3 and get_patch(builtin) is None
    np.testing.assert_array_equal(unet_output(ours), ours_output)
    assert builtin_snapshot(builtin) == snapshot
    np.testing.assert_array_equal(unet_output(builtin), builtin_output)


def test_success_still_replaces_the_builtin_port_on_every_target():
    first, second, fresh = tiny_unet(), tiny_unet(), tiny_unet()
    builtin_apply(first, ratio=0.5, use_rand=False)
    builtin_apply(second, ratio=0.5, use_rand=False)
    ppdiffusers_tome.apply_tome([first, second], ratio=0.5, use_rand=False)
    ppdiffusers_tome.apply_tome(fresh, ratio=0.5, use_rand=False)
    for model in (first, second):
        assert not any(type(m).__name__.startswith("ToMe") for m in model.sublayers(include_self=True))
        assert not any("_tome_info" in m.__dict__ for m in model.sublayers(include_self=True))
        assert hook_shape(model) == hook_shape(fresh)  # same hooks on layers of the same classes
        np.testing.assert_array_equal(unet_output(model), unet_output(fresh))
    vanilla = hook_counts(tiny_unet())
    ppdiffusers_tome.remove_tome([first, second])
    for model in (first, second):  # neither the port's classes nor ours are left underneath
        assert hook_counts(model) == vanilla
        np.testing.assert_array_equal(unet_output(model), unet_output(tiny_unet()))
