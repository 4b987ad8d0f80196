"""What one ToMe patch remembers: the record of the call in flight (per thread), the plans kept across denoising
steps (``recompute_every``), and the counters of ``tome_stats``.

Two kinds of per-thread data, kept apart because they live for different lengths of time:

* :class:`CallRecord`: what one forward call needs and forgets at its end (latent size, timestep, the partition
  tables drawn for it, the plans shared between its blocks). The model hook makes one per call and puts back the
  previous one when the call ends, however it ends.
* :class:`PlanCache`: the plans of earlier steps, by block (or level) and call site, for ``recompute_every``. Steps
  and call sites come from the model's step clock (:mod:`ppdiffusers_tome.core.generation`): nothing is read from the
  device to count them.

Nothing here reads a tensor on the host unless a ratio schedule needs the denoising progress as a Python number.
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from typing import Any, Dict, Optional, Tuple

import numpy as np
import paddle

from ..core.registry import StaticGraphError

__all__ = ["CallRecord", "Counters", "PlanCache", "ToMeState", "ToMeStaticGraphError", "refuse_conversion",
           "refuse_dynamic_size", "refuse_dynamic_tokens", "timestep_values"]


try:
    from paddle.jit.sot.psdb import fallback as _run_as_python
except ImportError:  # pragma: no cover - Paddle without SOT

    def _run_as_python() -> None:
        pass


class ToMeStaticGraphError(StaticGraphError):
    """Raised when a ToMe option cannot be converted to a static graph (``paddle.jit.to_static``)."""


def refuse_conversion(scheduled: bool) -> None:
    """Raise :class:`ToMeStaticGraphError` naming the option that needs Python at run time (a ratio schedule reads
    the timestep, ``recompute_every`` counts steps): both would be frozen into a program."""
    # SOT's simulation would hand this error to the user wrapped in an InnerError: have it run this function as
    # plain Python instead (a no-op outside the simulation), so the named error propagates as it is
    _run_as_python()
    what = "a ratio schedule" if scheduled else "recompute_every"
    raise ToMeStaticGraphError(
        f"ToMe with {what} cannot be converted with paddle.jit.to_static (in SOT mode or with full_graph=True): "
        "it reads the timestep or counts steps at run time (the scheduled ratio decides how many tokens merge, a "
        "shape; the plan cache counts steps) and would be frozen into the program. Use a constant ratio and "
        "recompute_every=1 before converting."
    )


def refuse_dynamic_size(model: str, technique: str, shape: Any) -> None:
    """Raise :class:`ToMeStaticGraphError` for a program traced with a dynamic latent height or width (``-1`` in
    ``shape``, ``[B, C, H, W]``): the token grid is a shape, so neither a merge nor ToDo's downsampling can be
    planned on it, and an unplanned program would silently compute vanilla's output."""
    _run_as_python()  # (see refuse_conversion)
    height, width = int(shape[-2]) < 0, int(shape[-1]) < 0
    dynamic = "height and width" if height and width else "height" if height else "width"
    raise ToMeStaticGraphError(
        f"{technique} on {model} cannot be converted with a dynamic latent {dynamic} (the sample's shape while "
        f"tracing is {list(shape)}): it plans on the token grid, whose size must be known when the program is built "
        "(the tokens merged or downsampled are a shape). Give the InputSpec a fixed height and width (e.g. "
        "InputSpec([None, 4, 64, 64]): the batch may stay None, and each size is a program of its own), or convert in "
        "SOT mode (paddle.jit.to_static without full_graph=True), which builds a program per input size."
    )


def refuse_dynamic_tokens(model: str, technique: str, shape: Any) -> None:
    """Raise :class:`ToMeStaticGraphError` for a block whose token count is dynamic (``-1``) while tracing: no grid
    can be found for it, and a block left unplanned would silently compute vanilla's output."""
    _run_as_python()  # (see refuse_conversion)
    raise ToMeStaticGraphError(
        f"{technique} on {model} cannot plan a transformer block whose token count is dynamic in the traced program "
        f"(the block's input is {list(shape)}): the token grid must be known when the program is built. Give the "
        "InputSpec a fixed height and width (and a fixed batch if the model folds the batch into its tokens), or "
        "convert in SOT mode (paddle.jit.to_static without full_graph=True)."
    )


def timestep_values(timestep: Any) -> Optional[np.ndarray]:
    """The distinct timestep values of a call (float64, sorted), or None when there is none. Reads the timestep on
    the host: only a ratio schedule calls this.

    >>> timestep_values([999, 999, 500]).tolist()
    [500.0, 999.0]
    """
    if timestep is None:
        return None
    if isinstance(timestep, paddle.Tensor):
        values = timestep.detach().astype("float64").numpy()
    else:
        try:
            values = np.asarray(timestep, dtype=np.float64)
        except (TypeError, ValueError):
            return None
    values = np.unique(values.reshape(-1))
    return values if values.size else None


