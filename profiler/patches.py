"""Temporary instrumentation of live objects, undone in reverse order: nothing in the library is edited.

- ``method``: the object's class is swapped for a one-off subclass whose method (``__call__`` included) is the
  replacement. The object keeps its state, its parameters (an mlx module's tree is untouched), its identity
  and every ``isinstance``; attribute writes (tree verification sets each attention's ``rope``) land on it.
- ``attribute``: an attribute of a plain object or a module's global (a sampling function the decoding loop
  calls by name) set for the duration.
"""

from __future__ import annotations

from typing import Callable

_MISSING = object()


class Patches:
    def __init__(self):
        self._undo: list[Callable[[], None]] = []

    def method(self, obj, name: str, make: Callable[[Callable], Callable]) -> None:
        """``obj.name`` becomes ``make(original bound method)``."""
        cls = obj.__class__
        original = getattr(cls, name).__get__(obj, cls)
        replacement = make(original)

        def call(self, *args, **kwargs):
            return replacement(*args, **kwargs)

        sub = type(cls.__name__, (cls,), {name: call, "__module__": cls.__module__, "__qualname__": cls.__qualname__})
        object.__setattr__(obj, "__class__", sub)
        self._undo.append(lambda: object.__setattr__(obj, "__class__", cls))

    def attribute(self, obj, name: str, value) -> None:
        old = vars(obj).get(name, _MISSING)
        setattr(obj, name, value)
        self._undo.append(lambda: setattr(obj, name, old) if old is not _MISSING else delattr(obj, name))

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()

    def __enter__(self) -> "Patches":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()
