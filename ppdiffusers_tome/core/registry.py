"""The one way a technique attaches to a layer: the layer's ``forward`` wrapped once, named hooks around it.

Every technique of the package (ToMe, ToDo, the step cache) adds :class:`Hook` objects to layers through
:func:`add_hook` and takes them off with :func:`remove_hook`. The first hook on a layer gives the layer a class of its
own: a subclass of the layer's class, with the same name, whose ``forward`` runs the layer's hooks outermost first,
each around the next, the innermost around the class's own ``forward``. A hook sees every exit of the call it wraps
(a ``try``/``finally`` in its ``__call__`` runs on return, on an exception, on Ctrl-C). Removing the last hook puts
the layer's class back and deletes the one attribute the registry keeps on the layer, so the model's objects,
parameters, state dict and classes are those of the untouched model.

Why a subclass rather than an instance attribute ``forward`` (as diffusers' ``HookRegistry`` sets): Paddle's
``paddle.jit.to_static`` converts a layer's ``forward`` only when it is a real method with a named signature, and a
bound method kept in an instance's ``__dict__`` does not survive pickling. The subclass's ``forward`` is one function
of this module (:class:`_Template`'s), copied per class with the signature of the class's own ``forward``; copies and pickles of a hooked
layer rebuild it from the original class (:meth:`_HookedLayer.__reduce_ex__`).

>>> import paddle
>>> layer = paddle.nn.Linear(2, 2)
>>> class Twice(Hook):
...     def __call__(self, x):
...         return self.next(x) * 2
>>> _ = add_hook(layer, "twice", Twice())
>>> type(layer).__name__, hooks_of(layer).names()
('Linear', ['twice'])
>>> x = paddle.ones([1, 2])
>>> bool((layer(x) == 2 * paddle.nn.functional.linear(x, layer.weight, layer.bias)).all())
True
>>> _ = remove_hook(layer, "twice")
>>> type(layer) is paddle.nn.Linear, hooks_of(layer)
(True, None)
"""

from __future__ import annotations

import inspect
import threading
import types
import weakref
from typing import Any, Callable, Dict, List, Optional

import paddle

__all__ = ["Hook", "Registry", "StaticGraphError", "add_hook", "hooks_of", "original_class", "remove_hook",
           "set_original_class"]

KEY = "_ppdiffusers_tome_hooks"  # the one attribute a hooked layer carries (in its __dict__)
LOCK = threading.RLock()  # held while hooks are added or removed, on any layer


class StaticGraphError(RuntimeError):
    """Raised when something a technique does in Python at run time cannot be frozen into a static graph
    (``paddle.jit.to_static``); the message names the option and what to do instead."""


class Hook:
    """One technique's code around one layer's forward. A subclass overrides ``__call__``, which receives the
    layer's call arguments and calls ``self.next(*args, **kwargs)`` (the next hook, or the layer's own forward) at
    most once; ``self.layer`` is the layer. The registry sets both when the hook is added."""

    next: Callable[..., Any]
    layer: Any

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.next(*args, **kwargs)

    def __getstate__(self) -> Dict[str, Any]:
        # the chain is rebuilt by the registry of the copy (see Registry.__setstate__)
        return {name: value for name, value in self.__dict__.items() if name != "next"}


class _Own:
    """The end of a chain: the forward of the layer's original class."""

    def __init__(self, cls: type, layer: Any) -> None:
        self.forward, self.layer = cls.forward, layer

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(self.layer, *args, **kwargs)


class Registry:
    """The hooks of one layer by name, outermost first; kept in the layer's ``__dict__`` while it has any."""

    def __init__(self, layer: Any, cls: type) -> None:
        self.layer = layer
        self.cls = cls  # the layer's class before the first hook
        self.hooks: Dict[str, Hook] = {}
        self.head: Callable[..., Any] = _Own(cls, layer)

    def names(self) -> List[str]:
        return list(self.hooks)

    def get(self, name: str) -> Optional[Hook]:
        return self.hooks.get(name)

    def _link(self) -> None:
        chain: Callable[..., Any] = _Own(self.cls, self.layer)
        for hook in reversed(list(self.hooks.values())):
            hook.next, hook.layer = chain, self.layer
            chain = hook
        self.head = chain

    def __getstate__(self) -> Dict[str, Any]:
        return {"layer": self.layer, "cls": self.cls, "hooks": self.hooks}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._link()


# hooked classes ---------------------------------------------------------------------------------------------------
class _Template:
    """Holds the code of every hooked class's ``forward`` (named ``forward``: Paddle's AST conversion finds a
    method's code by its name in its source)."""

    def forward(self, *args, **kwargs):
        registry = self.__dict__.get(KEY)
        if registry is None:  # the hooks are gone, but paddle.jit.to_static kept this function: the class's own
            return type(self).forward(self, *args, **kwargs)
        return registry.head(*args, **kwargs)


def _rebuild(cls: type) -> Any:
    """A blank instance of ``cls``'s hooked class (copies and pickles of a hooked layer start here)."""
    return paddle.nn.Layer.__new__(_hooked_class(cls))