def progress_of(timestep: Any, train_timesteps: int, counters: "Counters") -> float:
    """The denoising progress ``1 - t/T`` of a call (0 at pure noise, 1 at the clean image), for a ratio schedule:
    the noisiest item of the batch decides; clipped to [0, 1] with a warning (once) outside it."""
    values = timestep_values(timestep)
    if values is None:
        return 0.0
    if not np.isfinite(values).all():
        raise ValueError(
            f"ToMe got a timestep that is not finite ({values.tolist()}); a ratio schedule needs a finite timestep. "
            "Check the scheduler's timesteps (NaN usually comes from an earlier numeric error)."
        )
    t = float(values[-1])
    progress = 1.0 - t / train_timesteps
    if not 0.0 <= progress <= 1.0 and not counters.warned_timestep_range:
        counters.warned_timestep_range = True
        warnings.warn(
            f"ToMe's ratio schedule got timestep {t:g}, outside [0, {train_timesteps}] (num_train_timesteps of the "
            "pipeline's scheduler, 1000 for a bare model): the progress 1 - t/T is clipped to [0, 1]. Schedulers "
            "with continuous or sigma-based timesteps (EDM) do not fit a ratio schedule; use a constant ratio with "
            "them.",
            UserWarning,
            stacklevel=5,
        )
    return min(max(progress, 0.0), 1.0)


class CallRecord:
    """The call in flight in one thread (see the module docstring). ``kernels`` is the merge core's kernel family
    for this call, ``ratio`` the merge ratio at its progress, ``site`` its call site within the step."""

    __slots__ = ("latent_hw", "timestep", "step_key", "partitions", "shared", "number", "kernels", "ratio",
                 "finest_level", "merged_blocks", "step", "site", "decisions")

    def __init__(self, latent_hw: Optional[Tuple[int, int]], timestep: Any, number: int, kernels: str,
                 ratio: float) -> None:
        self.latent_hw = latent_hw
        self.timestep = timestep  # as passed to the model (a device tensor stays on the device)
        self.step_key: Any = None  # 0-d int64 device tensor made from it when a block first needs a partition
        self.partitions: Dict[str, Any] = {}  # "<h>x<w>..." -> partition table of every block at that grid
        self.shared: Dict[int, Any] = {}  # token count -> plan shared by the blocks at that level
        self.number = number  # which call of the model this is (keys the partition when there is no timestep)
        self.kernels, self.ratio = kernels, ratio
        self.finest_level: Optional[int] = None  # the finest level a transformer block ran at in this call
        self.merged_blocks = 0
        self.step, self.site = 0, 0
        self.decisions: Dict[Any, Any] = {}  # block decisions of this call that did not merge, for the warning


class PlanCache:
    """Plans kept across denoising steps for ``recompute_every``, per thread: by block (or level, with
    ``share_plan="level"``) and call site, each with the step it was made at. Holds at most :data:`MAX_PLANS`, the
    least recently used going first (a plan of the global kind holds about ``22 * B * N`` bytes of index tables)."""

    MAX_PLANS = 512

    def __init__(self, every: Any) -> None:
        self.every = every  # an int, or a tuple of the steps that recompute
        self._local = threading.local()

    def _plans(self) -> "OrderedDict[Tuple[str, int], Tuple[Any, int, Tuple[int, int]]]":
        plans = getattr(self._local, "plans", None)
        if plans is None:
            plans = self._local.plans = OrderedDict()
        return plans

    def clear(self) -> None:
        """Forget this thread's plans (a new generation)."""
        self._plans().clear()

    def lookup(self, key: str, call: CallRecord, batch: int, grid: Tuple[int, int]) -> Any:
        """The plan block (or level) ``key`` may reuse at the call's step and site, or None."""
        plans = self._plans()
        entry = plans.get((key, call.site))
        if entry is None:
            return None
        plan, step, kept_grid = entry
        if plan.batch_size != batch or kept_grid != grid:
            return None
        every = self.every
        reuse = call.step not in every if isinstance(every, tuple) else call.step - step < every
        if not reuse:
            return None
        plans.move_to_end((key, call.site))
        return plan

    def store(self, key: str, call: CallRecord, plan: Any, grid: Tuple[int, int]) -> None:
        plans = self._plans()
        plans[(key, call.site)] = (plan, call.step, grid)
        plans.move_to_end((key, call.site))
        while len(plans) > self.MAX_PLANS:
            plans.popitem(last=False)

    def forget(self, step: int, site: int) -> None:
        """Drop this thread's plans kept at ``step`` by call site ``site`` (a call that did not finish)."""
        plans = self._plans()
        for key in [key for key, entry in plans.items() if key[1] == site and entry[1] == step]:
            del plans[key]

    def __getstate__(self) -> Dict[str, Any]:
        return {"every": self.every}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(state["every"])


class Counters:
    """The counters of ``tome_stats`` (all since ``apply_tome`` or ``reset_tome``) and what the policy chose."""

    NAMES = ("calls", "merges", "plans_computed", "plans_reused", "plans_shared", "blocks_skipped", "blocks_pooled")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        for name in self.NAMES:
            setattr(self, name, 0)
        self.decisions: Dict[int, Any] = {}  # tokens -> the policy's latest decision at that size
        self.warned_no_merge = False
        self.warned_timestep_range = False

    def as_dict(self) -> Dict[str, int]:
        return {name: getattr(self, name) for name in self.NAMES}


# 0.11's name of what ``ModelPatch.state`` returns (the counters of ``tome_stats`` were its public part): kept so that
# imports and ``isinstance`` checks of code written against 0.11 keep working
ToMeState = Counters
