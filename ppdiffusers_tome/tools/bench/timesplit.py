"""Where one denoiser forward spends its time: self-attention, ToMe's matching (plans, merges, unmerges) and the
rest (:func:`time_split`), timed with forward hooks around every self-attention and wrappers around the matching."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import paddle
from ppdiffusers.patches import tomesd_patch_utils

from ... import api
from ...tome.patch import ModelPatch, find_blocks, get_patch
from .devices import Device, default_device
from .inputs import DenoiserInputs
from .methods import APPLIED, BenchSettings, Method, configure


class SplitClock:
    """Adds up the seconds spent in self-attention and in matching while its hooks are installed.

    Inner hooks sit right around each attention layer; outer ones (for this package's methods, whose merge and
    unmerge hooks also sit on ``attn1``) around those too, so their difference is matching. Every clock read waits
    for the device first (``sync``)."""

    def __init__(self, sync: Callable[[], None]):
        self.sync = sync
        self.attention = 0.0
        self.matching = 0.0
        self.handles: list[Any] = []
        self._outer_start: dict[int, float] = {}
        self._inner_start: dict[int, float] = {}
        self._inner_seconds: dict[int, float] = {}

    def now(self) -> float:
        """The clock, once the device has finished its queued work."""
        self.sync()
        return time.perf_counter()

    def _outer_pre(self, layer, args) -> None:
        self._outer_start[id(layer)] = self.now()

    def _inner_pre(self, layer, args) -> None:
        self._inner_start[id(layer)] = self.now()

    def _inner_post(self, layer, args, output) -> None:
        self._inner_seconds[id(layer)] = self.now() - self._inner_start[id(layer)]
        self.attention += self._inner_seconds[id(layer)]

    def _outer_post(self, layer, args, output) -> None:
        self.matching += self.now() - self._outer_start[id(layer)] - self._inner_seconds[id(layer)]

    def hook(self, layer: paddle.nn.Layer, outer: bool) -> None:
        """Time ``layer`` (a self-attention) as attention, and with ``outer`` the hooks around it as matching."""
        self.handles.append(layer.register_forward_pre_hook(self._inner_pre))
        self.handles.append(layer.register_forward_post_hook(self._inner_post, prepend=True))
        if outer:
            self.handles.append(layer.register_forward_pre_hook(self._outer_pre, prepend=True))
            self.handles.append(layer.register_forward_post_hook(self._outer_post))

    def timed(self, fn: Callable) -> Callable:
        """``fn`` with its time counted as matching."""

        def wrapper(*args):
            began = self.now()
            try:
                return fn(*args)
            finally:
                self.matching += self.now() - began

        return wrapper

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _time_builtin_matching(clock: SplitClock) -> Callable[[], None]:
    """Time the built-in port's matching, which runs inside its copied block forward: wrap its ``compute_merge``
    and the merge/unmerge functions it returns. Returns the function that restores it."""
    builtin_compute = tomesd_patch_utils.compute_merge

    def compute_merge(*args):
        return tuple(clock.timed(fn) for fn in clock.timed(builtin_compute)(*args))

    tomesd_patch_utils.compute_merge = compute_merge

    def restore() -> None:
        tomesd_patch_utils.compute_merge = builtin_compute

    return restore


def time_split(pipe, settings: BenchSettings, size: int, batch: int, method: Method,
               device: Device | None = None) -> dict[str, float]:
    """Seconds of one denoiser forward (after one warm-up forward) spent in self-attention, in ToMe's matching
    (plans, merges, unmerges) and in the rest, for ``method`` at ``size``/``batch``. ``rest`` is what remains of
    the whole forward; the three add up to ``total``."""
    clock = SplitClock((device if device is not None else default_device()).synchronize)
    patches: list[ModelPatch] = []
    restore_builtin: Callable[[], None] | None = None
    try:
        configure(pipe, method, settings.max_downsample)
        models = [model for _, model in api.tome_models(pipe)]
        ours = method.name in APPLIED + ("bound",)  # this package's hooks sit on attn1
        for layer in [block.attn1 for model in models for _, block in find_blocks(model)]:
            clock.hook(layer, outer=ours)
        patches = [p for p in (get_patch(m) for m in models) if p is not None]
        for patch in patches:  # an instance attribute over the planner's method that makes a block's plan
            patch.planner.plan = clock.timed(patch.planner.plan)
        if method.name == "builtin":
            restore_builtin = _time_builtin_matching(clock)
        inputs = DenoiserInputs(pipe, size, batch, settings.seed)
        with paddle.no_grad():
            inputs.run()  # warm-up
            clock.attention = clock.matching = 0.0
            start = clock.now()
            inputs.run()
            total = clock.now() - start
    finally:
        clock.remove()
        for patch in patches:
            patch.planner.__dict__.pop("plan", None)
        if restore_builtin is not None:
            restore_builtin()
        api.remove_tome(pipe)
    return {"attention": clock.attention, "matching": clock.matching,
            "rest": total - clock.attention - clock.matching, "total": total}