class _HookedLayer:
    """Mixed into every hooked class: copies and pickles name the original class, never the hooked one."""

    def __reduce_ex__(self, protocol: int) -> Any:
        return _rebuild, (original_class(self),), self.__getstate__()

    def __copy__(self) -> Any:
        """``copy.copy``: a second name for the same layer (see :func:`_names`)."""
        twin = _rebuild(original_class(self))
        twin.__dict__.update(self.__dict__)  # what copy.copy does for any layer: shares sub-layers and parameters
        with LOCK:
            group = _NAMES.get(self)
            if group is None:
                group = _NAMES[self] = weakref.WeakSet([self])
            group.add(twin)
            _NAMES[twin] = group
        return twin


# ``copy.copy`` of a hooked layer shares its sub-layers, parameters and registry with the original: one layer under
# two names. So that adding or removing hooks through either name changes both (neither keeps a class or a registry
# the other has lost), such names form a group, and the registry's changes of class and attribute go to each of them.
# (Either name's call runs the chain of the shared registry, which ends in the forward of the name the first hook was
# added through: the two share every sub-layer, parameter and buffer that forward reads.)
_NAMES: "weakref.WeakKeyDictionary[Any, weakref.WeakSet]" = weakref.WeakKeyDictionary()


def _names(layer: Any) -> List[Any]:
    """``layer`` and its shallow copies (made while it had hooks) that are still alive."""
    group = _NAMES.get(layer)
    return [layer] if group is None else list(group)


_CLASSES: Dict[type, type] = {}


def _hooked_class(cls: type) -> type:
    """The subclass of ``cls`` whose ``forward`` runs the hooks (one per class, made on first use)."""
    hooked = _CLASSES.get(cls)
    if hooked is None:
        template = _Template.forward
        forward = types.FunctionType(template.__code__, template.__globals__, "forward")
        forward.__qualname__ = f"{cls.__qualname__}.forward"
        forward.__doc__ = cls.forward.__doc__
        forward.__signature__ = inspect.signature(cls.forward)  # what to_static and inspect read
        hooked = type(cls.__name__, (_HookedLayer, cls), {"forward": forward, "__module__": cls.__module__,
                                                          "__qualname__": cls.__qualname__, "_hooked_from": cls})
        _CLASSES[cls] = hooked
    return hooked


def original_class(layer: Any) -> type:
    """The class ``layer`` had before its first hook (its own class when it has none)."""
    return type(layer).__dict__.get("_hooked_from", type(layer))


def set_original_class(layer: Any, cls: type) -> None:
    """Give ``layer`` the class ``cls`` underneath its hooks (for undoing another library's class swap on a layer
    that already has hooks); a layer without hooks simply gets ``cls``."""
    with LOCK:
        registry = hooks_of(layer)
        if registry is None:
            layer.__class__ = cls
            return
        registry.cls = cls
        for alias in _names(layer):
            if alias.__dict__.get(KEY) is registry:
                alias.__class__ = _hooked_class(cls)
        registry._link()


# adding and removing --------------------------------------------------------------------------------------------
def hooks_of(layer: Any) -> Optional[Registry]:
    """The :class:`Registry` of ``layer``, or None when it has no hook."""
    return getattr(layer, "__dict__", {}).get(KEY)


def add_hook(layer: paddle.nn.Layer, name: str, hook: Hook, outer: bool = True) -> Registry:
    """Add ``hook`` to ``layer`` under ``name`` (outermost unless ``outer=False``), replacing a hook of that name.

    Example:
        >>> import paddle
        >>> layer = paddle.nn.Linear(2, 2)
        >>> add_hook(layer, "noop", Hook()).names()
        ['noop']
        >>> remove_hook(layer, "noop") is not None
        True
    """
    if not isinstance(layer, paddle.nn.Layer):
        raise TypeError(f"hooks go on a paddle.nn.Layer; got {type(layer).__name__}")
    with LOCK:
        registry = hooks_of(layer)
        if registry is None:
            registry = Registry(layer, type(layer))
            for alias in _names(layer):  # (a shallow copy of the layer gets the same registry)
                if hooks_of(alias) is None:
                    alias.__dict__[KEY] = registry
                    alias.__class__ = _hooked_class(registry.cls)
        registry.hooks.pop(name, None)
        if outer:
            registry.hooks = {name: hook, **registry.hooks}
        else:
            registry.hooks[name] = hook
        registry._link()
        return registry


def remove_hook(layer: Any, name: str) -> Optional[Hook]:
    """Take the hook ``name`` off ``layer`` and return it (None when there is none). Removing the last hook gives
    the layer its class back and deletes the registry.

    Example:
        >>> import paddle
        >>> remove_hook(paddle.nn.Linear(2, 2), "absent") is None
        True
    """
    with LOCK:
        registry = hooks_of(layer)
        if registry is None or name not in registry.hooks:
            return None
        hook = registry.hooks.pop(name)
        if registry.hooks:
            registry._link()
        else:
            for alias in _names(layer):
                if alias.__dict__.get(KEY) is registry:
                    alias.__class__ = registry.cls
                    del alias.__dict__[KEY]
        return hook
