"""What one capability asks of precision kinds, kept beside that capability's own code.

A kind (``Config``) says what a precision *is* and does to a model, its inputs, its backward and its optimizer.
Whatever else a capability needs of it (Lightning's ``precision=`` value, the Trainer's arguments, the layers `tune`
may give it, where the autopilot moves a layer) is an ``Adapter``: a function per kind class, with a default for the
kinds that registered none. The capability defines the adapter and registers the built-in kinds next to it; a
user's kind registers its own in its one file::

    from dtypelab.hf import HF_ARGUMENTS

    @HF_ARGUMENTS.register(MyKind)
    def _(config): return {"bf16": True}, None

A subclass of a registered kind takes its base's function unless it registers its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

R = TypeVar("R")
F = TypeVar("F", bound=Callable[..., Any])


class Adapter(Generic[R]):
    """A function per kind class (found along the kind's bases), else ``default``."""

    def __init__(self, what: str, default: Callable[..., R]) -> None:
        self.what = what  # what the capability asks, in words (for errors and docs)
        self._default = default
        self._by_kind: dict[type, Callable[..., R]] = {}

    def register(self, *kinds: type) -> Callable[[F], F]:
        """Decorate the function that answers for ``kinds`` (and their subclasses)."""
        def add(fn: F) -> F:
            for kind in kinds:
                self._by_kind[kind] = fn
            return fn
        return add

    def __call__(self, config: Any, *args: Any, **kwargs: Any) -> R:
        for cls in type(config).__mro__:
            fn = self._by_kind.get(cls)
            if fn is not None:
                return fn(config, *args, **kwargs)
        return self._default(config, *args, **kwargs)

    def registered(self, config: Any) -> bool:
        """Whether ``config``'s kind (or a base) answers for itself rather than by the default."""
        return any(cls in self._by_kind for cls in type(config).__mro__)


def constant(value: R) -> Callable[..., R]:
    """A default (or a kind's answer) that is one value whatever the config."""
    return lambda config, *args, **kwargs: value


__all__ = ["Adapter", "constant"]
