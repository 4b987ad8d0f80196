"""Which denoising step a model call belongs to: one generation boundary for every technique that remembers
something between calls (the step cache, ToMe's plan cache with ``recompute_every``).

Every ppdiffusers pipeline runs its denoising loop inside ``self.progress_bar(...)`` and advances the bar once per
denoising step (``progress_bar.update()``, or one item of ``progress_bar(timesteps)``), after the model calls of that
step. While a technique that needs it is applied (:func:`hold` / :func:`release`, counted),
``DiffusionPipeline.progress_bar`` is wrapped: each call of it starts a new :class:`Generation` for the calling thread,
whose ``steps`` count the bar's updates. So a model call knows its step without reading the timestep (nothing comes
back from the device) and whatever pipeline object, class or route reached the model: an img2img pipeline built from
another's components, a refiner, ``pipe.unet.apply_cache()`` with ordinary ``pipe(...)`` calls. Schedulers that call
the model twice per step (Heun, KDPM2) and PNDM's warm-up call are counted as the pipeline counts them. The original
``progress_bar`` is put back when the last holder releases it.

:class:`StepClock` turns that into ``(step, site)`` per model and thread: ``site`` numbers the calls of one step (the
unconditioned half of split guidance, one view of a panorama, the degraded call of self-attention guidance), so each
call site keeps what it remembers apart. A model called outside any pipeline counts every call as a step of its own,
from the clock's last :meth:`StepClock.reset`. A call that does not finish is no step (:meth:`StepClock.untick`). The
listeners of a :class:`Generation` hear when its loop finishes (the step cache warns when it cached nothing).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterable, Iterator, List, Optional, Tuple

import numpy as np

__all__ = ["Generation", "StepClock", "current", "hold", "holders", "relative_step_sizes", "release"]


class _Thread(threading.local):
    generation: Optional[Generation] = None


THREAD = _Thread()  # THREAD.generation: the calling thread's current generation, or None
_LOCK = threading.Lock()
_holders = 0
_original: Any = None  # DiffusionPipeline.progress_bar as found before the first hold()


def current() -> Optional[Generation]:
    """The calling thread's current generation (None outside any pipeline call since the first :func:`hold`)."""
    return THREAD.generation


def relative_step_sizes(timesteps: Any, total: Optional[int]) -> Optional[Tuple[float, ...]]:
    """How far each of a loop's ``total`` steps moves in the model's timestep, relative to the average step: the
    loop runs the last ``total`` of ``timesteps`` (an img2img loop starts part-way), step ``i`` moves from its
    timestep to the next one, and the last step counts as the one before it. None when there is nothing to weigh
    (fewer than two steps, timesteps that do not fall, a length that does not fit).

    >>> relative_step_sizes([981, 961, 941, 921], 4)  # evenly spaced (DDIM): every step weighs 1
    (1.0, 1.0, 1.0, 1.0)
    >>> relative_step_sizes([1000.0, 900.0, 600.0], 3)  # steps of 100 and 300 against their mean 200
    (0.5, 1.5, 1.5)
    """
    try:
        values = np.asarray(timesteps.numpy() if hasattr(timesteps, "numpy") else timesteps, dtype=np.float64)
    except (TypeError, ValueError, RuntimeError):
        return None
    values = values.ravel()
    if total is None or total < 2 or values.size < total:
        return None
    moves = -np.diff(values[values.size - total:])
    if not np.all(np.isfinite(moves)) or not np.all(moves > 0):
        return None
    sizes = (moves / moves.mean()).tolist()
    return tuple(sizes + sizes[-1:])


