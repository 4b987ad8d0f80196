"""What the step cache keeps between calls, as two small typed classes: :class:`KeptStep` (what one full step of a
call site made) and :class:`Site` (everything one call site remembers: its last full steps and, for the adaptive
rule, the previous step's signal and what has accumulated since the last full step, or with the forecast the step
of the next full one).

Both live in the calling thread's state (``StepCache.step.sites``: call site -> :class:`Site`), so threads and call
sites never share them; nothing here is pickled or copied with a model.

>>> site = Site()
>>> site.kept is None, site.accumulated, site.skips
(True, 0.0, 0)
>>> kept = KeptStep(step=3)
>>> kept.outputs, kept.delta
({}, None)
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

__all__ = ["KeptStep", "Site"]


class KeptStep:
    """What one full step of one call site made, for the cached steps after it.

    Attributes:
        step: the 0-based step it was computed at (the forecast's step index).
        shape: the input shape(s) the first deep part saw; a cached step with other shapes runs in full.
        outputs: UNets and ControlNets: the deep parts' outputs by name (``"up_blocks.1"``, ...).
        streams: transformer-only models, while the full step runs: the cached segment's input streams.
        delta: transformer-only models: the segment's contribution (output minus input) per stream (``None`` for a
            stream the block does not return); the whole-model cache: ``(output - input,)``, or ``(output,)`` when
            the two differ in shape (``residual`` tells which).
        residual: the whole-model cache: whether ``delta`` is added to the input (else it is the output itself).
        template: the whole-model cache: the full step's output, whose structure a cached step's output copies.
    """

    __slots__ = ("step", "shape", "outputs", "streams", "delta", "residual", "template")

    def __init__(self, step: int = 0, shape: Any = None, outputs: Optional[Dict[str, Any]] = None,
                 delta: Optional[Tuple[Any, ...]] = None) -> None:
        self.step = step
        self.shape = shape
        self.outputs: Dict[str, Any] = {} if outputs is None else outputs
        self.streams: Optional[Tuple[Any, ...]] = None
        self.delta = delta
        self.residual = True
        self.template: Any = None


class Site:
    """What one call site (one thread, one position in a step: a guidance half, a panorama view) remembers.

    Attributes:
        kept: the last full step (:class:`KeptStep`), or None: then the next call is full.
        earlier: the full step before ``kept`` (kept only with ``forecast="linear"``), or None.
        signal: the adaptive rule's signal of the previous call (the deep part's input), or None.
        accumulated: the relative changes of the signal summed over the steps since the last full step.
        skips: cached steps in a row since the last full step.
        next_full: the rule with the forecast: the first step from which the site runs in full again.
    """

    __slots__ = ("kept", "earlier", "signal", "accumulated", "skips", "next_full")

    def __init__(self) -> None:
        self.kept: Optional[KeptStep] = None
        self.earlier: Optional[KeptStep] = None
        self.signal: Any = None
        self.accumulated = 0.0
        self.skips = 0
        self.next_full = 0
