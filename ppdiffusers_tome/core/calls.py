"""The calls of one model: which are running (so that nothing changes a model under a running forward) and, for
the techniques that remember something between calls, which denoising step and call site each one is.

:class:`ModelCalls` is the outermost hook of every model a technique is applied to (see :mod:`.registry`). It is
added with the first technique and removed with the last; each technique that needs the step clock says so with
:meth:`ModelCalls.use_clock` and lets go with :meth:`ModelCalls.drop_clock`.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, Optional, Set, Tuple

from . import generation
from .registry import LOCK, Hook, add_hook, hooks_of, remove_hook

__all__ = ["CALLS", "ModelCalls", "model_calls", "refuse_if_running"]

CALLS = "calls"  # the name of the hook in a model's registry


class _Local(threading.local):
    depth = 0  # this thread's calls of the model in flight (more than 1: the model called inside its own forward)
    position: Tuple[int, int, bool] = (0, 0, True)  # (step, site, new generation) of the outermost call in flight


class ModelCalls(Hook):
    """The calls of one model in flight, per thread, and its step clock (see the module docstring)."""

    def __init__(self) -> None:
        self.local = _Local()
        self.running: Dict[int, int] = {}  # thread ident -> calls in flight (a thread's entry exists while > 0)
        self.clock: Optional[generation.StepClock] = None
        self.clock_users: Set[str] = set()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        local, ident = self.local, threading.get_ident()
        depth = local.depth + 1
        if depth == 1 and self.clock is not None:
            local.position = self.clock.tick()
        local.depth = depth
        self.running[ident] = depth
        try:
            return self.next(*args, **kwargs)
        except BaseException:
            if depth == 1 and self.clock is not None:
                self.clock.untick()  # a call that did not finish (an error, Ctrl-C) is no step
            raise
        finally:
            local.depth = depth - 1
            if depth == 1:
                self.running.pop(ident, None)
            else:
                self.running[ident] = depth - 1

    # the step clock -----------------------------------------------------------------------------------------------
    def use_clock(self, user: str) -> None:
        """``user`` (a technique) reads :attr:`position`: the clock runs, the generation boundary is held."""
        with LOCK:
            if user in self.clock_users:
                return
            if not self.clock_users:
                self.clock = generation.StepClock()
                generation.hold()
            self.clock_users.add(user)

    def drop_clock(self, user: str) -> None:
        with LOCK:
            if user not in self.clock_users:
                return
            self.clock_users.discard(user)
            if not self.clock_users:
                self.clock = None
                generation.release()

    @property
    def position(self) -> Tuple[int, int, bool]:
        """``(step, site, new generation)`` of this thread's call in flight (see :class:`.generation.StepClock`)."""
        return self.local.position

    def reset_clock(self) -> None:
        """The next call (of this thread, and outside a pipeline of any thread) is step 0 of a new generation."""
        if self.clock is not None:
            self.clock.reset()

    # calls in flight ----------------------------------------------------------------------------------------------
    def in_flight_here(self) -> int:
        return self.local.depth

    def in_flight_elsewhere(self) -> int:
        ident = threading.get_ident()
        return sum(count for thread, count in list(self.running.items()) if thread != ident)

    def __getstate__(self) -> Dict[str, Any]:
        return {"clock_users": set(self.clock_users)}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__()
        for user in state["clock_users"]:
            self.use_clock(user)


def model_calls(model: Any, create: bool = False) -> Optional[ModelCalls]:
    """The :class:`ModelCalls` hook of ``model`` (added, outermost, when ``create`` and missing), or None."""
    registry = hooks_of(model)
    found = registry.get(CALLS) if registry is not None else None
    if found is None and create:
        with LOCK:
            registry = hooks_of(model)
            found = registry.get(CALLS) if registry is not None else None
            if found is None:
                found = ModelCalls()
                add_hook(model, CALLS, found)
    return found


def drop_calls_if_alone(model: Any) -> None:
    """Remove the :class:`ModelCalls` hook of ``model`` when no technique is left on it."""
    with LOCK:
        registry = hooks_of(model)
        if registry is not None and registry.names() == [CALLS]:
            calls = remove_hook(model, CALLS)
            for user in list(calls.clock_users):
                calls.drop_clock(user)


def refuse_if_running(model: Any, name: str, what: str) -> None:
    """Raise ``RuntimeError`` (naming ``what`` is being changed) while a forward of ``model`` runs, in this thread
    (from inside its own forward) or another: hooks changed half-way through a forward would leave merged tokens
    that are never unmerged, or a step that never ends."""
    calls = model_calls(model)
    if calls is None:
        return
    if calls.in_flight_here():
        raise RuntimeError(
            f"cannot change {what} on {name} from inside its own forward call (this thread is running it); "
            "changes take effect between calls: make them after the call returns, e.g. in the pipeline's step "
            "callback (callback_on_step_end)"
        )
    busy = calls.in_flight_elsewhere()
    if busy:
        raise RuntimeError(
            f"cannot change {what} on {name} while {busy} forward call(s) of it are running in other threads; "
            "changes take effect between calls: wait for the calls to finish"
        )