class Generation:
    """One denoising loop in one thread: ``steps`` is the number of denoising steps the pipeline has finished,
    ``total`` the number its progress bar was given (``total=``, or the length of the timesteps it iterates; None
    when it has none), so the last step is ``total - 1``; ``scheduler`` the pipeline's (None outside one), whose
    timesteps :meth:`step_sizes` reads once, when first asked."""

    __slots__ = ("steps", "outer", "listeners", "total", "scheduler", "sizes")

    def __init__(self, outer: Optional["Generation"], total: Optional[int] = None, scheduler: Any = None) -> None:
        self.steps = 0
        self.outer = outer  # the generation this one is nested in (a pipeline called inside another's loop)
        self.listeners: Optional[List[Callable[[], None]]] = None
        self.total = total
        self.scheduler = scheduler
        self.sizes: Any = False  # what step_sizes() read (False: not read yet)

    def step_sizes(self) -> Optional[Tuple[float, ...]]:
        """The loop's :func:`relative_step_sizes` from its scheduler's ``timesteps`` (read once per generation; a
        scheduler that takes more than one model call per step, such as Heun's, gives None)."""
        if self.sizes is False:
            scheduler = self.scheduler
            usable = scheduler is not None and getattr(scheduler, "order", 1) == 1
            timesteps = getattr(scheduler, "timesteps", None) if usable else None
            self.sizes = None if timesteps is None else relative_step_sizes(timesteps, self.total)
        return self.sizes

    def on_finish(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` (in this thread) when the loop finishes; not when it ends with an exception."""
        if self.listeners is None:
            self.listeners = []
        self.listeners.append(listener)

    def end(self, finished: bool = True) -> None:
        """The loop is over (``finished``: ran to its end): the thread goes back to the generation around it
        (usually none), then the listeners of a finished loop are called."""
        if THREAD.generation is self:
            THREAD.generation = self.outer
            listeners, self.listeners = self.listeners, None
            if finished and listeners:
                for listener in listeners:
                    listener()


def _counted(bar: Iterable[Any], generation: Generation) -> Iterator[Any]:
    """Iterate ``bar`` (the pipeline's progress bar over its timesteps), one denoising step per item."""
    finished = False
    try:
        for step, item in enumerate(bar):
            generation.steps = step
            yield item
        finished = True
    finally:
        generation.end(finished)


class _Bar:
    """The pipeline's progress bar (``total=`` form): ``update`` counts the generation's steps, leaving the
    ``with`` block (or ``close``) ends it; everything else is the bar's."""

    def __init__(self, bar: Any, generation: Generation) -> None:
        self.bar, self.generation = bar, generation

    def __enter__(self) -> "_Bar":
        self.bar.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        self.generation.end(finished=exc[0] is None)
        return self.bar.__exit__(*exc)

    def update(self, n: int = 1) -> Any:
        self.generation.steps += 1
        return self.bar.update(n)

    def close(self) -> Any:
        self.generation.end()
        return self.bar.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.bar, name)


def _length(iterable: Any, total: Any) -> Optional[int]:
    """The number of steps a progress bar was given: ``total``, or the length of ``iterable``; None if neither."""
    if isinstance(total, int) and not isinstance(total, bool) and total > 0:
        return total
    try:
        return len(iterable) if iterable is not None else None
    except TypeError:
        return None


def _progress_bar(self: Any, iterable: Any = None, total: Any = None) -> Any:
    generation = Generation(THREAD.generation, _length(iterable, total), getattr(self, "scheduler", None))
    THREAD.generation = generation
    bar = _original(self, iterable=iterable, total=total)
    if iterable is not None:
        return _counted(bar, generation)
    return _Bar(bar, generation)


_progress_bar.__doc__ = "ppdiffusers' progress bar; each call starts a new generation (ppdiffusers_tome.core.generation)."


def hold() -> None:
    """Count one more user of the generation boundary; the first one wraps ``DiffusionPipeline.progress_bar``."""
    global _holders, _original
    from ppdiffusers import DiffusionPipeline

    with _LOCK:
        if _holders == 0:
            _original = DiffusionPipeline.__dict__["progress_bar"]
            DiffusionPipeline.progress_bar = _progress_bar
        _holders += 1


def release() -> None:
    """One user fewer; the last one puts ``DiffusionPipeline.progress_bar`` back."""
    global _holders, _original
    from ppdiffusers import DiffusionPipeline

    with _LOCK:
        if _holders == 0:
            return
        _holders -= 1
        if _holders == 0:
            DiffusionPipeline.progress_bar = _original
            _original = None
            THREAD.generation = None


def holders() -> int:
    """How many applied techniques use the generation boundary now."""
    return _holders


class _Position(threading.local):
    generation: Optional[Generation] = None
    step = -1
    site = 0
    before: Optional[Tuple[Any, int, int, int]] = None  # the position before the latest tick, for untick


class StepClock:
    """``(step, site)`` of each call of one model, per thread (see the module docstring).

    >>> clock = StepClock()
    >>> [clock.tick() for _ in range(3)]   # outside a pipeline every call is a step
    [(0, 0, True), (1, 0, False), (2, 0, False)]
    >>> clock.reset(); clock.tick()
    (0, 0, True)
    """

    def __init__(self) -> None:
        self._position = _Position()
        self._outside = 0  # the epoch of the calls outside any pipeline: bumped by reset() in any thread
        self._epochs = _Position()

    def tick(self) -> Tuple[int, int, bool]:
        """The position of the call that starts now: ``(step, site, new generation)``."""
        position, generation = self._position, THREAD.generation
        position.before = (position.generation, position.step, position.site, self._epochs.step)
        if generation is not None:
            fresh = position.generation is not generation
            if fresh or position.step != generation.steps:
                position.generation, position.step, position.site = generation, generation.steps, 0
            else:
                position.site += 1
            return position.step, position.site, fresh
        fresh = position.generation is not None or self._epochs.step != self._outside
        if fresh:
            position.generation, position.step, self._epochs.step = None, -1, self._outside
        position.step += 1
        position.site = 0
        return position.step, 0, fresh

    def untick(self) -> None:
        """Take back this thread's latest :meth:`tick`: its call did not finish (an error, Ctrl-C), so it is no
        step, and the next call gets the position it had.

        >>> clock = StepClock()
        >>> clock.tick(); clock.untick(); clock.tick()
        (0, 0, True)
        (0, 0, True)
        """
        position = self._position
        if position.before is not None:
            position.generation, position.step, position.site, self._epochs.step = position.before
            position.before = None

    def reset(self) -> None:
        """Start a new generation for calls outside a pipeline (in every thread), and forget this thread's
        position inside one: the next call of this thread is step 0."""
        self._outside += 1
        self._position.generation = None
        self._position.step = -1

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()
