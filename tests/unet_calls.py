"""UNet calls and hand-written references shared by the tests of the patch, the planner and the static graph."""

import contextlib
import threading

import numpy as np
import paddle

from ppdiffusers_tome.core.registry import hooks_of
from ppdiffusers_tome.tome.patch import find_blocks, get_patch


def unet_inputs(unet, batch=2, hw=(16, 16), seed=0):
    rng = np.random.default_rng(seed)
    sample = paddle.to_tensor(rng.standard_normal((batch, 4, *hw)).astype("float32"))
    context = paddle.to_tensor(rng.standard_normal((batch, 5, unet.config.cross_attention_dim)).astype("float32"))
    return sample, paddle.to_tensor([500] * batch, dtype="int64"), context


def hook_counts(layer):
    """What is attached to every sub-layer of ``layer`` (``include_self``), in order: its class (a hooked layer has a
    class of its own), the names of its hooks in this package's registry (outermost first; ``()`` without a
    registry), and how many Paddle forward pre- and post-hooks it has (ppdiffusers' built-in port and a user's own
    hooks live there; this package adds none). Equal before ``apply_*`` and after ``remove_*``: the model is exactly
    as it was."""
    rows = []
    for m in layer.sublayers(include_self=True):
        registry = hooks_of(m)
        names = tuple(registry.names()) if registry is not None else ()
        rows.append((type(m), names, len(m._forward_pre_hooks), len(m._forward_post_hooks)))
    return rows


def hooks_attached(layer):
    """How many hooks are attached to ``layer`` and its sub-layers: registry hooks plus Paddle forward hooks."""
    return sum(len(names) + pre + post for _, names, pre, post in hook_counts(layer))


def expected_block_output(block, x, context, plan, merge_attn=True, merge_cross=False, merge_mlp=False):
    """BasicTransformerBlock with tomesd's placement, written out by hand: merge the normed input of a sub-layer,
    unmerge its output before the residual add."""
    identity = lambda t: t  # noqa: E731
    m, u = plan
    ma, ua = (m, u) if merge_attn else (identity, identity)
    mc, uc = (m, u) if merge_cross else (identity, identity)
    mm, um = (m, u) if merge_mlp else (identity, identity)
    x = ua(block.attn1(ma(block.norm1(x)))) + x
    x = uc(block.attn2(mc(block.norm2(x)), encoder_hidden_states=context)) + x
    return um(block.ff(mm(block.norm3(x)))) + x


def plans_seen(unet, calls):
    """Run ``calls`` (each a kwargs dict for the UNet) and return the first block's plan object in each."""
    patch, seen = get_patch(unet), []
    handle = find_blocks(unet)[0][1].attn1.register_forward_pre_hook(lambda layer, args: seen.append(patch.plan_in_flight(0)))
    with paddle.no_grad():
        for kwargs in calls:
            unet(**kwargs)
    handle.remove()
    return seen


def dst_positions_seen(unet, calls):
    """The dst positions of the first block's plan in each of ``calls``."""
    return [plan.dst_pos.numpy() for plan in plans_seen(unet, calls)]


def unet_output(unet, seed=0):
    """The UNet's no-grad output on :func:`unet_inputs` drawn with ``seed``."""
    sample, t, context = unet_inputs(unet, seed=seed)
    with paddle.no_grad():
        return unet(sample, t, context).sample.numpy()


def forward(unet, sample, timestep, context):
    with paddle.no_grad():
        return unet(sample, timestep, context).sample.numpy()


def hook_tables(model):
    """Every hook of every sub-layer, in order: ``(layer index, class, "registry", hook name, hook object)`` for this
    package's registry (outermost first) and ``(layer index, class, table, hook id, hook object)`` for Paddle's
    forward hook tables. Equal (hook objects compared by identity) when nothing was taken off, added or swapped."""
    rows = []
    for i, layer in enumerate(model.sublayers(include_self=True)):
        registry = hooks_of(layer)
        if registry is not None:
            rows.extend((i, type(layer), "registry", name, registry.get(name)) for name in registry.names())
        for table in ("_forward_pre_hooks", "_forward_post_hooks"):
            rows.extend((i, type(layer), table, hook_id, hook) for hook_id, hook in getattr(layer, table).items())
    return rows


def hook_shape(model):
    """:func:`hook_tables` without the objects: which layer (and its class) holds which kind of hook, to compare two
    models (a copy and its original, a patched model and a fresh one patched the same way)."""
    return [(i, cls, where, key if where == "registry" else None, type(hook).__name__)
            for i, cls, where, key, hook in hook_tables(model)]


def sdxl_call(unet=None, seed=5):
    """Inputs of a tiny SDXL-style UNet call: ``(args, kwargs)`` with the added conditioning."""
    rng = np.random.default_rng(seed)
    sample = paddle.to_tensor(rng.standard_normal((2, 4, 16, 16)).astype("float32"))
    context = paddle.to_tensor(rng.standard_normal((2, 5, 64)).astype("float32"))
    added = {"text_embeds": paddle.to_tensor(rng.standard_normal((2, 32)).astype("float32")),
             "time_ids": paddle.to_tensor([[32.0, 32, 0, 0, 32, 32]] * 2)}
    return (sample, paddle.to_tensor([500, 500]), context), dict(added_cond_kwargs=added)


@contextlib.contextmanager
def call_held_inside_forward(unet, seed=0):
    """Run ``unet_output(unet, seed)`` in another thread, held inside its forward (at the first transformer block's
    cross-attention, after its self-attention ran on merged tokens) until the ``with`` body ends. Yields a dict whose
    "output" (or "error") the thread fills in."""
    entered, release, result = threading.Event(), threading.Event(), {}
    worker_ident = []

    def hold(layer, inputs):
        if threading.get_ident() in worker_ident:
            entered.set()
            assert release.wait(60)

    handle = find_blocks(unet)[0][1].attn2.register_forward_pre_hook(hold)

    def run():
        worker_ident.append(threading.get_ident())
        try:
            result["output"] = unet_output(unet, seed)
        except BaseException as error:  # reported by the main thread
            result["error"] = error

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    try:
        assert entered.wait(60), result.get("error")
        yield result
    finally:
        release.set()
        worker.join(60)
        handle.remove()
    assert not worker.is_alive()
    if "error" in result:
        raise result["error"]


def step_sample(seed):
    rng = np.random.default_rng(seed)
    return paddle.to_tensor(rng.standard_normal((2, 4, 16, 16)).astype("float32"))
